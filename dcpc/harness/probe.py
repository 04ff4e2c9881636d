"""A small Triton kernel that exercises HostHeap on its own (no generated code).

Every program pushes its part of this rank's row into every peer's buffer, then
publishes an epoch into the peer's signal slot with release semantics, and spins
(acquire) until every peer's program of the same index has published. Run in
children started by ``dcpc.harness.launch`` (TRITON_INTERPRET=1 is set there).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
import triton
import triton.language as tl

from dcpc.runtime.host import HostHeap, segment_prefix, shm_dir


@triton.jit
def _push_and_signal(
    src, data_ptrs, sig_ptrs, epochs, n,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    row = tl.load(src + idx, mask=mask)
    for peer in tl.static_range(WORLD):
        dst = tl.load(data_ptrs + peer).to(tl.pointer_type(tl.float32))
        tl.store(dst + RANK * n + idx, row, mask=mask)
    epoch = tl.load(epochs + pid) + 1
    tl.store(epochs + pid, epoch)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        sig = tl.load(sig_ptrs + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(sig + RANK * nprog + pid, epoch, sem="release", scope="sys")
    mine = tl.load(sig_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        while tl.atomic_add(mine + peer * nprog + pid, 0, sem="acquire", scope="sys") - epoch < 0:
            pass


def _own_segments(pid: int | None = None) -> list[str]:
    prefix = segment_prefix(pid)
    return [f for f in os.listdir(shm_dir()) if f.startswith(prefix)]


def heap_probe(
    rank: int, world: int, *, n: int = 96, block: int = 32, iters: int = 10,
    poison: bool = True, seed: int = 0, jitter_s: float = 0.004,
) -> dict[str, Any]:
    """Push-and-signal ``iters`` times; return what the test asserts on."""
    nprog = triton.cdiv(n, block)
    heap = HostHeap(None, "cpu", poison=poison)
    data, sigs = heap.allocate([world * n * 4, world * nprog * 4 + 3], poison=None)
    report: dict[str, Any] = {
        "segments_left": _own_segments(),
        "poison_nan": bool(torch.isnan(data.view(torch.float32, (world * n,))).all()),
        "first_bytes": data.local[:4].tolist(),
        "ptr_is_local": int(data.peer_ptrs[rank]) == data.local.data_ptr(),
        "aligned": all(int(p) % 256 == 0 for p in list(data.peer_ptrs) + list(sigs.peer_ptrs)),
        "sig_nbytes": int(sigs.local.numel()),
    }
    # The signal bank must start at zero: a poisoned (-1) slot would read as old.
    sigs.local.zero_()
    heap.barrier()
    epochs = torch.zeros(nprog, dtype=torch.int32)
    out = data.view(torch.float32, (world, n))
    rng = random.Random(seed * 1000 + rank)
    mismatches = 0
    start = time.perf_counter()
    for it in range(iters):
        gen = torch.Generator().manual_seed(seed * 10_000 + it * 100 + rank)
        row = torch.randn(n, generator=gen)
        if rng.random() < 0.5:
            time.sleep(rng.random() * jitter_s)
        _push_and_signal[(nprog,)](
            row, data.peer_ptrs, sigs.peer_ptrs, epochs, n, RANK=rank, WORLD=world, BLOCK=block
        )
        want = torch.stack([
            torch.randn(n, generator=torch.Generator().manual_seed(seed * 10_000 + it * 100 + r))
            for r in range(world)
        ])
        mismatches += int(not torch.equal(out, want))
        heap.barrier()  # nobody pushes the next row before everyone has checked this one
    report["ms_per_iter"] = 1000 * (time.perf_counter() - start) / max(iters, 1)
    report["mismatches"] = mismatches
    report["epochs"] = epochs.tolist()
    heap.close()
    heap.close()  # idempotent
    report["closed"] = heap.closed
    return report


def crash_after_allocate(rank: int, world: int) -> None:
    """Allocate, then die without closing: nothing may be left in /dev/shm."""
    heap = HostHeap(None, "cpu")
    heap.allocate([1024, 4096])
    os._exit(3)


def killed_during_allocate(rank: int, world: int) -> list[str]:
    """Rank 0 starts an allocation and is SIGKILLed by rank 1 while it waits for its
    peers (its segment created, not yet unlinked): rank 1 returns what rank 0 left."""
    import signal

    import torch.distributed as dist

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        HostHeap(None, "cpu").allocate([4096])  # never returns: rank 1 kills this rank
        return []
    prefix = segment_prefix(pids[0])  # while rank 0 lives: its start time is readable
    deadline = time.monotonic() + 60
    while not (left := [f for f in os.listdir(shm_dir()) if f.startswith(prefix)]):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 created no segment within 60 s")
        time.sleep(0.01)
    os.kill(pids[0], signal.SIGKILL)
    return left


def sleep_on_rank(rank: int, world: int, *, sleeper: int = 1, seconds: float = 3600.0) -> int:
    """Rank ``sleeper`` never returns in time; the others return their rank."""
    if rank == sleeper:
        time.sleep(seconds)
    return rank


def fail_on_rank(rank: int, world: int, *, failing: int = 0) -> int:
    if rank == failing:
        raise ValueError(f"rank {rank} fails on purpose")
    return rank
