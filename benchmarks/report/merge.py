"""Merge the parts of a one-GPU run (benchmarks/run_one_gpu.sh: the checks of each W in
their own process, then the timed sections alone) into one results file and its report.

    python3 -m benchmarks.report.merge PART.json... -o DIR   # DIR/one_gpu_results.{json,md}
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any


def engines_summary(log: Path) -> dict[str, Any]:
    """What the engine adapters' tests on the GPU said: pytest's counts and last lines."""
    if not log.exists():
        return {"status": "not run"}
    text = log.read_text(errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text)}
    tail = text.strip().splitlines()[-12:]
    ok = counts.get("passed", 0) > 0 and not counts.get("failed") and not counts.get("error")
    return {"status": "ok" if ok else "failed", "counts": counts, "tail": tail}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict: the first part's metadata (argv of every part), every part's
    records per W (lists joined, dicts updated), the host section, every status."""
    out: dict[str, Any] = {"meta": dict(parts[0].get("meta", {})), "worlds": {}, "parts": []}
    for part in parts:
        meta = part.get("meta", {})
        out["parts"].append({"argv": meta.get("argv"), "status": part.get("status"),
                             "seconds": part.get("seconds")})
        for W, rec in part.get("worlds", {}).items():
            into = out["worlds"].setdefault(W, {"sections": {}})
            for key, value in rec.items():
                if isinstance(value, list):
                    into.setdefault(key, []).extend(value)
                elif isinstance(value, dict) and isinstance(into.get(key), dict):
                    into[key].update(value)
                else:
                    into[key] = value
        if "host" in part:
            out["host"] = part["host"]
    statuses = [p.get("status", "?") for p in parts]
    out["status"] = "done" if all(s == "done" for s in statuses) else "; ".join(map(str, statuses))
    out["seconds"] = round(sum(p.get("seconds") or 0 for p in parts), 1)
    out["meta"]["argv"] = [p["argv"] for p in out["parts"]]
    out["worlds"] = dict(sorted(out["worlds"].items(), key=lambda kv: int(kv[0])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--engines", type=Path, default=None, help="the adapters' pytest log")
    args = ap.parse_args(argv)
    parts = [json.loads(p.read_text()) for p in args.parts if p.exists()]
    if not parts:
        print("merge: no part found")
        return 1
    from benchmarks.report.one_gpu import render

    results = merge(parts)
    if args.engines is not None:
        results["engines"] = engines_summary(args.engines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "one_gpu_results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "one_gpu_results.md").write_text(render(results))
    print(f"merge: {len(parts)} parts -> {args.out / 'one_gpu_results.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
