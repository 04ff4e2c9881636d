"""Sweep the generated kernels' launch knobs on GPUs and print the best per size.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tune_gpu.py \
        --modules build/generated

Knobs (dcpc.runtime.module.Tune): ``num_warps`` and ``block`` (elements per tile; both
decided at construction), ``programs`` (the most programs a launch uses) and
``tiles_per_program`` (below that, one program per this many tiles; both per call).
Timing is benchmarks/gpu_common.bench: medians over CUDA-graph replays, max over ranks.
The results (JSON) feed the defaults in dcpc/codegen/ctx.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.support.context import Ctx, barrier, bench, go  # noqa: E402
from benchmarks.support.modules import load_class  # noqa: E402

D, DV = 576, 512


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cases(H: int, W: int, device: torch.device) -> list[dict[str, Any]]:
    """(schedule, step, label, sizes, argument factory) for each swept call."""
    out = []
    for T in (1, 8, 64, 512):  # labels: "gather T=8", "fused T=64", "a2a T=1", "kv 16MB"
        q = torch.randn(T, H // W, D, device=device).to(torch.bfloat16)
        out.append(dict(schedule="kimi_k3_dcp", step="query_gather", label=f"gather T={T}",
                        sizes={"H": H, "T": 512}, args=(q,)))
        o = torch.randn(T, H, DV, device=device).to(torch.bfloat16)
        lse = torch.randn(T, H, device=device)
        B = min(T, 256)  # requests; each has T // B query tokens
        seq = torch.full((B,), 1000, dtype=torch.int32, device=device)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=device) * (T // B)
        out.append(dict(schedule="kimi_k3_dcp_fused", step="combine", label=f"fused T={T}",
                        sizes={"H": H, "T": 512}, args=(o, lse, seq, qsl)))
        out.append(dict(schedule="kimi_k3_dcp", step="out_exchange", label=f"a2a T={T}",
                        sizes={"H": H, "T": 512}, args=(o, lse)))
    for mb in (1, 16, 64):
        n = mb * (1 << 20) // (D * 2)
        kv = torch.randn(n, D, device=device).to(torch.bfloat16)
        out.append(dict(schedule="kv_gather", step="kv_gather", label=f"kv {mb}MB",
                        sizes={"N": 65536}, args=(kv,), bytes=n * D * 2 * (W - 1)))
    return out


def sweep_one(ctx: Ctx, cls: type, case: dict[str, Any], group: Any, iters: int,
              spin_limit: int, verbose: bool, debug: bool, knobs: argparse.Namespace
              ) -> list[dict]:
    rows = []
    top = max(knobs.programs)
    for num_warps in knobs.warps:
        for block in knobs.blocks:
            tuning = {case["step"]: {"programs": top, "num_warps": num_warps, "block": block}}
            inst = cls(group, sizes=case["sizes"], device=ctx.device, backend="symm_mem",
                       tuning=tuning, spin_limit=spin_limit)
            tune = inst._tune[case["step"]]
            if debug:
                inst._trap = False  # record a timed-out wait instead of trapping
            fn = getattr(inst, case["step"])
            grids = [(p, 1) for p in knobs.programs] + [(top, t) for t in knobs.per]
            for programs, per in grids:
                tune.programs, tune.tiles_per_program = programs, per
                inst._plans.clear()  # the grid changed: forget the recorded launches
                if verbose:
                    ctx.log(f"  {case['label']} warps={num_warps} block={block} "
                            f"programs={programs} per={per}")
                us = bench(ctx, lambda f=fn: f(*case["args"]), iters=iters, reps=5)
                if debug:
                    try:
                        inst.check_errors()
                    except Exception as exc:  # noqa: BLE001 - a diagnosis, printed
                        bank = inst._bank
                        print(f"[r{ctx.rank}] {case['label']} warps={num_warps} block={block} "
                              f"programs={programs} per={per}: {exc}\n epochs={bank.epochs[:2, :8]}"
                              f"\n sig={bank.sig[:2, :, :8]}", flush=True)
                        raise
                rows.append(dict(num_warps=num_warps, block=block, programs=programs,
                                 tiles_per_program=per, us=us))
            inst.close()
            barrier(ctx)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modules", default="build/generated")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--only", default="",
                        help="comma list of substrings; a case runs when its label has one")
    parser.add_argument("--programs", type=_ints, default=[2, 4, 8, 16, 32, 64, 128],
                        help="grid sizes swept (the largest is also the signal bank's width)")
    parser.add_argument("--per", type=_ints, default=[2, 4],
                        help="tiles_per_program values swept at the largest grid")
    parser.add_argument("--warps", type=_ints, default=[4, 8])
    parser.add_argument("--blocks", type=_ints, default=[2048, 4096, 8192])
    parser.add_argument("--deadline", type=float, default=500.0, help="seconds for the sweep")
    parser.add_argument("--spin-limit", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="log every configuration")
    parser.add_argument("--debug", action="store_true",
                        help="no trap: report a timed-out wait's step, peer and epoch")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    ctx = Ctx(rank, world, device, out_dir, deadline=time.monotonic() + args.deadline)
    results: dict[str, Any] = {}
    classes: dict[str, type] = {}
    for case in cases(args.heads, world, device):
        if args.only and not any(x and x in case["label"] for x in args.only.split(",")):
            continue
        if not go(ctx, 20.0):  # collective: every rank skips alike
            ctx.log(f"{case['label']}: skipped (deadline)")
            continue
        cls = classes.setdefault(case["schedule"], load_class(Path(args.modules),
                                                               case["schedule"]))
        rows = sweep_one(ctx, cls, case, dist.group.WORLD, args.iters, args.spin_limit,
                         args.verbose, args.debug, args)
        rows.sort(key=lambda r: r["us"])
        results[case["label"]] = rows
        best = rows[0]
        extra = ""
        if "bytes" in case:
            extra = f" {case['bytes'] / best['us'] / 1e3:.0f} GB/s"
        ctx.log(f"{case['label']:>14}: best {best['us']:7.2f} us{extra} {best}")
        for r in rows[1:3]:
            ctx.log(f"{'':>14}        {r['us']:7.2f} us {r}")
        if rank == 0:  # after every case: a run cut short keeps what it measured
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "tune_gpu.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
