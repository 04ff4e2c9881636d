"""The latency plot of gpu_results.json: one panel per operation, dcpc paired with its
anchor, the speed-up written at each point.

    python -m benchmarks.report.plot benchmarks/results/gpu_results.json -o gpu_latency.png

Panels: query gather (direct_gather vs nccl_gather), exchange+merge (fused_combine vs
nccl_a2a_fused), ag_rs (agrs_generated vs nccl_agrs_fused), KV gather (kv_gather+release
vs the copy engine's peer copy). One colour per H (per panel, two lines of that colour:
dcpc solid with circles, the anchor dashed with squares); the number at each dcpc point is
anchor time / dcpc time (> 1: dcpc is faster). Never raises from ``make_plot``: a missing
matplotlib returns an explanation instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# (title, dcpc method, anchor method, anchor label)
PANELS: list[tuple[str, str, str, str]] = [
    ("query gather", "direct_gather", "nccl_gather", "NCCL all_gather + copy"),
    ("exchange + merge", "fused_combine", "nccl_a2a_fused", "NCCL a2a + fused merge"),
    ("ag_rs (LSE gather, correct, reduce-scatter)", "agrs_generated", "nccl_agrs_fused",
     "NCCL ag_rs + fused correction"),
]
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]  # blue, red, green, purple


def series(results: dict[str, Any], method: str) -> dict[int, list[tuple[int, float]]]:
    """{H: [(T, us), ...] sorted by T} of one method."""
    out: dict[int, list[tuple[int, float]]] = {}
    for r in results.get("latency", []):
        if r.get("method") == method and r.get("H") is not None and r.get("us"):
            out.setdefault(int(r["H"]), []).append((int(r["T"]), float(r["us"])))
    return {h: sorted(v) for h, v in sorted(out.items())}


def _pair(ax: Any, xs_a: list[tuple[int, float]], xs_b: list[tuple[int, float]],
          colour: str, label_a: str, label_b: str, above: bool = False) -> None:
    ax.plot(*zip(*xs_a, strict=True), "-o", color=colour, lw=2, ms=5, label=label_a)
    ax.plot(*zip(*xs_b, strict=True), "--s", color=colour, lw=1.2, ms=4, alpha=0.75,
            label=label_b)
    anchor = dict(xs_b)
    for x, us in xs_a:
        if anchor.get(x):
            ax.annotate(f"{anchor[x] / us:.2f}x", (x, us), textcoords="offset points",
                        xytext=(9, 6) if above else (9, -13), ha="left", fontsize=8,
                        color=colour, fontweight="bold")


def make_plot(results: dict[str, Any], path: Path) -> str | None:
    """Write the PNG; return None on success, else why no plot was made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001 - plotting is optional
        return f"no plot: matplotlib unavailable ({exc})"
    if not results.get("latency"):
        return "no plot: no latency records"
    meta = results.get("meta", {})
    try:
        fig, axes = plt.subplots(1, 4, figsize=(22, 5.5))
        for ax, (title, mine, anchor, anchor_label) in zip(axes[:3], PANELS, strict=True):
            ours, theirs = series(results, mine), series(results, anchor)
            for i, H in enumerate(h for h in ours if h in theirs):
                _pair(ax, ours[H], theirs[H], COLOURS[i % len(COLOURS)],
                      f"dcpc {mine}, H={H}", f"{anchor_label}, H={H}", above=i % 2 == 1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({t for pts in ours.values() for t, _ in pts})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xlim(ticks[0] / 1.6, ticks[-1] * 2.2) if ticks else None
            ax.set_xlabel("T (query rows per step)")
            ax.set_title(title)
        axes[0].set_ylabel("us per call (median of graph replays, max over ranks)")
        kv = [r for r in results.get("kv", []) if r.get("kv_gather+release")
              and r.get("peer_copy")]
        ax = axes[3]
        if kv:
            mine_kv = [(r["mb_per_rank"], r["kv_gather+release"]["us"]) for r in kv]
            copy_kv = [(r["mb_per_rank"], r["peer_copy"]["us"]) for r in kv]
            _pair(ax, mine_kv, copy_kv, COLOURS[2], "dcpc kv_gather + release",
                  "copy engine peer copy (no layout)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = [m for m, _ in mine_kv]
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xlim(ticks[0] / 1.6, ticks[-1] * 2.2)
        ax.set_xlabel("MB of KV per rank")
        ax.set_title("KV gather (numbers: copy time / dcpc time)")
        for ax in axes:
            ax.margins(y=0.12)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7.5, loc="upper left")
        fig.suptitle(
            f"dcpc vs its anchor on {meta.get('device', '?')} x {meta.get('world', '?')} "
            f"(commit {str(meta.get('commit', '?'))[:7]}, {str(meta.get('date', ''))[:10]}); "
            "numbers at the dcpc points: anchor time / dcpc time", fontsize=11)
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
