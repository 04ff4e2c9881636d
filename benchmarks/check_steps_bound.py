"""Time `dcpc check` on files of exactly the step bound (dcpc.lang.loops.MAX_STEPS, 512
since session 34) that every other limit still accepts, as a fresh process: wall seconds
CPU seconds (user + system) and peak memory (/usr/bin/time), and the outcome.

    python benchmarks/check_steps_bound.py [--only NAME] [--timeout 300]

The kinds: all_to_all rounds (each into one receive buffer, read, then a barrier) and
the same without the barrier (a race in every round: the fix search runs too); shift
hops with a credit (signal to prev, wait from next); the shift ring written as one loop
of MAX_STEPS / 4 hops (the unroller's work); a ring of `next` waits at --world 2..1024
(the happens-before work limit's kind: benchmarks/check_limits_worst.py at 256 steps);
MAX_STEPS steps naming 40 buffers 19,382 times (the accesses limit is 20,000).
The results (benchmarks/results/check_steps_bound.md) back docs/hb-checker.md's statement
of what a check of a file within every limit costs ("Limits").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dcpc.lang import loops  # noqa: E402

MAX_STEPS = loops.MAX_STEPS  # --steps times the same kinds at another length (256: the old bound)

HEAD = ["sizes: {D: 16}", "buffers:", "  x: {shape: [D], dtype: f32}"]


def all_to_all(barrier: bool) -> str:
    """MAX_STEPS steps: all_to_all rounds into one receive buffer, each read (and fenced)."""
    lines = ["schedule: a2a", "slots: 2", "sizes: {C: 4, E: 8}", "buffers:",
             "  x: {shape: [W*C, E], dtype: f32}",
             "  r: {shape: [W, C, E], dtype: f32, symmetric: true}",
             "  y: {shape: [C, E], dtype: f32}", "steps:"]
    per = 3 if barrier else 2
    for i in range(MAX_STEPS // per):
        lines += [f"  - a{i}: {{op: all_to_all, src: x, dst: r}}",
                  f"  - u{i}: {{op: external, reads: [r], writes: [y]}}"]
        if barrier:
            lines.append(f"  - b{i}: {{op: barrier}}")
    lines += [f"  - e{i}: {{op: external, reads: [x], writes: [y]}}"
              for i in range(MAX_STEPS - per * (MAX_STEPS // per))]
    return "\n".join(lines) + "\n"


SHIFT_HEAD = ["schedule: hops", "slots: 2", "sizes: {N: {max: 8}, D: 16}", "buffers:",
              "  kv: {shape: [N, D], dtype: bf16}",
              "  kv_recv: {shape: [N, D], dtype: bf16, symmetric: true}",
              "  out: {shape: [N, D], dtype: f32}", "steps:"]
HOP = ["hop{s}: {{op: shift, src: kv, dst: kv_recv, offset: next}}",
       "use{s}: {{op: external, reads: [kv_recv], writes: [out]}}",
       "credit{s}: {{op: signal, to: prev, channel: free}}",
       "freed{s}: {{op: wait, from: next, channel: free}}"]


def shifts() -> str:
    """MAX_STEPS / 4 shift hops written out, each with its credit."""
    return "\n".join(SHIFT_HEAD + [f"  - {step.format(s=i)}" for i in range(MAX_STEPS // 4)
                                   for step in HOP]) + "\n"


def shift_loop() -> str:
    """The same ring as one loop of MAX_STEPS / 4 hops."""
    return "\n".join(SHIFT_HEAD + ["  - ring:", f"      repeat: {MAX_STEPS // 4}", "      as: h",
                                   "      steps:"]
                     + [f"        - {step.format(s='')}" for step in HOP]) + "\n"


def ring(waits: int, steps: int | None = None) -> str:
    """`steps` (MAX_STEPS) steps: a gather, `waits` next waits (each raises the world
    bound), reads (check_limits_worst.py's ring at 256 steps too)."""
    lines = ["schedule: ring", *HEAD, "  g: {shape: [W*D], dtype: f32, symmetric: true}",
             "  y: {shape: [D], dtype: f32}", "steps:",
             "  - gather: {op: all_gather, src: x, dst: g}"]
    for i in range(waits):
        lines += [f"  - s{i}: {{op: signal, to: next, channel: c{i}}}",
                  f"  - w{i}: {{op: wait, from: prev, channel: c{i}}}"]
    lines += [f"  - e{i}: {{op: external, reads: [g], writes: [y]}}"
              for i in range((steps or MAX_STEPS) - 2 - 2 * waits)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def accesses(total: int = 19_700) -> str:
    """MAX_STEPS steps naming buffers about `total` times (19,382 at 512 steps)."""
    each = total // (MAX_STEPS - 3) - 2
    lines = ["schedule: acc", *HEAD, "  g: {shape: [W*D], dtype: f32, symmetric: true}"]
    lines += [f"  b{i}: {{shape: [D], dtype: f32}}" for i in range(each + 2)]
    reads = ", ".join(f"b{i}" for i in range(each))
    lines += ["steps:", "  - gather: {op: all_gather, src: x, dst: g}"]
    lines += [f"  - e{s}: {{op: external, reads: [g, {reads}], writes: [b{each + 1}]}}"
              for s in range(MAX_STEPS - 2)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def cases(waits: int) -> list[tuple[str, str, str]]:
    return [("a2a_barrier", all_to_all(True), "2..8"),
            ("a2a_race", all_to_all(False), "2..8"),
            ("shifts", shifts(), "2..8"),
            ("shifts_wide", shifts(), "2..1024"),
            ("shift_loop", shift_loop(), "2..8"),
            ("shift_loop_wide", shift_loop(), "2..1024"),
            (f"ring_{waits}_waits", ring(waits), "2..1024"),
            (f"ring_{waits + 1}_waits", ring(waits + 1), "2..1024"),
            ("accesses", accesses(), "2..1024")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--waits", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--steps", type=int, default=loops.MAX_STEPS)
    args = parser.parse_args()
    global MAX_STEPS
    MAX_STEPS = args.steps
    print(f"MAX_STEPS = {MAX_STEPS}\n| file | --world | wall s | CPU s | peak KB | outcome |\n"
          "| --- | --- | ---: | ---: | ---: | --- |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text, worlds in cases(args.waits):
            if args.only and args.only not in name:
                continue
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(text)
            timing = Path(tmp) / "time.txt"
            try:
                done = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", str(timing),
                                       sys.executable, "-m", "dcpc", "check", "--world", worlds,
                                       str(path)], capture_output=True, text=True, cwd=ROOT,
                                      timeout=args.timeout)
                out = (done.stdout + done.stderr).strip().splitlines()
                codes = sorted({line.rsplit("[", 1)[1].rstrip("]") for line in out
                                if ": error:" in line and line.endswith("]")})
                outcome = ("ok" if done.returncode == 0 else
                           f"exit {done.returncode}: {', '.join(codes)} ({len(out)} lines)")
                wall, user, system, peak = timing.read_text().split()[-4:]
                cpu = f"{float(user) + float(system):.2f}"
            except subprocess.TimeoutExpired:
                wall, cpu, peak, outcome = f">{args.timeout:.0f}", "?", "?", "killed"
            print(f"| {name} ({MAX_STEPS} steps) | {worlds} | {wall} | {cpu} | {peak} "
                  f"| {outcome} |", flush=True)


if __name__ == "__main__":
    main()
