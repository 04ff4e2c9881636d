"""Benchmark section: generated steps vs NCCL baselines, the signal floor, KV-gather bandwidth.

Latency: median microseconds per call over CUDA-graph replays of ``iters`` calls, max over
ranks (support.context.bench). KV bandwidth: bytes RECEIVED per rank per call, (W-1) * N * 576
* 2, divided by the time per call; the peer copy is measured the same way (every rank
copies the same bytes into every peer's symmetric buffer at once, copy engine).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.support.baselines import SymmScratch, nccl_a2a_fused, nccl_agrs_fused, nccl_gather
from benchmarks.support.context import Ctx, GpuStuck, barrier, bench, go, warm
from benchmarks.support.modules import Registry, run_steps, step_caller
from benchmarks.support.reference import KV_K, case_inputs, make_case, plain_layout

PEER_COPY_BYTES = 128 * 2**20  # 134 MB, as in shared/design/device.md
# method -> (schedule, steps timed together)
GENERATED: dict[str, tuple[str, tuple[str, ...]]] = {
    "direct_gather": ("kimi_k3_dcp", ("query_gather",)),
    "staging_gather": ("kimi_k3_dcp_staging", ("query_gather", "query_copy")),
    "fused_combine": ("kimi_k3_dcp_fused", ("combine",)),
    "unfused_exchange_merge": ("kimi_k3_dcp", ("out_exchange", "merge")),
    "unfused_exchange": ("kimi_k3_dcp", ("out_exchange",)),
    "unfused_merge": ("kimi_k3_dcp", ("merge",)),
    "agrs_generated": ("kimi_k3_dcp_ag_rs", ("lse_gather", "correct", "out_scatter")),
    "step_direct_unfused": ("kimi_k3_dcp", ("query_gather", "out_exchange", "merge")),
    "step_direct_fused": ("kimi_k3_dcp_fused", ("query_gather", "combine")),
}


def _record(ctx: Ctx, method: str, H: int | None, T: int | None, fn: Callable[[], Any],
            iters: int, reps: int, **extra: Any) -> float | None:
    """Time ``fn``; append a latency record (or an error) to the results."""
    item = f"{method}/H{H}/T{T}"
    try:
        us = bench(ctx, fn, iters=iters, reps=reps)
        ctx.results.setdefault("latency", []).append(
            {"method": method, "H": H, "T": T, "us": us, **extra})
        return us
    except GpuStuck:
        raise
    except Exception as exc:  # noqa: BLE001 - record and go on
        ctx.error("bench", item, exc)
        barrier(ctx)
        return None


def _chain(callers: list[Callable[[], Any]]) -> Callable[[], None]:
    def fn() -> None:
        for c in callers:
            c()

    return fn


def bench_all(ctx: Ctx, reg: Registry, heads: list[int], tokens: list[int], iters: int,
              reps: int, kv_mbs: list[int], backend: str = "symm_mem") -> None:
    """Floor and peer copy, then every (H, T): generated methods and baselines; then KV."""
    scratch = None
    if ctx.cuda and ctx.comm is None:  # symmetric memory: one GPU per rank
        try:
            scratch = SymmScratch(ctx.rank, ctx.world, ctx.device, PEER_COPY_BYTES)
            floor = _record(ctx, "signal_floor", None, None, scratch.floor_fn(), iters, reps)
            ctx.results["floor_us"] = floor
            us = _record(ctx, "peer_copy_134MB", None, None,
                         scratch.peer_copy_fn(PEER_COPY_BYTES), 10, 5)
            if us:
                recv = (ctx.world - 1) * PEER_COPY_BYTES
                ctx.results["peer_copy"] = {"bytes_per_peer": PEER_COPY_BYTES,
                                            "bytes_recv_per_rank": recv, "us": us,
                                            "gbps": recv / us / 1e3}
            ctx.log(f"floor {floor} us, peer copy {ctx.results.get('peer_copy')}")
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("bench", "symm scratch (floor, peer copy)", exc)
    for H in heads:
        for T in tokens:
            if not go(ctx, 40.0):
                ctx.error("bench", f"H{H}/T{T}", "skipped: deadline")
                continue
            _bench_config(ctx, reg, H, T, iters, reps, backend)
            ctx.log(f"bench H={H} T={T}: " + ", ".join(
                f"{r['method']}={r['us']:.1f}" for r in ctx.results.get("latency", [])
                if r["H"] == H and r["T"] == T))
        _floor_again(ctx, scratch, iters, reps)
    _bench_kv(ctx, reg, kv_mbs, scratch, reps, backend)


def _floor_again(ctx: Ctx, scratch: SymmScratch | None, iters: int, reps: int) -> None:
    """The floor drifts by up to ~0.5 us between measurements (clocks, NVLink state):
    measure it again after each H and use the median of all samples for the ratios."""
    if scratch is None or ctx.results.get("floor_us") is None:
        return
    samples = ctx.results.setdefault("floor_samples_us", [ctx.results["floor_us"]])
    us = bench(ctx, scratch.floor_fn(), iters=iters, reps=reps)
    samples.append(us)
    ctx.results["floor_us"] = statistics.median(samples)
    ctx.log(f"floor again {us:.2f} us; median of {len(samples)}: {ctx.results['floor_us']:.2f}")


def _bench_config(ctx: Ctx, reg: Registry, H: int, T: int, iters: int, reps: int,
                  backend: str) -> None:
    case = make_case(T, H, ctx.world, seed=5 + T, device=ctx.device, layout=plain_layout(T),
                     garbage=False)
    inputs = case_inputs(case, ctx.rank)
    envs: dict[str, dict[str, Any]] = {}
    for method, (schedule, steps) in GENERATED.items():
        try:
            inst = reg.get(schedule, H, backend)
            if schedule not in envs:  # one eager run binds T and yields every buffer
                warm(ctx, lambda: run_steps(inst, schedule, inputs))  # noqa: B023
                envs[schedule] = run_steps(inst, schedule, inputs)
                barrier(ctx)
            callers = [step_caller(inst, schedule, s, envs[schedule], slot=0) for s in steps]
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("bench", f"{method}/H{H}/T{T}", exc)
            barrier(ctx)
            continue
        _record(ctx, method, H, T, _chain(callers), iters, reps, kind="generated")
    if ctx.comm is not None:  # NCCL cannot put several ranks on one GPU
        return
    o, lse = inputs["o_part"], inputs["lse_part"]
    sl, qsl = inputs["seq_lens"], inputs["query_start_loc"]
    baselines = {
        "nccl_gather": lambda: nccl_gather(inputs["q_local"], H)[0],
        "nccl_agrs_fused": lambda: nccl_agrs_fused(o, lse, sl, qsl, ctx.rank, ctx.world)[0],
        "nccl_a2a_fused": lambda: nccl_a2a_fused(o, lse, sl, qsl, ctx.world)[0],
    }
    for method, make in baselines.items():
        try:
            fn = make()
        except Exception as exc:  # noqa: BLE001
            ctx.error("bench", f"{method}/H{H}/T{T}", exc)
            continue
        _record(ctx, method, H, T, fn, iters, reps, kind="baseline")


def _bench_kv(ctx: Ctx, reg: Registry, kv_mbs: list[int], scratch: SymmScratch | None,
              reps: int, backend: str) -> None:
    recs = ctx.results.setdefault("kv", [])
    for mb in kv_mbs:
        if not go(ctx, 30.0):
            ctx.error("bench", f"kv {mb} MB", "skipped: deadline")
            continue
        rows = mb * 2**20 // (KV_K * 2)
        nbytes = rows * KV_K * 2
        recv = (ctx.world - 1) * nbytes
        iters = 20 if mb <= 4 else 10
        rec: dict[str, Any] = {"mb_per_rank": mb, "rows_per_rank": rows,
                               "bytes_per_rank": nbytes, "bytes_recv_per_rank": recv}
        try:
            inst = reg.get("kv_gather", None, backend)
            kv_local = torch.randn(rows, KV_K, device=ctx.device).to(torch.bfloat16)
            warm(ctx, lambda: run_steps(inst, "kv_gather", {"kv_local": kv_local}))  # noqa: B023
            env = run_steps(inst, "kv_gather", {"kv_local": kv_local})
            barrier(ctx)
            gather = step_caller(inst, "kv_gather", "kv_gather", env)
            release = step_caller(inst, "kv_gather", "release", env)
            for method, fn in (("kv_gather+release", _chain([gather, release])),
                               ("kv_gather", gather)):
                us = _record(ctx, method, None, None, fn, iters, reps, mb_per_rank=mb)
                if us:
                    rec[method] = {"us": us, "gbps": recv / us / 1e3}
        except GpuStuck:
            raise
        except Exception as exc:  # noqa: BLE001
            ctx.error("bench", f"kv_gather {mb} MB", exc)
            barrier(ctx)
        if scratch is not None:
            us = _record(ctx, "peer_copy", None, None, scratch.peer_copy_fn(nbytes), iters,
                         reps, mb_per_rank=mb)
            if us:
                rec["peer_copy"] = {"us": us, "gbps": recv / us / 1e3}
        recs.append(rec)
        ctx.log(f"kv {mb} MB/rank: " + ", ".join(
            f"{k} {v['gbps']:.0f} GB/s" for k, v in rec.items() if isinstance(v, dict)))
