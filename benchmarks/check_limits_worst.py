"""Time `dcpc check` on the largest files the limits admit, one of each kind whose size
the step bound does not set (issue 31), and on files just past them (refused at once).
Its ring and accesses files are 256 steps, the step bound before session 34: the same
kinds at the bound of 512 are benchmarks/check_steps_bound.py's, and what a check of a
file within every limit costs is stated once, in docs/hb-checker.md ("Limits"). Written
into a temporary folder, then timed as a user runs them (benchmarks/check_time.measure:
a fresh process, wall and CPU). Rebuilt 2026-12-07 (session 35): the mesh files' axes
renamed (an axis may not be named r, the rank's name in expressions) and the shapes file
made of squares of max 100 (a square of max 1000 is past one question's own budget).

    python benchmarks/check_limits_worst.py [--code DIR] [--timeout 120]

The sizes below were found by bisection against the limits of dcpc/check/structural.py
(MAX_HB_WORK), dcpc/lang (slices, buffers, expressions, YAML nodes): raise one by one
and the file is refused (`schedule-too-large`). ``--code`` times another checkout.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.check_steps_bound import HEAD
from benchmarks.check_steps_bound import ring as _ring
from benchmarks.check_time import ROOT, measure


def ring(waits: int) -> str:
    """256 steps: a gather, `waits` next waits (each raises the world bound by 4), reads."""
    return _ring(waits, steps=256)


def shared(reads: int, slots: int, index: str = "y") -> str:
    """A shared buffer read by `reads` steps over `slots` slots of one stream."""
    lines = ["schedule: pairs", f"slots: {slots}", "streams: single", *HEAD,
             "  g: {shape: [W*D], dtype: f32, symmetric: true, shared: true}",
             "  y: {shape: [2, D], dtype: f32}", "steps:",
             "  - gather: {op: all_gather, src: x, dst: g}"]
    lines += [f'  - e{i}: {{op: external, reads: [g], writes: ["{index}"]}}'
              for i in range(reads)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def mesh(steps: int, axes: int) -> str:
    """A gather along each axis, then reads of the gathered buffers."""
    names = ["px", "qx", "rx", "sx"][:axes]  # not r: the rank's name in expressions
    lines = ["schedule: meshn", "mesh: {" + ", ".join(f"{a}: {a.upper()}" for a in names) + "}",
             "sizes:", *[f"  {a.upper()}: {{max: 64}}" for a in names], "  D: 16", "buffers:",
             "  x: {shape: [D], dtype: f32}", "  y: {shape: [D], dtype: f32}",
             *[f"  g{a}: {{shape: [{a.upper()}*D], dtype: f32, symmetric: true}}"
               for a in names], "steps:",
             *[f"  - s{a}: {{op: all_gather, axis: {a}, src: x, dst: g{a}}}" for a in names]]
    lines += [f"  - e{k}: {{op: external, reads: [g{names[k % axes]}], writes: [y]}}"
              for k in range(axes, steps - 1)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def accesses() -> str:
    """256 steps naming buffers 19,700 times (the limit is 20,000)."""
    lines = ["schedule: acc", *HEAD, "  g: {shape: [W*D], dtype: f32, symmetric: true}"]
    lines += [f"  b{i}: {{shape: [D], dtype: f32}}" for i in range(78)]
    reads = ", ".join(f"b{i}" for i in range(76))
    lines += ["steps:", "  - gather: {op: all_gather, src: x, dst: g}"]
    lines += [f"  - e{s}: {{op: external, reads: [g, {reads}], writes: [b77]}}"
              for s in range(253)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def shapes(buffers: int = 5) -> str:
    """Buffers whose dimensions need the exact shape questions' whole budget: squares of
    two sizes of max 100, about 10,000 evaluations each (5 fit the 50,000 of a check)."""
    lines = ["schedule: poly", "sizes:", "  A: {max: 100}", "  B: {max: 100}",
             "  C: {max: 64, multiple_of: 8}", "  H: {multiple_of: W}", "buffers:"]
    lines += [f'  b{i}: {{shape: ["(A - B + {i}) * (A - B + {i}) + {i + 1}", '
              f'"H / W * (C + {i})"], dtype: f32}}' for i in range(buffers)]
    lines += ["  x: {shape: [A], dtype: f32}", "steps:", "  - e: {op: external, reads: ["
              + ", ".join(f"b{i}" for i in range(buffers)) + "], writes: [x]}"]
    return "\n".join(lines) + "\n"


CASES = [  # (name, text, --world or None for the default), the largest admitted first
    ("ring_19_waits", ring(19), "2..1024"),
    ("shared_102_reads_8_slots", shared(102, 8), "2..8"),
    ("shared_11_reads_64_slots", shared(11, 64), "2..8"),
    ("mesh2_159_steps", mesh(159, 2), "2..32x2..32"),
    ("mesh3_11_steps", mesh(11, 3), "2..7x2..7x2..7"),
    ("mesh4_92_steps", mesh(92, 4), None),
    ("per_w_48_reads_8_slots", shared(48, 8, "y[W % 2]"), "2..31"),
    ("accesses_19700", accesses(), "2..1024"),
    ("shapes_5_squares", shapes(5), "2..1024"),
    ("ring_20_waits (refused)", ring(20), "2..1024"),
    ("shared_250_reads_64_slots (refused)", shared(250, 64), "2..8"),
    ("per_w_100_reads_8_slots (refused)", shared(100, 8, "y[W % 2]"), "2..31"),
    ("shapes_6_squares (refused)", shapes(6), "2..1024"),
    ("mesh_5_axes (refused)", mesh(8, 4).replace("{px: PX", "{ox: OX, px: PX"), None),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", type=Path, default=ROOT)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    print("| file | --world | wall s | CPU s | outcome |\n| --- | --- | ---: | ---: | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text, worlds in CASES:
            path = Path(tmp) / (name.split()[0] + ".yaml")
            path.write_text(text)
            wall, cpu, outcome = measure(args.code, path, worlds, args.timeout)
            print(f"| {name} | {worlds or 'default'} | {wall:.1f} | {cpu:.2f} | {outcome} |",
                  flush=True)


if __name__ == "__main__":
    main()
