"""Section host: host time per eager call of every generated method, next to the
torch.distributed call it replaces (engines run DCP eagerly outside CUDA graphs, where
the host is the bottleneck; target <= 15 us a call).

One thread, one rank (W = 1 through ``local``): the Python and launch path of a method is
the same at every W, and one thread measures it without W threads sharing the GIL. The
anchors are NCCL calls in a world-1 process group (the calls vLLM makes), a bare Triton
launch and a bare torch op (floors). Each number: median over ``reps`` runs of ``calls``
back-to-back calls, host clock only (the device catches up afterwards).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from benchmarks.support.modules import Registry, run_steps, step_caller
from benchmarks.support.reference import case_inputs, make_case, plain_layout
from benchmarks.support.steps import DECODE, STEPS

# generated method -> what it replaces (the anchor's name in the results)
ANCHOR = {
    "query_gather": "all_gather_into_tensor", "lse_gather": "all_gather_into_tensor",
    "kv_gather": "all_gather_into_tensor", "out_exchange": "all_to_all_single x2",
    "combine": "all_to_all_single x2", "out_scatter": "reduce_scatter_tensor",
    "release": "all_reduce (barrier)", "merge": "triton launch (floor)",
    "correct": "triton launch (floor)", "query_copy": "torch copy_ (floor)",
}


@triton.jit
def _touch(x):
    tl.store(x, tl.load(x) + 1)


def _host_us(fn: Callable[[], Any], calls: int, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(samples)


def _kernels(inst: Any) -> list[Any]:
    """The launched kernels of an instance's generated module (dcpc.runtime.fastlaunch)."""
    import sys

    from dcpc.runtime.fastlaunch import FastKernel

    return [v for v in vars(sys.modules[type(inst).__module__]).values()
            if isinstance(v, FastKernel)]


def _paired_us(fn: Callable[[], Any], kernels: list[Any], calls: int, reps: int
               ) -> tuple[float, float]:
    """(host us per call through the fast launch path, through Triton's own), measured
    in turn, rep after rep, so that drifts of the host clock hit both alike."""
    fast, slow = [], []
    was = [k._on for k in kernels]
    try:
        for _ in range(reps):
            for on, into in ((True, fast), (False, slow)):
                for k in kernels:  # on and off in turn, whatever DCPC_FAST_LAUNCH says
                    k._on = on
                into.append(_host_us(fn, calls, 1))
    finally:
        for k, w in zip(kernels, was, strict=True):
            k._on = w
    return statistics.median(fast), statistics.median(slow)


def _anchors(device: torch.device, H: int, T: int, calls: int, reps: int) -> dict[str, float]:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
    q = torch.randn(T, H, 576, device=device).to(torch.bfloat16)
    q_out = torch.empty_like(q)
    o = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    o_out = torch.empty_like(o)
    lse = torch.randn(T, H, device=device)
    lse_out = torch.empty_like(lse)
    token = torch.zeros(1, device=device)
    one = torch.zeros(1, dtype=torch.int32, device=device)

    def a2a() -> None:
        dist.all_to_all_single(o_out, o)
        dist.all_to_all_single(lse_out, lse)

    return {
        "all_gather_into_tensor": _host_us(lambda: dist.all_gather_into_tensor(q_out, q),
                                           calls, reps),
        "all_to_all_single x2": _host_us(a2a, calls, reps),
        "reduce_scatter_tensor": _host_us(lambda: dist.reduce_scatter_tensor(o_out, o),
                                          calls, reps),
        "all_reduce (barrier)": _host_us(lambda: dist.all_reduce(token), calls, reps),
        "triton launch (floor)": _host_us(lambda: _touch[(1,)](one), calls, reps),
        "torch copy_ (floor)": _host_us(lambda: q_out.copy_(q), calls, reps),
    }


def host_overhead(modules_dir: Any, device: torch.device, H: int = 64, T: int = 8,
                  calls: int = 200, reps: int = 7) -> dict[str, Any]:
    """{"methods": [{schedule, method, host_us, host_us_guard_off, host_us_triton_launch,
    anchor, anchor_us}], "anchors": {...}}: every method with the run-time guard on (the
    default) and off, each through the fast launch path (the default) and Triton's."""
    from dcpc.runtime.local import LocalGroup

    rank = LocalGroup(1, device).ranks[0]
    case = make_case(T, H, 1, seed=3, device=device, layout=plain_layout(T), garbage=False)
    inputs = case_inputs(case, 0)
    anchors = _anchors(device, H, T, calls, reps)
    kv = torch.randn(1024, 576, device=device).to(torch.bfloat16)
    jobs: list[tuple[str, int | None, dict[str, Any]]] = [(s, H, inputs) for s in DECODE]
    jobs.append(("kv_gather", None, {"kv_local": kv}))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for guard in (True, False):
        reg = Registry(modules_dir, rank, device, extra={"guard": guard})
        for schedule, heads, env_in in jobs:
            inst = reg.get(schedule, heads, "local")
            env = run_steps(inst, schedule, env_in)
            kernels = _kernels(inst)
            for step, _ in STEPS[schedule]:
                us, triton_us = _paired_us(step_caller(inst, schedule, step, env), kernels,
                                           calls, reps)
                anchor = ANCHOR.get(step)
                row = rows.setdefault((schedule, step), {
                    "schedule": schedule, "method": step, "H": heads, "T": T,
                    "anchor": anchor, "anchor_us": anchors.get(anchor)})
                row["host_us" if guard else "host_us_guard_off"] = us
                row["host_us_triton_launch" if guard else "host_us_guard_off_triton_launch"] = \
                    triton_us
        reg.close_all()
    return {"methods": list(rows.values()), "anchors": anchors, "H": H, "T": T,
            "calls": calls, "reps": reps, "world": 1, "target_us": 15.0}
