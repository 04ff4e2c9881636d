"""Plumbing for benchmarks/gpu.py: run context, deadlines, syncs that cannot hang, timing.

Everything here works on CUDA (NCCL) and on CPU (gloo, the ``--dry-run``): on CPU there
are no streams, graphs or events, so syncs are no-ops and timing uses the host clock.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class GpuStuck(RuntimeError):
    """The device did not finish queued work before a deadline (a hang, most likely)."""


@dataclass
class Ctx:
    """Everything a section needs: who we are, where results go, how much time is left."""

    rank: int
    world: int
    device: torch.device
    out_dir: Path
    deadline: float  # time.monotonic() value at which the run must stop
    quick: bool = False
    dry_run: bool = False
    comm: Any = None  # one-GPU runs: the dcpc.runtime.local.LocalRank of this thread
    t0: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        """True when running on GPUs (NCCL), False for the CPU dry run."""
        return self.device.type == "cuda"

    def left(self) -> float:
        """Seconds left before the run's deadline."""
        return self.deadline - time.monotonic()

    def log(self, *parts: object, all_ranks: bool = False) -> None:
        """Print a progress line (rank 0 only unless ``all_ranks``), flushed at once."""
        if self.rank == 0 or all_ranks:
            stamp = f"[r{self.rank} {time.monotonic() - self.t0:6.1f}s]"
            print(stamp, *parts, flush=True)

    def error(self, section: str, item: str, exc: BaseException | str) -> None:
        """Record an error (with a short traceback) in the results and print it."""
        if isinstance(exc, BaseException):
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            text = f"{type(exc).__name__}: {exc}"
        else:
            tb, text = "", exc
        self.results.setdefault("errors", []).append(
            {"section": section, "item": item, "rank": self.rank, "error": text[:2000],
             "traceback": tb[-4000:]}
        )
        print(f"[r{self.rank}] ERROR {section}/{item}: {text[:500]}", file=sys.stderr, flush=True)


def sync(ctx: Ctx, timeout: float = 60.0, streams: list[Any] | None = None) -> None:
    """Wait for queued device work without ever blocking in C: poll events, raise on timeout."""
    if not ctx.cuda:
        return
    events = []
    for s in streams or [torch.cuda.current_stream()]:
        ev = torch.cuda.Event()
        ev.record(s)
        events.append(ev)
    limit = time.monotonic() + min(timeout, max(ctx.left(), 1.0))
    while not all(ev.query() for ev in events):
        if time.monotonic() > limit:
            raise GpuStuck(f"device work did not finish within {timeout:.0f} s (hang?)")
        time.sleep(0.0005)


def barrier(ctx: Ctx) -> None:
    """A group barrier after the device is idle (so no rank races ahead into peers' buffers)."""
    sync(ctx)
    if ctx.comm is not None:
        ctx.comm.group.barrier()
    elif ctx.cuda:
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def all_gather_objects(ctx: Ctx, value: Any) -> list[Any]:
    """Every rank's ``value`` (host objects), in rank order."""
    if ctx.comm is None:
        out: list[Any] = [None] * ctx.world
        dist.all_gather_object(out, value)
        return out
    group = ctx.comm.group
    box = group.__dict__.setdefault("_bench_exchange", [None] * ctx.world)
    box[ctx.rank] = value
    group.barrier()
    out = list(box)
    group.barrier()  # nobody overwrites the box before every rank has read it
    return out


def all_max(ctx: Ctx, value: float) -> float:
    """The maximum of a float over all ranks."""
    if ctx.comm is not None:
        return max(all_gather_objects(ctx, float(value)))
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_sum(ctx: Ctx, value: float) -> float:
    """The sum of a float over all ranks."""
    if ctx.comm is not None:
        return sum(all_gather_objects(ctx, float(value)))
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def warm(ctx: Ctx, fn: Callable[[], object]) -> None:
    """One-GPU runs: run ``fn`` with Triton launches compiling and loading only, then a
    barrier, so that no rank JIT-compiles or loads a module while a peer's kernel spins
    (dcpc.runtime.local). Elsewhere nothing."""
    if ctx.comm is None:
        return
    from dcpc.runtime.local import compile_only

    with compile_only():
        fn()
    barrier(ctx)


def side_stream(ctx: Ctx, index: int = 0) -> Any:
    """A stream for this rank's side work: one of the rank's own on one GPU (a new one
    could be a peer's: dcpc.runtime.local), else a new one."""
    if ctx.comm is not None:
        return ctx.comm.extra_streams[index]
    return torch.cuda.Stream()


def capture(ctx: Ctx, graph: Any) -> Any:
    """The capture context: one rank after another on one GPU, else torch's own."""
    if ctx.comm is not None:
        return ctx.comm.capture(graph)
    return torch.cuda.graph(graph)


def go(ctx: Ctx, reserve: float) -> bool:
    """Collective: True on every rank iff every rank has more than ``reserve`` seconds left.

    Deciding together keeps the ranks' collective calls matched when time runs out.
    One-GPU runs give each W its own small budget: their reserve is at most 8 s.
    """
    if ctx.comm is not None:
        reserve = min(reserve, 8.0)
    return all_max(ctx, 0.0 if ctx.left() > reserve else 1.0) == 0.0


def bench(ctx: Ctx, fn: Callable[[], object], iters: int = 50, reps: int = 15) -> float:
    """Median microseconds per call, max over ranks.

    CUDA: warm up twice on a side stream, capture a graph of ``iters`` calls, replay it
    ``reps`` times between barriers, time each replay with CUDA events (as
    shared/lab/baselines.py does). CPU: host clock around ``iters`` eager calls.
    """
    if not ctx.cuda:
        fn()
        barrier(ctx)
        times = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
        return all_max(ctx, statistics.median(times))
    side = side_stream(ctx)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm(ctx, fn)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    barrier(ctx)
    graph = torch.cuda.CUDAGraph()
    with capture(ctx, graph):
        for _ in range(iters):
            fn()
    try:
        graph.replay()
        barrier(ctx)
        times = []
        for _ in range(reps):
            barrier(ctx)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            sync(ctx, timeout=30.0)
            times.append(start.elapsed_time(end) * 1000.0 / iters)
        return all_max(ctx, statistics.median(times))
    finally:
        del graph


def metadata(ctx: Ctx, argv: list[str]) -> dict[str, Any]:
    """Date, device, versions, commit, world size: what a reader needs to trust the numbers."""
    meta: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "world": ctx.world,
        "dry_run": ctx.dry_run,
        "quick": ctx.quick,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - metadata must never stop a run
        meta["triton"] = f"unavailable: {exc}"
    if ctx.cuda:
        meta["device"] = torch.cuda.get_device_name(ctx.device)
        try:
            meta["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # noqa: BLE001
            meta["nccl"] = f"unknown: {exc}"
    else:
        meta["device"] = "cpu (dry run, gloo)"
    meta["commit"] = os.environ.get("COMMIT") or _git_commit()
    meta["env"] = {k: os.environ.get(k) for k in (
        "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
        "TRITON_INTERPRET")}
    return meta


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (a reader never sees half a file); tolerate non-JSON values."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    for _ in range(3):  # another thread may be mutating the dict (the deadline watchdog)
        try:
            text = json.dumps(data, indent=1, default=str, allow_nan=True)
            break
        except RuntimeError:
            time.sleep(0.05)
    else:
        return
    tmp.write_text(text)
    os.replace(tmp, path)
