"""How the happens-before checker scales: time and events per W and slot count.

    python benchmarks/check_scaling.py [--out benchmarks/results/check_scaling]

Checks schedules/kimi_k3_dcp.yaml with `slots` rewritten to 1..4 at W = 2, 8, 32
and 72 (each the median of several runs), the whole sweep W = 2..72 per slot
count (what `dcpc check --world 2..72` runs), and for comparison the brute-force
oracle (tests/support/hb_oracle.py: every per-peer event, full transitive closure) where
it is affordable. Writes a markdown table and JSON with date, machine and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from hb_oracle import build, oracle_keys  # noqa: E402

from dcpc.check import hb  # noqa: E402
from dcpc.lang.parse import parse_text  # noqa: E402

WORLDS = (2, 8, 32, 72)
SLOTS = (1, 2, 3, 4)
ORACLE_UP_TO = 8


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _machine() -> dict[str, object]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(repeat: int = 5) -> dict[str, object]:
    base = (ROOT / "schedules" / "kimi_k3_dcp.yaml").read_text()
    assert "\nslots: 2" in base
    rows, sweeps = [], []
    for slots in SLOTS:
        schedule = parse_text(base.replace("\nslots: 2", f"\nslots: {slots}"),
                              f"kimi_k3_dcp[slots={slots}]")
        for w in WORLDS:
            seconds, report = _timed(lambda s=schedule, w=w: hb.check(s, [w]), repeat)
            row = {"slots": slots, "world": w, "check_ms": round(seconds * 1e3, 3),
                   "events": report.stats["events"],
                   "events_rank0": report.stats["events_per_rank"],
                   "findings": len(report.findings)}
            if w <= ORACLE_UP_TO:
                oracle_s, keys = _timed(lambda s=schedule, w=w: oracle_keys(s, w), 1)
                row["oracle_ms"] = round(oracle_s * 1e3, 1)
                row["oracle_events"] = build(schedule, w).number_of_nodes()
                row["oracle_agrees"] = keys == {f.key for f in report.findings}
            rows.append(row)
        seconds, report = _timed(lambda s=schedule: hb.check(s, range(2, 73)), repeat)
        sweeps.append({"slots": slots, "worlds": "2..72", "check_ms": round(seconds * 1e3, 2),
                       "events": report.stats["events"], "findings": len(report.findings)})
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(), "commit": _commit(), "schedule": "schedules/kimi_k3_dcp.yaml",
            "repeat": repeat, "rows": rows, "sweeps": sweeps}


def markdown(data: dict[str, object]) -> str:
    m = data["machine"]
    out = ["# Happens-before checker scaling (kimi_k3_dcp, slots rewritten)", "",
           f"Date {data['date']}, commit {data['commit']}, {m['cpu']} ({m['cores']} cores), "
           f"Python {m['python']}. Median of {data['repeat']} runs; `events` counts coarse "
           "events over all ranks (the checker computes clocks for rank 0's only: "
           "`events_rank0`); the oracle builds every per-peer event and a full closure.", "",
           "| slots | W | check ms | events | events rank 0 | oracle ms | oracle events |"
           " agrees |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in data["rows"]:  # type: ignore[union-attr]
        agrees = "-" if "oracle_ms" not in r else ("yes" if r["oracle_agrees"] else "NO")
        out.append(f"| {r['slots']} | {r['world']} | {r['check_ms']} | {r['events']} | "
                   f"{r['events_rank0']} | {r.get('oracle_ms', '-')} | "
                   f"{r.get('oracle_events', '-')} | "
                   f"{agrees} |")
    out += ["", "Whole sweep, as `dcpc check --world 2..72` runs it (HB stage only):", "",
            "| slots | W | check ms | events | findings |", "| ---: | :---: | ---: | ---: | ---: |"]
    for s in data["sweeps"]:  # type: ignore[union-attr]
        out.append(f"| {s['slots']} | {s['worlds']} | {s['check_ms']} | {s['events']} | "
                   f"{s['findings']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "check_scaling"))
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    data = run(args.repeat)
    text = markdown(data)
    Path(args.out + ".md").write_text(text)
    Path(args.out + ".json").write_text(json.dumps(data, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
