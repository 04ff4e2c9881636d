"""Section dbo: two slots on two streams per rank (dual-batch overlap), steps interleaved,
both slots checked every iteration; ``crossed``: odd ranks start slot 1."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.support.checking import layout_table as _layout_table
from benchmarks.support.checking import on_stream as _on
from benchmarks.support.checking import snapshotter as _snapshotter
from benchmarks.support.context import Ctx, GpuStuck, barrier, go, side_stream, sync, warm
from benchmarks.support.modules import Registry, step_caller
from benchmarks.support.reference import Ref, bad_count, case_inputs, case_refs, make_case
from benchmarks.support.steps import DECODE, STEPS

POOL = 4  # distinct cases per slot and configuration, taken in turn


def dbo(ctx: Ctx, reg: Registry, H: int, T: int, iters: int, crossed: bool = False,
        backend: str = "symm_mem") -> None:
    """Two slots on two streams, steps interleaved; ``crossed``: odd ranks start slot 1."""
    recs = ctx.results.setdefault("dbo", [])
    W, dev = ctx.world, ctx.device
    order = [1, 0] if crossed and ctx.rank % 2 else [0, 1]
    streams: list[Any] = ([side_stream(ctx, 0), side_stream(ctx, 1)] if ctx.cuda
                          else [None] * 2)
    B = max(1, min(T, 4))
    if crossed and not ctx.cuda:  # one host thread per rank cannot run two slots at once
        ctx.results.setdefault("notes", []).append("dbo crossed: skipped without CUDA")
        return
    for schedule in DECODE:
        item = f"{schedule}/H{H}/T{T}/{'crossed' if crossed else 'same'}"
        if not go(ctx, 45.0):
            ctx.error("dbo", item, "skipped: deadline")
            continue
        try:
            inst = reg.get(schedule, H, backend)
            tabs = [_layout_table(T, B, W, iters, seed=31 * s + T, device=dev) for s in (0, 1)]
            bad = [torch.zeros(iters, dtype=torch.int64, device=dev) for _ in (0, 1)]
            snaps: list[dict[str, torch.Tensor]] = [{}, {}]
            for st in streams:  # the tables and counters were made on the current stream
                if st is not None:
                    st.wait_stream(torch.cuda.current_stream())

            pool: list[list[tuple[dict[str, Any], dict[str, Ref]]]] = [[], []]
            for s in order:  # POOL cases per slot, made once, taken in turn
                with _on(streams[s]):
                    for i in range(min(POOL, iters)):
                        case = make_case(T, H, W, seed=70_000 + 2 * i + s, device=dev,
                                         layout=(tabs[s][0][i], tabs[s][1][i]))
                        pool[s].append((case_inputs(case, ctx.rank),
                                        case_refs(case, ctx.rank, schedule)))

            def iteration(i: int, inst: Any = inst, schedule: str = schedule,
                          pool: Any = pool, snaps: Any = snaps, bad: Any = bad) -> None:
                envs: list[dict[str, Any]] = [{}, {}]
                refs: list[dict[str, Ref]] = [{}, {}]
                for s in order:
                    env, ref = pool[s][i % len(pool[s])]
                    envs[s], refs[s] = dict(env), ref
                for step, _ in STEPS[schedule]:
                    for s in order:
                        with _on(streams[s]):
                            outs = step_caller(inst, schedule, step, envs[s], slot=s)()
                            _snapshotter(snaps[s])(step, outs)
                            envs[s].update(outs)
                for s in order:
                    with _on(streams[s]):
                        for name, got in snaps[s].items():
                            if name in refs[s]:
                                bad[s][i] += bad_count(got, refs[s][name])[0]

            if ctx.comm is not None:  # one GPU: compile and load first (outputs are junk)
                warm(ctx, lambda: iteration(0))
                sync(ctx, timeout=60.0, streams=streams)
                for b in bad:
                    b.zero_()
                for st in streams:
                    st.wait_stream(torch.cuda.current_stream())
            for i in range(iters):
                iteration(i)
                if i % 20 == 19 or ctx.comm is not None:  # one GPU: a hang shows at once
                    sync(ctx, timeout=60.0, streams=streams if ctx.cuda else None)
            sync(ctx, timeout=60.0, streams=streams if ctx.cuda else None)
            n_bad = [int((b > 0).sum().item()) for b in bad]
            recs.append({"schedule": schedule, "H": H, "T": T, "iters": iters,
                         "order": "crossed" if crossed else "same", "bad_slot0": n_bad[0],
                         "bad_slot1": n_bad[1], "ok": n_bad == [0, 0]})
            ctx.log(f"dbo {item}: bad iterations slot0={n_bad[0]} slot1={n_bad[1]}")
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("dbo", item, exc)
            recs.append({"schedule": schedule, "H": H, "T": T, "ok": False,
                         "order": "crossed" if crossed else "same", "error": str(exc)[:300]})
        barrier(ctx)
