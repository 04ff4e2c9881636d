"""dcpc's own host time per eager call, on CPU: every generated method of the shipped
decode schedules with its kernel launches stubbed out (W = 1 through ``local``), so what
is timed is the Python around a launch (argument checks and their memos, the guard's
call order and fingerprint, scalars, grid, views). The GPU number (section host of
benchmarks/one_gpu.py) adds Triton's launcher to this; use this one to see what a change
of the runtime's Python buys, on any machine.

    python3 -m benchmarks.host_python [--modules build/generated] [--calls 5000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the fast path stays off anyway

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=Path, default=REPO / "build" / "generated")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.support.modules import DECODE, STEPS, load_class, run_steps, step_caller
    from benchmarks.support.reference import case_inputs, make_case, plain_layout
    from dcpc.runtime.fastlaunch import FastKernel
    from dcpc.runtime.local import LocalGroup

    rank = LocalGroup(1, "cpu").ranks[0]
    case = make_case(8, 64, 1, seed=3, device=torch.device("cpu"), layout=plain_layout(8),
                     garbage=False)
    inputs = case_inputs(case, 0)
    print(f"dcpc's Python per call, launches stubbed (H=64, T=8, W=1, CPU), median of "
          f"{args.reps} x {args.calls} calls:")
    for schedule in DECODE:
        cls = load_class(args.modules, schedule)
        inst = cls(rank, sizes={"H": 64}, device="cpu")
        env = run_steps(inst, schedule, inputs)  # real launches once: outputs exist
        inst._check_each_call = False  # what CUDA does: no per-call error read
        module = sys.modules[cls.__module__]
        for kernel in [v for v in vars(module).values() if isinstance(v, FastKernel)]:
            kernel.launch = lambda grid, a, k: None
        for step, _ in STEPS[schedule]:
            call = step_caller(inst, schedule, step, env)
            call()
            samples = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    call()
                samples.append((time.perf_counter() - t0) * 1e6 / args.calls)
            print(f"  {schedule}.{step}: {statistics.median(samples):.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
