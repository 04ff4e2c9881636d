"""Plot latency vs T per method (log-log, one panel per H) from gpu_results.json.

    python benchmarks/plot.py benchmarks/results/gpu_results.json -o gpu_latency.png

Never raises from ``make_plot``: a missing matplotlib returns an explanation instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

STYLE = {"generated": "-", "baseline": "--"}


def series(results: dict[str, Any]) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """{H: {method: [(T, us), ...] sorted by T}} from the latency records."""
    out: dict[int, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in results.get("latency", []):
        if r.get("H") is not None and r.get("T") is not None and r.get("us"):
            out[r["H"]][r["method"]].append((int(r["T"]), float(r["us"])))
    return {h: {m: sorted(v) for m, v in ms.items()} for h, ms in out.items()}


def make_plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG; return None on success, else why no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"no plot: matplotlib unavailable ({exc})"
    data = series(results)
    if not data:
        return "no plot: no latency records"
    kinds = {r["method"]: r.get("kind", "") for r in results.get("latency", [])}
    try:
        fig, axes = plt.subplots(1, len(data), figsize=(6.5 * len(data), 5), squeeze=False)
        for ax, H in zip(axes[0], sorted(data), strict=True):
            for method, pts in sorted(data[H].items()):
                ts, us = zip(*pts, strict=True)
                ax.plot(ts, us, STYLE.get(kinds.get(method, ""), ":"), marker="o",
                        label=method)
            if results.get("floor_us"):
                ax.axhline(results["floor_us"], color="grey", lw=0.8, label="signal floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("T (tokens)")
            ax.set_ylabel("us per call (median, max over ranks)")
            world = results.get("meta", {}).get("world", "?")
            ax.set_title(f"H = {H}, W = {world}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    except Exception as exc:  # noqa: BLE001
        return f"no plot: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    """CLI: plot a results file."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=Path("gpu_latency.png"))
    args = ap.parse_args(argv)
    why = make_plot(json.loads(args.results.read_text()), args.output)
    print(why or f"wrote {args.output}")
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
