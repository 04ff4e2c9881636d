"""How long `dcpc check` takes on large schedules and wide group-size ranges.

    python benchmarks/check_large.py [--out benchmarks/results/check_large] [--repeat 3]

Targets (issue 13): any schedule of up to 100 steps, 64 slots and 10,000 buffer
accesses checks in under 2 s for W 2..8, and the shipped schedules for W 2..1024 in
under 2 s; past the documented limits (docs/language.md, "Limits") a diagnostic at
once. Each case runs the whole `dcpc check` pipeline (parse, graph, structural
checks, lowering, happens-before) in this process (imports warm), median of
``--repeat`` runs. Writes a markdown table and JSON with date, machine and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.check_scaling import _commit, _machine  # noqa: E402
from dcpc.diagnostics import DiagnosticError  # noqa: E402
from dcpc.lang.loops import MAX_STEPS  # noqa: E402
from dcpc.pipeline import Options, run  # noqa: E402

HEAD = "sizes: {N: 4, K: {multiple_of: W}}\nbuffers:\n  x: {shape: [N, K], dtype: f32}\n"


def gathers(n: int, slots: int) -> str:
    """n gathers into n symmetric buffers, each read by an external, one barrier."""
    bufs = "".join(f"  g{i}: {{shape: [W*N, K], dtype: f32, symmetric: true}}\n"
                   for i in range(n))
    steps = "".join(f"  - gather{i}: {{op: all_gather, src: x, dst: g{i}, dim: 0}}\n"
                    f"  - use{i}: {{op: external, reads: [g{i}], writes: []}}\n"
                    for i in range(n))
    return (f"schedule: gathers_{n}_{slots}\nslots: {slots}\n" + HEAD + bufs + "steps:\n"
            + steps + "  - release: {op: barrier}\n")


def over_steps() -> str:
    """One gather, then reads of it: MAX_STEPS + 1 steps (gathers(n) would also pass the
    buffers' limit of 256 at the bound of 512 steps)."""
    uses = "".join(f"  - use{i}: {{op: external, reads: [g], writes: []}}\n"
                   for i in range(MAX_STEPS - 1))
    return ("schedule: over\nslots: 1\n" + HEAD
            + "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\nsteps:\n"
            + "  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n" + uses
            + "  - release: {op: barrier}\n")


def reads(n: int) -> str:
    """One gather and one external that reads its buffer n times."""
    names = ", ".join(["g"] * n)
    return ("schedule: reads\nslots: 1\n" + HEAD
            + "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\nsteps:\n"
            + "  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n"
            + f"  - use: {{op: external, reads: [{names}], writes: []}}\n"
            + "  - release: {op: barrier}\n")


def wide(buffers: int, readers: int, slots: int, times: int = 1) -> str:
    """``buffers`` gathered buffers, then ``readers`` externals that each read all of
    them ``times`` times: buffers * (readers * times + 2) accesses, buffers + readers
    + 1 steps."""
    bufs = "".join(f"  g{i}: {{shape: [W*N, K], dtype: f32, symmetric: true}}\n"
                   for i in range(buffers))
    steps = "".join(f"  - gather{i}: {{op: all_gather, src: x, dst: g{i}, dim: 0}}\n"
                    for i in range(buffers))
    names = ", ".join(f"g{i}" for i in range(buffers) for _ in range(times))
    steps += "".join(f"  - use{k}: {{op: external, reads: [{names}], writes: []}}\n"
                     for k in range(readers))
    return (f"schedule: wide\nslots: {slots}\n" + HEAD + bufs + "steps:\n" + steps
            + "  - release: {op: barrier}\n")


def ring(hops: int) -> str:
    """A ring release of ``hops`` hops after a gather (the world bound grows with it)."""
    steps = "".join(f"  - s{k}: {{op: signal, to: next, channel: ring}}\n"
                    f"  - w{k}: {{op: wait, from: prev, channel: ring}}\n"
                    for k in range(hops))
    return ("schedule: ring\nslots: 2\n" + HEAD
            + "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\nsteps:\n"
            + "  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n"
            + "  - use: {op: external, reads: [g], writes: []}\n" + steps)


def cases(folder: Path) -> list[tuple[str, Path, range, float]]:
    """(name, file, worlds, target seconds or 0 for no target)."""
    made = {
        "40 gathers x 64 slots (81 steps)": gathers(40, 64),
        "49 gathers x 64 slots (99 steps)": gathers(49, 64),
        "3,000 reads of one buffer": reads(3000),
        "10,000 reads of one buffer": reads(10_000),
        "50 buffers, 49 readers x 4, 64 slots (100 steps, 9,900 accesses)": wide(50, 49, 64, 4),
        "50 buffers, 49 readers x 4, 1 slot (100 steps, 9,900 accesses)": wide(50, 49, 1, 4),
        "ring release of 6 hops, 2 slots": ring(6),
    }
    out = []
    for i, (name, text) in enumerate(made.items()):
        path = folder / f"case{i}.yaml"
        path.write_text(text)
        out.append((name, path, range(2, 9), 2.0))
    for path in sorted((ROOT / "schedules").glob("*.yaml")):
        out.append((f"shipped {path.stem}, W 2..1024", path, range(2, 1025), 2.0))
    limit = folder / "over_limit.yaml"
    limit.write_text(over_steps())
    out.append((f"{MAX_STEPS + 1} steps (over the limit: refused)", limit, range(2, 9), 2.0))
    return out


def measure(path: Path, worlds: range, repeat: int) -> tuple[float, str, dict[str, float]]:
    times, verdict, stages = [], "", {}
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            c = run(path, Options(worlds=list(worlds)), until="hb")
            verdict, stages = "ok", c.seconds
        except DiagnosticError as err:
            verdict = ", ".join(sorted({d.code for d in err.diagnostics}))
            stages = err.compilation.seconds  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return statistics.median(times), verdict, dict(stages)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/check_large"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, worlds, target in cases(Path(tmp)):
            seconds, verdict, stages = measure(path, worlds, args.repeat)
            rows.append({"case": name, "worlds": [worlds[0], worlds[-1]],
                         "seconds": round(seconds, 3), "target_s": target,
                         "verdict": verdict, "stages": {k: round(v, 3) for k, v in stages.items()},
                         "pass": seconds < target})
            print(f"{name}: {seconds:.2f} s ({verdict})", flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "machine": _machine(), "repeat": args.repeat}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# `dcpc check` on large schedules ({meta['date']}, commit {meta['commit']})", "",
             f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, Python "
             f"{meta['machine']['python']}; the whole check pipeline in one process, median of "
             f"{args.repeat}. Command: `python benchmarks/check_large.py`.", "",
             "| case | W | seconds | target | verdict |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        mark = "PASS" if r["pass"] else "FAIL"
        lines.append(f"| {r['case']} | {r['worlds'][0]}..{r['worlds'][1]} | {r['seconds']} "
                     f"| < {r['target_s']} s {mark} | {r['verdict']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
