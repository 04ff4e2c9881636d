"""all_reduce (sum), broadcast, all_to_all (split/concat), shift (a ring hop): one GPU, W = 2, 4, 8.

    python3 -m benchmarks.new_ops [--worlds 2,4,8] [--rows 1,64,1024] [--cols 1024]
        [--iters 50] [--reps 15] [--out DIR]
    TRITON_INTERPRET=1 python3 -m benchmarks.new_ops --dry-run     (CPU: a smoke test)

Per op one small schedule (the op, then a barrier: the op's receive buffer may be reused
by the next call only after every rank read it), compiled for the W asked, run through
the ``local`` backend: W ranks as threads of this process on one device, one thread and
one stream per rank (dcpc.runtime.local), every kernel compiled and loaded before any
rank launches (benchmarks.support.context.warm, inside ``bench``), nothing allocated
during calls (the modules' buffers are made at construction; the baselines' too).
Timed: median us per call over CUDA-graph replays, max over ranks (``bench``), for
  - ``dcpc``: the op's method + the barrier's method;
  - ``barrier``: the barrier alone (so ``dcpc - barrier`` is the op's own cost);
  - ``torch``: the same bytes moved by torch's own ops on the rank's stream, reading the
    peers' tensors directly (one GPU: every rank's memory is the same device's):
    all_reduce ``out.copy_(x_0); out.add_(x_p)...`` in fp32, broadcast ``dst.copy_(x_root)``,
    all_to_all W slice copies. No synchronisation in these: a floor, not a collective.
torch.distributed's own collectives (NCCL) need one GPU per rank, not ranks as threads
of one process: benchmarks/multi_gpu.py is where they run. One-GPU numbers show how the
kernels' cost grows with W, not what W GPUs would measure. Prints a table and one JSON
object (also DIR/new_ops.json with --out). ``--dry-run``: CPU, the Triton interpreter,
tiny sizes, one timed call: it checks the script, not the device.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # before CUDA starts: see local.py
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OPS = ("all_reduce", "broadcast", "all_to_all", "shift")
STEP = {  # the op's step; x is [N, C] bf16 on every rank
    "all_reduce": "{op: all_reduce, reduce: sum, src: x, dst: y}",
    "broadcast": "{op: broadcast, src: x, dst: y, root: 0}",
    "all_to_all": "{op: all_to_all, src: x, dst: y, split_dim: 1, concat_dim: 0}",
    "shift": "{op: shift, src: x, dst: y, offset: next}",  # one ring hop
}
DST = {  # y's declaration
    "all_reduce": "{shape: [N, C], dtype: f32}",
    "broadcast": "{shape: [N, C], dtype: bf16, symmetric: true}",
    "all_to_all": "{shape: [W*N, C/W], dtype: bf16, symmetric: true}",
    "shift": "{shape: [N, C], dtype: bf16, symmetric: true}",
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def schedule_text(op: str, rows: int, cols: int) -> str:
    return (f"schedule: bench_{op}\nsizes:\n  N: {{max: {rows}}}\n  C: {cols}\nbuffers:\n"
            f"  x: {{shape: [N, C], dtype: bf16}}\n  y: {DST[op]}\nsteps:\n"
            f"  - op_step: {STEP[op]}\n  - release: {{op: barrier}}\n")


def compile_classes(worlds: list[int], rows: int, cols: int, out: Path) -> dict[str, type]:
    """Every op's schedule, checked for ``worlds`` and emitted into ``out``; its class."""
    from dcpc import pipeline
    from dcpc.runtime.loading import import_file, schedule_class

    classes = {}
    for op in OPS:
        path = out / f"bench_{op}.yaml"
        path.write_text(schedule_text(op, rows, cols))
        module = out / f"bench_{op}.py"
        module.write_text(pipeline.run(path, pipeline.Options(worlds=tuple(worlds))).module_text)
        classes[op] = schedule_class(import_file(module, f"dcpc_bench_{op}"), f"bench_{op}")
    return classes


def baseline(op: str, rank: int, world: int, xs: list[torch.Tensor], n: int
             ) -> Callable[[], None]:
    """The same bytes moved by torch ops, reading peers' inputs directly (preallocated)."""
    x = xs[rank]
    if op == "all_reduce":
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)

        def fn() -> None:
            out[:n].copy_(xs[0][:n])
            for p in range(1, world):
                out[:n].add_(xs[p][:n])
    elif op == "broadcast":
        out = torch.empty_like(x)

        def fn() -> None:
            out[:n].copy_(xs[0][:n])
    elif op == "shift":  # the previous rank's rows, as a ring hop delivers them
        out = torch.empty_like(x)

        def fn() -> None:
            out[:n].copy_(xs[(rank - 1) % world][:n])
    else:
        cols = x.shape[1] // world
        out = torch.empty(world, x.shape[0], cols, dtype=x.dtype, device=x.device)

        def fn() -> None:
            for p in range(world):
                out[p, :n].copy_(xs[p][:n, rank * cols:(rank + 1) * cols])
    return fn


def one_world(classes: dict[str, type], world: int, rows: list[int], cols: int,
              device: torch.device, iters: int, reps: int, timeout_s: float
              ) -> list[dict[str, Any]]:
    from benchmarks.support.context import Ctx, barrier, bench
    from dcpc.runtime.local import LocalGroup

    group = LocalGroup(world, device, timeout_s=timeout_s)
    xs: list[torch.Tensor] = [torch.empty(0)] * world
    top = max(rows)

    def body(rank: Any) -> list[dict[str, Any]]:
        ctx = Ctx(rank.rank, world, device, Path("."), time.monotonic() + timeout_s,
                  comm=rank)
        records = []  # LocalGroup.run: this thread runs on the rank's own stream
        gen = torch.Generator(device="cpu").manual_seed(rank.rank)
        xs[rank.rank] = torch.randn(top, cols, generator=gen).to(torch.bfloat16).to(device)
        mods = {op: cls(rank, sizes={"N": top}, device=device, backend="local")
                for op, cls in classes.items()}
        barrier(ctx)
        try:
            for op in OPS:
                mod = mods[op]
                for n in rows:
                    x = xs[rank.rank][:n]

                    def dcpc(mod: Any = mod, x: torch.Tensor = x) -> None:
                        mod.op_step(x)
                        mod.release()

                    def alone(mod: Any = mod) -> None:
                        mod.release()

                    records.append({
                        "op": op, "world": world, "rows": n, "cols": cols,
                        "bytes_per_rank": n * cols * 2,
                        "dcpc_us": bench(ctx, dcpc, iters, reps),
                        "barrier_us": bench(ctx, alone, iters, reps),
                        "torch_us": bench(ctx, baseline(op, rank.rank, world, xs, n), iters,
                                          reps)})
        finally:
            barrier(ctx)
            for mod in mods.values():
                mod.close()
        return records

    return group.run(body, timeout_s=timeout_s)[0]


def table(records: list[dict[str, Any]]) -> str:
    head = ("| op | W | rows x cols | bytes/rank | dcpc op+barrier us | barrier us | "
            "torch copies us |")
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['op']} | {r['world']} | {r['rows']} x {r['cols']} | "
                     f"{r['bytes_per_rank']} | {r['dcpc_us']:.1f} | {r['barrier_us']:.1f} | "
                     f"{r['torch_us']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=_ints, default=[2, 4, 8])
    ap.add_argument("--rows", type=_ints, default=[1, 64, 1024])
    ap.add_argument("--cols", type=int, default=1024, help="elements per row (bf16)")
    ap.add_argument("--iters", type=int, default=50, help="calls per timed graph")
    ap.add_argument("--reps", type=int, default=15, help="timed replays")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per W")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, Triton interpreter, tiny sizes: checks the script")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.dry_run:
        device = torch.device("cpu")
        args.rows, args.cols, args.iters, args.reps = [2], 16, 1, 1
        args.worlds = [2]
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    else:
        if not torch.cuda.is_available():
            ap.error("no GPU: use --dry-run (CPU) for a smoke test")
        device = torch.device("cuda", 0)
    if any(args.cols % w for w in args.worlds):
        ap.error(f"--cols {args.cols} must be a multiple of every W in {args.worlds}")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dcpc-new-ops-") as build:
        classes = compile_classes(args.worlds, max(args.rows), args.cols, Path(build))
        for world in args.worlds:
            records += one_world(classes, world, args.rows, args.cols, device, args.iters,
                                 args.reps, args.timeout)
    result = {
        "what": "new ops through the local backend on one device, us per call (median, max "
                "over ranks); torch: the same bytes moved by torch copies, unsynchronised",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu (Triton interpreter: not a timing)",
        "iters": args.iters, "reps": args.reps, "records": records,
    }
    print(table(records))
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "new_ops.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "new_ops.md").write_text(table(records) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
