"""Why the KV gather stops at ~75-80% of the copy engine: variants timed side by side.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/probe_kv.py \\
        --modules build/generated

Each variant moves the same bytes as kv_gather (every rank's [N, 576] bf16 rows into
row j * W + rank of every rank's [W * N, 576] buffer) and is timed like gpu.py's
benchmarks (medians over CUDA-graph replays, max over ranks); GB/s = bytes received per
rank / time. Variants:
- module: the generated kv_gather step as shipped;
- module tiles 4x1024: the same kernel with whole-row tiles (16 B per lane, 1 KiB per warp
  store, 44% of lanes masked: 576 = 512 + 64);
- module push only: the kernel without its local copy (NOT a gather; it isolates the
  NVLink push);
- copy engine 2D: cudaMemcpy2DAsync (width 1152 B, pitch W * 1152 B) into every peer's
  buffer and our own, then one signal/wait kernel (checked for correctness once);
- pull: every rank LOADS peers' rows from their symmetric source buffers (a source that
  is symmetric memory; not what kv_gather's contract says) and stores them locally, then
  one signal/wait kernel (checked once);
- peer copy: the contiguous copy-engine copy the targets are measured against.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.support.baselines import SymmScratch, signal_floor_kernel  # noqa: E402
from benchmarks.support.context import Ctx, barrier, bench  # noqa: E402
from benchmarks.support.modules import load_class  # noqa: E402

K = 576
PUSH_LOOP = "        for k in range(WORLD):\n            peer = (RANK + k) % WORLD\n"


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (by soname), for cudaMemcpy2DAsync."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return lib
    raise OSError("no libcudart found")


def push_only_class(modules: Path) -> type:
    """kv_gather with the local copy removed (a bandwidth probe, not a gather)."""
    text = (modules / "kv_gather.py").read_text()
    if PUSH_LOOP not in text:
        raise RuntimeError("kv_gather.py: push loop not found (template changed?)")
    folder = Path(tempfile.mkdtemp(prefix="probe_kv_"))
    (folder / "kv_gather.py").write_text(
        text.replace(PUSH_LOOP, PUSH_LOOP.replace("range(WORLD)", "range(1, WORLD)")))
    return load_class(folder, "kv_gather")


def gathered_ok(ctx: Ctx, call: object, dst: torch.Tensor, rows: int, seed: int) -> bool:
    """Run ``call`` once; then row j * W + p of ``dst`` must hold rank p's row j, where rank
    p's rows are randn(rows, K) from a CUDA generator seeded ``seed + p``."""
    call()  # type: ignore[operator]
    torch.cuda.synchronize()
    barrier(ctx)
    got = dst.view(rows, ctx.world, K)
    for p in range(ctx.world):
        gen = torch.Generator(device=ctx.device).manual_seed(seed + p)
        want = torch.randn(rows, K, device=ctx.device, generator=gen).to(torch.bfloat16)
        if not torch.equal(got[:, p], want):
            return False
    return True


@triton.jit
def pull_kernel(src_ptrs, dst, rows, RANK: tl.constexpr, WORLD: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row j of rank p's source -> row j * WORLD + p of our dst, for every p (peers first)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    col_tiles = tl.cdiv(576, BLOCK_C)
    n_tiles = tl.cdiv(rows, BLOCK_R) * col_tiles
    for i in range(0, tl.cdiv(n_tiles, programs)):
        tile = i * programs + pid
        r = (tile // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = (tile % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (r < rows)[:, None] & (c < 576)[None, :]
        for k in range(1, WORLD + 1):
            p = (RANK + k) % WORLD
            src = tl.load(src_ptrs + p).to(tl.pointer_type(tl.bfloat16))
            vals = tl.load(src + r.to(tl.int64)[:, None] * 576 + c[None, :], mask=m)
            tl.store(dst + (r.to(tl.int64) * WORLD + p)[:, None] * 576 + c[None, :], vals, mask=m)


class Pull:
    """Every rank loads its peers' rows (sources in symmetric memory), then signal + wait."""

    def __init__(self, ctx: Ctx, rows: int, scratch: SymmScratch, programs: int = 128) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.ctx, self.rows, self.scratch, self.programs = ctx, rows, scratch, programs
        self.src = symm_mem.empty(rows * K, dtype=torch.bfloat16, device=ctx.device)
        handle = symm_mem.rendezvous(self.src, dist.group.WORLD.group_name)
        self.ptrs = torch.tensor([handle.get_buffer(p, (rows * K,), torch.bfloat16).data_ptr()
                                  for p in range(ctx.world)], dtype=torch.int64,
                                 device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(2000 + ctx.rank)
        self.src.copy_(torch.randn(rows, K, device=ctx.device, generator=gen).flatten())
        self.dst = torch.empty(ctx.world * rows, K, dtype=torch.bfloat16, device=ctx.device)
        torch.cuda.synchronize()
        barrier(ctx)

    def __call__(self) -> None:
        pull_kernel[(self.programs,)](self.ptrs, self.dst, self.rows, RANK=self.ctx.rank,
                                      WORLD=self.ctx.world, BLOCK_R=64, BLOCK_C=64,
                                      num_warps=4)
        s = self.scratch
        signal_floor_kernel[(1,)](s.sig_ptrs, s.epochs, CH=2, RANK=self.ctx.rank,
                                  WORLD=self.ctx.world, NP=s.NPROG, num_warps=1)

    def check(self) -> bool:
        """After one call: row j * W + p of dst holds rank p's row j, for every p."""
        return gathered_ok(self.ctx, self, self.dst, self.rows, 2000)


class CopyEngine2D:
    """Strided copy-engine gather into symmetric buffers of our own, then signal + wait."""

    def __init__(self, ctx: Ctx, rows: int, scratch: SymmScratch) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.ctx, self.rows, self.scratch = ctx, rows, scratch
        W, rank = ctx.world, ctx.rank
        self.buf = symm_mem.empty(W * rows * K, dtype=torch.bfloat16, device=ctx.device)
        handle = symm_mem.rendezvous(self.buf, dist.group.WORLD.group_name)
        self.dsts = [handle.get_buffer(p, (W * rows * K,), torch.bfloat16).data_ptr()
                     + rank * K * 2 for p in range(W)]
        gen = torch.Generator(device=ctx.device).manual_seed(1000 + rank)
        self.src = torch.randn(rows, K, device=ctx.device, generator=gen).to(torch.bfloat16)
        self.lib = cudart()
        torch.cuda.synchronize()
        barrier(ctx)

    def __call__(self) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        W = self.ctx.world
        for k in range(1, W + 1):  # peers first, our own copy last
            dst = self.dsts[(self.ctx.rank + k) % W]
            err = self.lib.cudaMemcpy2DAsync(dst, W * K * 2, self.src.data_ptr(), K * 2, K * 2,
                                             self.rows, 4, stream)
            if err:
                raise RuntimeError(f"cudaMemcpy2DAsync failed: error {err}")
        s = self.scratch
        signal_floor_kernel[(1,)](s.sig_ptrs, s.epochs, CH=1, RANK=self.ctx.rank,
                                  WORLD=W, NP=s.NPROG, num_warps=1)

    def check(self) -> bool:
        """After one call: row j * W + p holds rank p's row j, for every p."""
        return gathered_ok(self.ctx, self, self.buf, self.rows, 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--modules", type=Path, default=Path("build/generated"))
    ap.add_argument("--mb", default="16,64")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    out = Path(os.environ.get("OUT", "/tmp"))
    ctx = Ctx(rank, world, device, out, deadline=time.monotonic() + 300)
    mbs = [int(x) for x in args.mb.split(",")]
    top = max(mbs) * 2**20
    scratch = SymmScratch(rank, world, device, top)
    shipped, push_only = load_class(args.modules, "kv_gather"), push_only_class(args.modules)
    results = []
    for mb in mbs:
        rows = mb * 2**20 // (K * 2)
        recv = (world - 1) * rows * K * 2
        kv = torch.randn(rows, K, device=device).to(torch.bfloat16)
        timed = {}
        for label, cls, tiles in (("module", shipped, None),
                                  ("module tiles 4x1024", shipped, (4, 1024)),
                                  ("module push only", push_only, None)):
            inst = cls(dist.group.WORLD, sizes={"N": rows}, device=device, backend="symm_mem")
            if tiles:
                inst._tune["kv_gather"].tiles[0] = tiles
            timed[label] = bench(ctx, lambda i=inst, x=kv: i.kv_gather(x), iters=args.iters,
                                 reps=args.reps)
            inst.close()
            barrier(ctx)
        ce = CopyEngine2D(ctx, rows, scratch)
        ok = ce.check()
        timed["copy engine 2D"] = bench(ctx, ce, iters=args.iters, reps=args.reps)
        pull = Pull(ctx, rows, scratch)
        pull_ok = pull.check()
        timed["pull"] = bench(ctx, pull, iters=args.iters, reps=args.reps)
        timed["peer copy"] = bench(ctx, scratch.peer_copy_fn(rows * K * 2), iters=args.iters,
                                   reps=args.reps)
        row = {"mb_per_rank": mb, "copy_engine_2d_correct": ok, "pull_correct": pull_ok,
               **{k: {"us": v, "gbps": recv / v / 1e3} for k, v in timed.items()}}
        results.append(row)
        ctx.log(f"{mb} MB/rank (2D copy correct: {ok}, pull correct: {pull_ok}): " + ", ".join(
            f"{k} {v:.1f} us = {recv / v / 1e3:.0f} GB/s" for k, v in timed.items()))
    if rank == 0:
        (out / "probe_kv.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
