"""What has not run clean on a GPU since it last changed: the GPU conformance suite's
debt, read from the committed results and git.

A case (a schedule file at one world of the suite, benchmarks/gpu_conformance.py) is
settled when some committed gpu_conformance_<commit>.json has a clean record of it AND
neither the file nor the code that decides what runs on the GPU (DEVICE_PATHS: the
templates, the op modules and their lowering, the code generator, the runtime, the
harness) changed between that commit and HEAD. Everything else is pending, with why.

    python3 -m benchmarks.gpu_pending            # the table and the commands to run
    python3 -m benchmarks.gpu_pending --json     # the same as data
    python3 -m benchmarks.gpu_pending --plans DIR [--shards 4] [--first FILE ...]
        # DIR/plan<i>.txt for benchmarks/conformance_shards.sh (one device call)

Exit 0 either way (a report, not a gate): CI has no GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.gpu_conformance import MESH_WORLDS, ROOT, cases, schedule_files

RESULTS = ROOT / "benchmarks" / "results"
DEVICE_PATHS = ("templates", "dcpc/ops", "dcpc/codegen", "dcpc/runtime", "dcpc/harness")


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@cache
def _known(commit: str) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


@cache
def _changed(commit: str, paths: tuple[str, ...]) -> bool:
    """Whether any of ``paths`` differs between ``commit`` and the working tree."""
    return _git("diff", "--quiet", commit, "--", *paths).returncode != 0


def clean_runs(results: Path = RESULTS) -> dict[tuple[str, str], list[str]]:
    """(file, world) -> the commits of the committed results where it ran clean."""
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(results.glob("gpu_conformance_*.json")):
        data = json.loads(path.read_text())
        for r in data.get("records", []):
            case = r.get("case") or {}
            if r.get("ok") and case.get("file") and case.get("world"):
                commits = out.setdefault((case["file"], str(case["world"])), [])
                if data["commit"] not in commits:
                    commits.append(data["commit"])
    return out


def pending(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every case of the suite with ``settled`` (the commit that settles it, or None)
    and ``why`` (what keeps it pending)."""
    runs = clean_runs(results)
    out = []
    for case in cases(schedule_files()):
        key = (case["file"], case["world"])
        settled, why = None, "never ran clean on a GPU"
        for commit in runs.get(key, []):
            if not _known(commit):
                why = f"ran clean at {commit}, a commit this clone does not have"
            elif _changed(commit, (case["file"],)):
                why = f"ran clean at {commit}; the file changed since"
            elif _changed(commit, DEVICE_PATHS):
                why = f"ran clean at {commit}; device code changed since"
            else:
                settled = commit
                break
        out.append({"file": case["file"], "world": case["world"], "settled": settled,
                    "why": None if settled else why})
    return out


def commands(rows: list[dict[str, Any]]) -> list[str]:
    """gpu_conformance command lines that run the pending cases: one per set of worlds."""
    by_worlds: dict[tuple[str, ...], list[str]] = {}
    worlds: dict[str, list[str]] = {}
    for r in rows:
        if r["settled"] is None:
            worlds.setdefault(r["file"], []).append(r["world"])
    for file, ws in worlds.items():
        by_worlds.setdefault(tuple(ws), []).append(file)
    return [f"python3 -m benchmarks.gpu_conformance --out $OUT/gpu --repeat 1 "
            f"--worlds {','.join(ws)} {' '.join(files)}"
            for ws, files in sorted(by_worlds.items(), key=lambda kv: (kv[0][0] in
                                                                       MESH_WORLDS, kv[0]))]


def plans(rows: list[dict[str, Any]], shards: int, first: list[str]) -> list[list[str]]:
    """The pending cases as ``shards`` lists of lines "WORLDS FILE ...", each line one
    gpu_conformance run: in each shard the files named in ``first`` and those that never
    ran clean come first (all their pending worlds), then every other file at its smallest
    pending world (a small world runs fast: breadth before depth), then the rest."""
    worlds: dict[str, list[str]] = {}
    never: set[str] = set()
    for r in rows:
        if r["settled"] is None:
            worlds.setdefault(r["file"], []).append(r["world"])
            if r["why"] == "never ran clean on a GPU":
                never.add(r["file"])
    urgent = [f for f in worlds if f in first or f in never]
    stages: list[list[tuple[str, list[str]]]] = [
        [(f, worlds[f]) for f in urgent],
        [(f, worlds[f][:1]) for f in worlds if f not in urgent],
        [(f, worlds[f][1:]) for f in worlds if f not in urgent and len(worlds[f]) > 1]]
    out: list[list[str]] = [[] for _ in range(shards)]
    turn = 0
    for stage in stages:
        lines: list[dict[str, list[str]]] = [{} for _ in range(shards)]
        for file, ws in stage:
            lines[turn % shards].setdefault(",".join(ws), []).append(file)
            turn += 1
        for i, by_worlds in enumerate(lines):
            out[i] += [f"{ws} {' '.join(files)}" for ws, files in by_worlds.items()]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="the folder of gpu_conformance_*.json (default: the committed)")
    ap.add_argument("--json", action="store_true", help="print the cases as JSON")
    ap.add_argument("--plans", type=Path, default=None, metavar="DIR",
                    help="write DIR/plan<i>.txt for benchmarks/conformance_shards.sh")
    ap.add_argument("--shards", type=int, default=4, help="processes side by side (4)")
    ap.add_argument("--first", nargs="+", default=[], metavar="FILE",
                    help="schedule files to run first, every pending world")
    args = ap.parse_args(argv)
    rows = pending(args.results)
    if args.plans is not None:
        args.plans.mkdir(parents=True, exist_ok=True)
        for i, lines in enumerate(plans(rows, args.shards, args.first), 1):
            (args.plans / f"plan{i}.txt").write_text("".join(f"{x}\n" for x in lines))
        print(f"{sum(r['settled'] is None for r in rows)} pending cases in {args.shards} "
              f"plans under {args.plans}")
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    left = [r for r in rows if r["settled"] is None]
    print(f"{len(rows) - len(left)} of {len(rows)} GPU conformance cases settled; "
          f"{len(left)} pending (device code: {', '.join(DEVICE_PATHS)})")
    for r in left:
        print(f"  {r['file']} at {r['world']}: {r['why']}")
    if left:
        print("to run them:")
        for line in commands(rows):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
