"""``dcpc run``: compile a schedule and run it end to end on CPU across W processes.

    dcpc run schedules/kimi_k3_dcp.yaml --world 2 --backend host --calls 20

Every rank runs the generated module (Triton interpreter, peers in shared memory,
or torch.distributed over gloo), with poisoned symmetric memory and random delays;
every output of every call is compared with a float64 simulation of the schedule.
Exit status 0 only if every output matches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dcpc.diagnostics import DiagnosticError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcpc run", description="Run a schedule end to end on CPU and check every output.")
    p.add_argument("schedule", help="schedule YAML file")
    p.add_argument("--world", "-W", type=int, default=2, help="processes (ranks), default 2")
    p.add_argument("--backend", choices=("host", "torch"), default="host",
                   help="host: Triton interpreter + shared memory; torch: gloo collectives")
    p.add_argument("--calls", type=int, default=20, help="calls per rank, default 20")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=("sequential", "interleaved"), default="sequential",
                   help="slot order: call after call, or two slots in flight at once")
    p.add_argument("--lse-base", choices=("e", "2"), default=None,
                   help="rewrite the schedule's LSE buffers to this base first")
    p.add_argument("--jitter-ms", type=float, default=2.0,
                   help="longest random delay before/after a step, default 2 ms")
    p.add_argument("--no-poison", action="store_true", help="zero-fill symmetric memory")
    p.add_argument("--timeout", type=float, default=None, help="seconds before ranks are killed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    if args.world < 1 or args.calls < 1:
        print("dcpc run: --world and --calls must be at least 1", file=sys.stderr)
        return 2
    from dcpc.harness.run import RunConfig, format_report, run_schedule

    config = RunConfig(
        schedule=args.schedule, world=args.world, backend=args.backend, calls=args.calls,
        seed=args.seed, order=args.order, lse_base=args.lse_base,
        jitter_s=args.jitter_ms / 1000, poison=not args.no_poison, timeout_s=args.timeout,
    )
    try:
        report = run_schedule(config)
    except DiagnosticError as exc:
        for diagnostic in exc.diagnostics:
            print(diagnostic.render(), file=sys.stderr)
        return 1
    print(format_report(report))
    for outcome in report.launch.outcomes:
        if outcome.status == "error" and outcome.traceback:
            print(f"--- rank {outcome.rank} traceback ---\n{outcome.traceback}", file=sys.stderr)
            break
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
