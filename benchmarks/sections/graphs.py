"""Section graphs: each schedule's calls captured in one CUDA graph per H x T, replayed
with new inputs copied into the captured tensors before every replay (a pool of POOL
cases, taken in turn: no two consecutive replays see the same inputs), every replay
checked on the device."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.support.checking import layout_table as _layout_table
from benchmarks.support.checking import snapshotter as _snapshotter
from benchmarks.support.context import Ctx, GpuStuck, barrier, capture, go, side_stream, sync, warm
from benchmarks.support.modules import Registry, run_steps
from benchmarks.support.reference import Ref, bad_count, case_inputs, case_refs, kv_case, make_case
from benchmarks.support.steps import DECODE

POOL = 8  # distinct cases per configuration (each one's float64 references, made once)


def graphs(ctx: Ctx, reg: Registry, configs: list[tuple[int, int]], replays: int,
           backend: str = "symm_mem") -> None:
    """Capture each schedule's calls once; replay with new inputs; check every replay."""
    recs = ctx.results.setdefault("graphs", [])
    jobs = [(s, H, T) for s in DECODE for H, T in configs]
    jobs += [("kv_gather", None, n) for n in (1000,)]
    for schedule, H, T in jobs:
        item = f"{schedule}/H{H}/T{T}"
        if not go(ctx, 45.0):
            ctx.error("graphs", item, "skipped: deadline")
            continue
        n = replays * (len(configs) if H is None else 1)  # kv_gather: one config, all of them
        try:
            bad = _graph_job(ctx, reg, schedule, H, T, n, backend)
            n_bad = int((bad > 0).sum().item())
            first = int(torch.nonzero(bad)[0, 0].item()) if n_bad else None
            recs.append({"schedule": schedule, "H": H, "T": T, "replays": n,
                         "bad_replays": n_bad, "first_bad": first, "ok": n_bad == 0,
                         "graph": ctx.cuda})
            ctx.log(f"graphs {item}: {n} replays, {n_bad} bad")
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("graphs", item, exc)
            recs.append({"schedule": schedule, "H": H, "T": T, "ok": False,
                         "error": str(exc)[:300]})
        barrier(ctx)


def _graph_job(ctx: Ctx, reg: Registry, schedule: str, H: int | None, T: int, replays: int,
               backend: str) -> torch.Tensor:
    W, dev = ctx.world, ctx.device
    inst = reg.get(schedule, H, backend)
    if H is None:
        def new_inputs(i: int) -> tuple[dict[str, torch.Tensor], dict[str, Ref]]:
            kv, full = kv_case(T, W, seed=50_000 + i, device=dev)
            return {"kv_local": kv[ctx.rank]}, {"kv_full": Ref("exact", full)}
    else:
        B = max(1, min(T, 4))
        seq_tab, qsl_tab = _layout_table(T, B, W, replays + 1, seed=H * 7 + T, device=dev)

        def new_inputs(i: int) -> tuple[dict[str, torch.Tensor], dict[str, Ref]]:
            case = make_case(T, H, W, seed=90_000 + i, device=dev,
                             layout=(seq_tab[i], qsl_tab[i]))
            return case_inputs(case, ctx.rank), case_refs(case, ctx.rank, schedule)

    first, first_refs = new_inputs(replays)
    pool = [new_inputs(k) for k in range(min(POOL, replays))]
    static = {k: v.clone() for k, v in first.items()}
    snaps: dict[str, torch.Tensor] = {}
    after = _snapshotter(snaps)
    graph: Any = None
    if ctx.cuda:
        side = side_stream(ctx)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm(ctx, lambda: run_steps(inst, schedule, static, after=after))
            run_steps(inst, schedule, static, after=after)
        torch.cuda.current_stream().wait_stream(side)
        for name, got in snaps.items():  # the check's temporaries, allocated before replays
            if name in first_refs:
                bad_count(got, first_refs[name])
        barrier(ctx)
        graph = torch.cuda.CUDAGraph()
        with capture(ctx, graph):
            run_steps(inst, schedule, static, after=after)
        barrier(ctx)
    bad = torch.zeros(replays, dtype=torch.int64, device=dev)
    for i in range(replays):
        fresh, refs = pool[i % len(pool)]
        for k, v in fresh.items():
            static[k].copy_(v)
        if graph is not None:
            graph.replay()
        else:  # CPU dry run: no graphs, same flow eagerly
            run_steps(inst, schedule, static, after=after)
        for name, got in snaps.items():
            if name in refs:
                bad[i] += bad_count(got, refs[name])[0]
        if i % 100 == 99:
            sync(ctx, timeout=60.0)
    sync(ctx, timeout=60.0)
    del graph
    return bad
