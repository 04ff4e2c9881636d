"""Compile time of every shipped schedule: `dcpc compile` as the driver runs it
(parse, graph, check incl. happens-before for W in 2..8, lower, emit), median of
repeated runs in one process (imports excluded), per stage. Target: < 1 s each.

    python benchmarks/compile_time.py [--repeat 5] [--out benchmarks/compile_time.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time
from pathlib import Path

from dcpc import __version__
from dcpc.pipeline import STAGE_NAMES, Options, run

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0


def measure(path: Path, repeat: int) -> tuple[float, dict[str, float]]:
    totals, stages = [], {name: [] for name in STAGE_NAMES}
    for _ in range(repeat):
        start = time.perf_counter()
        c = run(path, Options(worlds=tuple(range(2, 9))))
        totals.append(time.perf_counter() - start)
        for name, seconds in c.seconds.items():
            stages[name].append(seconds)
    return statistics.median(totals), {k: statistics.median(v) for k, v in stages.items() if v}


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    schedules = sorted((ROOT / "schedules").glob("*.yaml"))
    run(schedules[0])  # warm imports and template caches
    rows = []
    for path in schedules:
        total, stages = measure(path, args.repeat)
        rows.append((path.stem, total, stages))
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Compile time of the shipped schedules",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {platform.node()} ({cpu}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()})",
        f"- dcpc {__version__}, commit {commit()}",
        f"- median of {args.repeat} runs of the whole driver (W in 2..8), imports excluded;"
        f" target < {TARGET_S:.0f} s per schedule",
        "",
        "| schedule | total (ms) | " + " | ".join(STAGE_NAMES) + " | < 1 s |",
        "| --- | ---: | " + " | ".join("---:" for _ in STAGE_NAMES) + " | --- |",
    ]
    for name, total, stages in rows:
        cells = " | ".join(f"{stages.get(s, 0.0) * 1e3:.1f}" for s in STAGE_NAMES)
        ok = "yes" if total < TARGET_S else "NO"
        lines.append(f"| {name} | {total * 1e3:.1f} | {cells} | {ok} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
