"""Correctness sections: eager checks vs references and the torch backend, CUDA-graph
replays with changing inputs (every replay checked on the device), two slots on two
streams (DBO).

Peer-written buffers are snapshotted right after the step that writes them, on the same
stream, as an engine's attention would read them: after a later step of the schedule
peers may already be writing the next call's data there (shared/design/domain.md).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch
from gpu_common import Ctx, GpuStuck, barrier, go, sync
from gpu_kernels import nccl_a2a_fused, nccl_agrs_fused, nccl_gather
from gpu_modules import DECODE, STEPS, Registry, run_steps, step_caller
from gpu_ref import Ref, bad_count, case_inputs, case_refs, kv_case, make_case, random_layout

KV_ROWS = (1, 7, 1000)


def _snapshotter(snaps: dict[str, torch.Tensor]) -> Any:
    """An ``after`` hook that copies every step output into ``snaps`` (allocated once)."""

    def after(step: str, outs: dict[str, torch.Tensor]) -> None:
        for name, t in outs.items():
            if name not in snaps:
                snaps[name] = torch.empty_like(t)
            snaps[name].copy_(t)

    return after


def _score(snaps: dict[str, torch.Tensor], refs: dict[str, Ref]) -> dict[str, Any]:
    """Per buffer: wrong elements and max error (host values: this syncs)."""
    res: dict[str, Any] = {}
    for name, got in snaps.items():
        if name in refs:
            try:
                bad, err = bad_count(got, refs[name])
                res[name] = {"bad": int(bad.item()), "max_err": float(err.item())}
            except ValueError as exc:  # wrong shape: report it, score the other buffers
                res[name] = {"bad": -1, "error": str(exc)}
    return res


def correctness(ctx: Ctx, reg: Registry, heads: list[int], tokens: list[int],
                backends: list[str]) -> None:
    """Every decode schedule and backend vs float64 references; backends vs each other."""
    recs = ctx.results.setdefault("correctness", [])
    W = ctx.world
    for H in heads:
        for T in tokens:
            if not go(ctx, 60.0):
                ctx.error("correctness", f"H{H}/T{T}", "skipped: deadline")
                continue
            case = make_case(T, H, W, seed=1000 * H + T, device=ctx.device)
            inputs = case_inputs(case, ctx.rank)
            for schedule in DECODE:
                refs = case_refs(case, ctx.rank, schedule)
                per_backend: dict[str, dict[str, torch.Tensor]] = {}
                for backend in backends:
                    item = f"{schedule}/{backend}/H{H}/T{T}"
                    snaps: dict[str, torch.Tensor] = {}
                    try:
                        inst = reg.get(schedule, H, backend)
                        run_steps(inst, schedule, inputs, slot=0, after=_snapshotter(snaps))
                        barrier(ctx)
                        score = _score(snaps, refs)
                        per_backend[backend] = snaps
                        ok = bool(score) and all(v["bad"] == 0 for v in score.values())
                        recs.append({"schedule": schedule, "backend": backend, "H": H, "T": T,
                                     "ok": ok, "buffers": score})
                    except GpuStuck:
                        raise
                    except Exception as exc:  # noqa: BLE001 - record and go on
                        ctx.error("correctness", item, exc)
                        recs.append({"schedule": schedule, "backend": backend, "H": H,
                                     "T": T, "ok": False, "error": str(exc)[:300]})
                        barrier(ctx)
                if len(per_backend) == 2:
                    recs.append(_cross(schedule, H, T, per_backend, refs))
            _baselines_check(ctx, case, inputs, recs)
            ctx.log(f"correctness H={H} T={T}: "
                    f"{sum(r['ok'] for r in recs)}/{len(recs)} ok so far")
    _kv_check(ctx, reg, backends, recs)


def _cross(schedule: str, H: int, T: int, per_backend: dict[str, dict[str, torch.Tensor]],
           refs: dict[str, Ref]) -> dict[str, Any]:
    """The two backends against each other: bit-exact where exact, max diff elsewhere."""
    (name_a, a), (name_b, b) = per_backend.items()
    diffs: dict[str, Any] = {}
    ok = True
    for buf in sorted(set(a) & set(b)):
        if buf in refs and refs[buf].kind == "exact":
            bad, _ = bad_count(a[buf], Ref("exact", b[buf]))
            diffs[buf] = {"bad": int(bad.item())}
            ok &= diffs[buf]["bad"] == 0
        elif a[buf].shape == b[buf].shape:
            d = (a[buf].double() - b[buf].double()).abs().nan_to_num(nan=float("inf"))
            diffs[buf] = {"max_diff": float(d.max().item()) if d.numel() else 0.0}
    return {"schedule": schedule, "backend": f"{name_a}=={name_b}", "H": H, "T": T,
            "ok": ok, "buffers": diffs}


def _baselines_check(ctx: Ctx, case: Any, inputs: dict[str, torch.Tensor],
                     recs: list[dict[str, Any]]) -> None:
    """The NCCL baselines compute the same thing (else their timings mean nothing)."""
    refs = case_refs(case, ctx.rank, "kimi_k3_dcp_ag_rs")
    o, lse = inputs["o_part"], inputs["lse_part"]
    sl, qsl = inputs["seq_lens"], inputs["query_start_loc"]
    makers = {
        "nccl_gather": lambda: nccl_gather(inputs["q_local"], case.H),
        "nccl_agrs_fused": lambda: nccl_agrs_fused(o, lse, sl, qsl, ctx.rank, ctx.world),
        "nccl_a2a_fused": lambda: nccl_a2a_fused(o, lse, sl, qsl, ctx.world),
    }
    for name, make in makers.items():
        try:
            fn, got = make()
            fn()
            sync(ctx)
            bad, err = bad_count(got, refs["q_full" if name == "nccl_gather" else "out"])
            recs.append({"schedule": "baseline", "backend": name, "H": case.H, "T": case.T,
                         "ok": int(bad.item()) == 0,
                         "buffers": {"out": {"bad": int(bad.item()),
                                             "max_err": float(err.item())}}})
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("correctness", f"baseline {name} H{case.H} T{case.T}", exc)
            recs.append({"schedule": "baseline", "backend": name, "H": case.H, "T": case.T,
                         "ok": False, "error": str(exc)[:300]})
        barrier(ctx)


def _kv_check(ctx: Ctx, reg: Registry, backends: list[str], recs: list[dict[str, Any]]
              ) -> None:
    for n_rows in KV_ROWS:
        kv, full = kv_case(n_rows, ctx.world, seed=7 + n_rows, device=ctx.device)
        for backend in backends:
            try:
                snaps: dict[str, torch.Tensor] = {}
                inst = reg.get("kv_gather", None, backend)
                run_steps(inst, "kv_gather", {"kv_local": kv[ctx.rank].contiguous()},
                          after=_snapshotter(snaps))
                barrier(ctx)
                score = _score(snaps, {"kv_full": Ref("exact", full)})
                recs.append({"schedule": "kv_gather", "backend": backend, "H": None,
                             "T": n_rows, "ok": bool(score) and score["kv_full"]["bad"] == 0,
                             "buffers": score})
            except GpuStuck:
                raise
            except Exception as exc:  # noqa: BLE001
                ctx.error("correctness", f"kv_gather/{backend}/N{n_rows}", exc)
                recs.append({"schedule": "kv_gather", "backend": backend, "H": None,
                             "T": n_rows, "ok": False, "error": str(exc)[:300]})
                barrier(ctx)


def _layout_table(T: int, B: int, W: int, n: int, seed: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """n random layouts of fixed B as device tables ([n, B], [n, B+1]): one upload."""
    rnd = random.Random(seed)
    rows = [random_layout(rnd, T, B, W) for _ in range(n)]
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    qsl = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    return seq, qsl


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
        try:
            bad = _graph_job(ctx, reg, schedule, H, T, replays, backend)
            n_bad = int((bad > 0).sum().item())
            first = int(torch.nonzero(bad)[0, 0].item()) if n_bad else None
            recs.append({"schedule": schedule, "H": H, "T": T, "replays": replays,
                         "bad_replays": n_bad, "first_bad": first, "ok": n_bad == 0,
                         "graph": ctx.cuda})
            ctx.log(f"graphs {item}: {replays} replays, {n_bad} bad")
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

    static = {k: v.clone() for k, v in new_inputs(replays)[0].items()}
    snaps: dict[str, torch.Tensor] = {}
    after = _snapshotter(snaps)
    graph: Any = None
    if ctx.cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_steps(inst, schedule, static, after=after)
        torch.cuda.current_stream().wait_stream(side)
        barrier(ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_steps(inst, schedule, static, after=after)
        barrier(ctx)
    bad = torch.zeros(replays, dtype=torch.int64, device=dev)
    for i in range(replays):
        fresh, refs = new_inputs(i)
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


def dbo(ctx: Ctx, reg: Registry, H: int, T: int, iters: int, crossed: bool = False,
        backend: str = "symm_mem") -> None:
    """Two slots on two streams, steps interleaved; ``crossed``: odd ranks start slot 1."""
    recs = ctx.results.setdefault("dbo", [])
    W, dev = ctx.world, ctx.device
    order = [1, 0] if crossed and ctx.rank % 2 else [0, 1]
    streams: list[Any] = [torch.cuda.Stream(), torch.cuda.Stream()] if ctx.cuda else [None] * 2
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
            for i in range(iters):
                envs: list[dict[str, Any]] = [{}, {}]
                refs: list[dict[str, Ref]] = [{}, {}]
                for s in order:
                    with _on(streams[s]):
                        case = make_case(T, H, W, seed=70_000 + 2 * i + s, device=dev,
                                         layout=(tabs[s][0][i], tabs[s][1][i]))
                        envs[s], refs[s] = case_inputs(case, ctx.rank), case_refs(
                            case, ctx.rank, schedule)
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
                if i % 20 == 19:
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


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
