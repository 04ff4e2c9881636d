"""``dcpc run``: compile a schedule and run it end to end on CPU across W processes.

    dcpc run schedules/kimi_k3_dcp.yaml --world 2 --backend host --calls 20

Every rank runs the generated module (Triton interpreter, peers in shared memory,
or torch.distributed over gloo), with poisoned symmetric memory and random delays;
every output of every call is compared with a float64 simulation of the schedule.
Exit status 0 only if every output matches; 1 when an output does not match, a rank
fails or the schedule has errors; 2 on usage errors (a bad option, a missing file,
torch or triton not installed).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from dcpc.diagnostics import DiagnosticError
from dcpc.run_limits import DEFAULT_CALLS, MAX_CALLS, MAX_JITTER_S, MAX_RUN_WORLD


def _world(text: str) -> int:
    """``--world`` with the syntax and messages of every other dcpc subcommand."""
    import click

    from dcpc.worlds import one_world

    try:
        return one_world(text, largest=MAX_RUN_WORLD)
    except click.BadParameter as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _integer(text: str) -> int:
    """An integer option in ASCII digits (``int`` reads '１０', '1_0' and ' 5 ')."""
    if not re.fullmatch(r"-?[0-9]{1,30}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
    return int(text)


def _sizes(text: str) -> dict[str, int]:
    """``--sizes T=8,B=4``: NAME=INT pairs (the names and ranges are checked against the
    schedule once it is compiled)."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier():
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not NAME=INT; write e.g. --sizes T=8,B=4")
        if name in out:
            raise argparse.ArgumentTypeError(f"size {name} given twice")
        if not re.fullmatch(r"-?[0-9]{1,30}", value):
            raise argparse.ArgumentTypeError(f"size {name}: {value!r} is not an integer")
        out[name] = int(value)
    return out


def _backend(text: str) -> str | dict[str, str]:
    """``--backend``: one kind, or one per mesh axis (``node=torch,gpu=host``; the axes
    are checked by the module at construction, dcpc.runtime.axes). Imports nothing:
    ``dcpc run`` says what to install when torch is missing, after parsing."""
    kinds = ("host", "torch", "local", "symm_mem")
    value: str | dict[str, str] = text
    if "=" in text:
        value = {}
        for part in text.split(","):
            axis, sep, kind = (x.strip() for x in part.partition("="))
            if not sep or not axis or not kind:
                raise argparse.ArgumentTypeError(
                    f"'{part}' is not AXIS=KIND (e.g. node=torch,gpu=host)")
            if axis in value:
                raise argparse.ArgumentTypeError(f"axis '{axis}' is named twice")
            value[axis] = kind
    for kind in [value] if isinstance(value, str) else value.values():
        if kind not in kinds:
            raise argparse.ArgumentTypeError(
                f"invalid kind {kind!r} (choose from {', '.join(kinds)})")
    if isinstance(value, dict) and "local" in value.values() and len(set(value.values())) > 1:
        raise argparse.ArgumentTypeError(
            "local runs every rank as a thread of one process: it cannot share a mesh "
            "with another kind")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dcpc run", description="Run a schedule end to end on CPU and check every output.")
    p.add_argument("schedule", help="schedule YAML file")
    p.add_argument("--world", "-W", type=_world, default=None,
                   help=f"group size: processes (ranks), one N in 2..{MAX_RUN_WORLD}, default 2 "
                        "(with --replay: the counterexample's W)")
    p.add_argument("--backend", type=_backend, default="host", metavar="KIND|AXIS=KIND,...",
                   help="host: Triton interpreter + shared memory, one process per rank; "
                        "torch: gloo collectives; local: the same kernels, ranks as threads "
                        "of one process (as on one GPU). On a mesh, one kind per axis, e.g. "
                        "--world 2x2 --backend node=torch,gpu=host: the node axis' steps run "
                        "on gloo, the gpu axis' kernels on host shared memory per gpu team")
    p.add_argument("--calls", type=_integer, default=None,
                   help=f"calls per rank, 1..{MAX_CALLS}; default {DEFAULT_CALLS}, or 2 x slots "
                        "+ 1 when the schedule's slots need more (call c and call c + slots, "
                        "the next user of its slot, both run), or more for --replay's call")
    p.add_argument("--seed", type=_integer, default=0)
    p.add_argument("--sizes", type=_sizes, default=None, metavar="NAME=INT,...",
                   help="constructor sizes (maxima) instead of the small defaults, e.g. "
                        "--sizes T=8,B=4; validated as the generated constructor does")
    p.add_argument("--order", choices=("sequential", "interleaved"), default="sequential",
                   help="slot order: call after call, or two slots in flight at once")
    p.add_argument("--lse-base", choices=("e", "2"), default=None,
                   help="rewrite the schedule's LSE buffers to this base first")
    p.add_argument("--jitter-ms", type=float, default=2.0,
                   help=f"longest random delay before/after a step, 0..{MAX_JITTER_S * 1000:g} "
                   "ms, default 2 ms")
    p.add_argument("--no-poison", action="store_true", help="zero-fill symmetric memory")
    p.add_argument("--no-handshake", action="store_true",
                   help="construct the modules with handshake=False: a torch step (gloo) no "
                        "longer first trades a message with every peer, a barrier over all "
                        "ranks that hides races between the kernel axes' steps of a mixed "
                        "mesh (--backend node=torch,gpu=host); for hunting races. A missing "
                        "peer is then named by the collective's own timeout")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds for the whole run before ranks still working are killed "
                        "(reported as 'timeout'; default 4 x (60 + 0.15 x steps x calls x W, "
                        "scaled up by the buffers' size)); ranks "
                        "with no new step for --wait-timeout + 30 s are killed as 'hung'")
    p.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a wait for a peer lasts before the module reports a timeout "
                        "naming step, peer and epoch (the modules' timeout_s), default 60")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default): the kernels under Triton's interpreter; cuda: the "
                        "compiled kernels on the GPU, one process per GPU (backend symm_mem) "
                        "when there are W GPUs, else W ranks as threads on one GPU (backend "
                        "local, every kernel compiled and loaded before any rank launches)")
    p.add_argument("--programs", type=int, default=None, metavar="N",
                   help="programs per kernel launch (default: 1 on CPU, the module's own "
                        "tuning on a GPU)")
    p.add_argument("--program-order", choices=("natural", "reverse", "shuffle"),
                   default="shuffle",
                   help="CPU: the order in which the interpreter runs a launch's programs "
                        "(a GPU runs them at once, in any order); default shuffle (seeded, "
                        "the same on every rank); matters with --programs 2 or more")
    p.add_argument("--module", default=None, metavar="FILE",
                   help="run this module, which dcpc compile wrote for the schedule (one "
                        "compiled for several W serves each of them), instead of compiling")
    p.add_argument("--replay", default=None, metavar="FILE",
                   help="make the race of a counterexample happen: FILE is what `dcpc check "
                        "SCHEDULE --format json` writes for a schedule it refuses with a race; "
                        "the rank of the race's first access is held before that step until "
                        "the other access has happened (at most half of --wait-timeout), so "
                        "the outputs show the wrong data (CPU only)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run N times (seeds SEED, SEED+1, ...); fails if any run fails")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write every run's result as JSON (one record per run)")
    p.add_argument("--debug", action="store_true",
                   help="print a failed rank's Python traceback")
    return p


def _refused(exc: DiagnosticError) -> int:
    """Print a refusal's diagnostics; its exit code (2: a file could not be read)."""
    for diagnostic in exc.diagnostics:
        print(diagnostic.render(), file=sys.stderr)
    return 2 if any(d.code == "io" for d in exc.diagnostics) else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse's usage errors exit 2, --help exits 0
        return int(exc.code or 0)
    for flag, value, top in (("--repeat", args.repeat, 1000), ("--programs", args.programs,
                                                               1024)):
        if value is not None and not 1 <= value <= top:
            print(f"dcpc run: {flag} must be in 1..{top}, got {value}", file=sys.stderr)
            return 2
    if args.device == "cuda" and args.backend == "host":
        args.backend = "symm_mem"  # the default on a GPU (local when W GPUs are not here)
    try:  # the [run] extra: the generated modules and the harness need torch and triton
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        print(f"dcpc run: {exc.name or 'torch'} is not installed; dcpc run needs torch and "
              "triton: pip install 'dcpc[run]'", file=sys.stderr)
        return 2
    from dcpc.run_limits import RunConfigError, check_options

    try:  # before anything is compiled or started (dcpc.run_limits)
        check_options(calls=args.calls, jitter_s=args.jitter_ms / 1000,
                      timeout_s=args.timeout, wait_timeout_s=args.wait_timeout)
    except RunConfigError as exc:
        print(f"dcpc run: {exc}", file=sys.stderr)
        return 2
    from dcpc.harness.run import (
        RunConfig,
        RunDeviceError,
        RunSizesError,
        format_report,
        report_record,
        run_schedule,
    )

    replay = None
    if args.replay is not None:  # the race must be one the checker finds in the schedule
        from dcpc.harness.replay import ReplayError, plan

        try:
            replay = plan(args.replay, args.schedule, args.world)
        except ReplayError as exc:
            print(f"dcpc run: {exc}", file=sys.stderr)
            return 2
        except DiagnosticError as exc:
            return _refused(exc)
    world = args.world if args.world is not None else replay.world if replay else 2
    programs = args.programs if args.programs is not None else (
        1 if args.device == "cpu" else None)
    records, ok = [], True
    for attempt in range(args.repeat):
        config = RunConfig(
            schedule=args.schedule, world=world, backend=args.backend, calls=args.calls,
            seed=args.seed + attempt, order=args.order, lse_base=args.lse_base,
            jitter_s=args.jitter_ms / 1000, poison=not args.no_poison, timeout_s=args.timeout,
            wait_timeout_s=args.wait_timeout, sizes=args.sizes, device=args.device,
            programs=programs, program_order=args.program_order,
            handshake=not args.no_handshake, module=args.module, replay=replay,
        )
        if args.repeat > 1:
            print(f"run        {attempt + 1} of {args.repeat}", flush=True)
        try:
            report = run_schedule(config, announce=lambda line: print(line, flush=True))
        except (RunSizesError, RunDeviceError, RunConfigError) as exc:
            what = "--sizes: " if isinstance(exc, RunSizesError) else ""
            print(f"dcpc run: {what}{exc}", file=sys.stderr)
            return 2
        except DiagnosticError as exc:
            return _refused(exc)
        print(format_report(report), flush=True)
        records.append(report_record(report))
        ok = ok and report.ok
        for outcome in report.launch.outcomes:
            if outcome.status == "error" and outcome.traceback:
                if args.debug:
                    print(f"--- rank {outcome.rank} traceback ---\n{outcome.traceback}",
                          file=sys.stderr)
                else:
                    print(f"dcpc run: rank {outcome.rank} failed: {outcome.error}\n"
                          "  hint: rerun with --debug for its traceback", file=sys.stderr)
                break
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
