"""Targets (PASS/FAIL) and the Markdown report from gpu_results.json's dict. Pure Python."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

# (name, method, reference, predicate on T or MB, limit, "le" | "ge")
TARGETS: list[tuple[str, str, str, Any, float, str]] = [
    ("query gather <= 1.3x floor (T<=8)", "direct_gather", "floor", lambda t: t <= 8, 1.3,
     "le"),
    ("query gather <= 0.55x NCCL gather (T=512)", "direct_gather", "nccl_gather",
     lambda t: t == 512, 0.55, "le"),
    ("fused exchange+merge <= 0.35x fused-NCCL ag_rs (T<=64)", "fused_combine",
     "nccl_agrs_fused", lambda t: t <= 64, 0.35, "le"),
    ("fused exchange+merge <= 2x floor (T<=8)", "fused_combine", "floor", lambda t: t <= 8,
     2.0, "le"),
]
KV_TARGET = ("KV gather >= 85% of peer-copy GB/s (>=16 MB/rank)", 0.85)


def latency_table(results: dict[str, Any]) -> dict[tuple[str, int, int], float]:
    """{(method, H, T): us} for the decode benchmarks (records with H and T)."""
    return {(r["method"], r["H"], r["T"]): r["us"] for r in results.get("latency", [])
            if r.get("H") is not None and r.get("T") is not None and r.get("us")}


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target check that the numbers allow, with ratio and PASS/FAIL."""
    lat = latency_table(results)
    floor = results.get("floor_us")
    out: list[dict[str, Any]] = []
    for name, method, ref, when, limit, how in TARGETS:
        for (m, H, T), us in sorted(lat.items()):
            if m != method or not when(T):
                continue
            base = floor if ref == "floor" else lat.get((ref, H, T))
            if not base:
                continue
            ratio = us / base
            ok = ratio <= limit if how == "le" else ratio >= limit
            out.append({"target": name, "H": H, "T": T, "us": us, "ref_us": base,
                        "ratio": ratio, "limit": limit, "pass": ok})
    name, limit = KV_TARGET
    for rec in results.get("kv", []):
        got, ref = rec.get("kv_gather+release"), rec.get("peer_copy")
        if rec.get("mb_per_rank", 0) >= 16 and got and ref:
            ratio = got["gbps"] / ref["gbps"]
            out.append({"target": name, "H": None, "T": None, "mb_per_rank": rec["mb_per_rank"],
                        "us": got["us"], "ref_us": ref["us"], "ratio": ratio, "limit": limit,
                        "pass": ratio >= limit})
    return out


def staging_gain(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Direct-to-final vs staging: (staging - direct) / staging, in percent."""
    lat = latency_table(results)
    rows = []
    for (m, H, T), direct in sorted(lat.items()):
        staging = lat.get(("staging_gather", H, T))
        if m == "direct_gather" and staging:
            rows.append({"H": H, "T": T, "direct_us": direct, "staging_us": staging,
                         "gain_pct": 100.0 * (staging - direct) / staging})
    return rows


def _fmt(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _checks(results: dict[str, Any], key: str, cols: list[str]) -> list[str]:
    recs = results.get(key, [])
    if not recs:
        return [f"_{key}: not run_", ""]
    bad = [r for r in recs if not r.get("ok")]
    lines = [f"{len(recs) - len(bad)}/{len(recs)} ok (records of every rank).", ""]
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for r in recs:
        groups[(r.get("schedule"), r.get("backend", r.get("order")))].append(r)
    lines += _table(["schedule", "backend/order", "ok", "total", "worst max_err"], [
        [s, b, sum(bool(r.get("ok")) for r in rs), len(rs), _fmt(_worst(rs), ".3g")]
        for (s, b), rs in groups.items()])
    show = bad if bad else recs if len(recs) <= 24 else []
    if show:
        lines += _table(cols + ["ok", "detail"], [
            [r.get(c) for c in cols] + ["PASS" if r.get("ok") else "FAIL",
                                        r.get("error") or _detail(r)] for r in show[:40]])
    return lines


def _worst(recs: list[dict[str, Any]]) -> float | None:
    errs = [v.get("max_err") for r in recs for v in (r.get("buffers") or {}).values()
            if isinstance(v, dict) and v.get("max_err") is not None]
    return max(errs) if errs else None


def _detail(rec: dict[str, Any]) -> str:
    bufs = rec.get("buffers")
    if isinstance(bufs, dict):
        return "; ".join(f"{k}: " + ", ".join(f"{a}={_fmt(b, '.3g')}" for a, b in v.items())
                         for k, v in bufs.items())
    keys = ("replays", "bad_replays", "first_bad", "iters", "bad_slot0", "bad_slot1")
    return ", ".join(f"{k}={rec[k]}" for k in keys if k in rec)


def render(results: dict[str, Any]) -> str:
    """The whole gpu_results.md."""
    meta = results.get("meta", {})
    lines = ["# dcpc GPU results", ""]
    lines += [f"- {k}: {meta.get(k)}" for k in ("date", "device", "world", "torch", "triton",
                                                 "nccl", "commit", "argv") if k in meta]
    lines += [f"- status: {results.get('status', 'running')}", ""]
    lines += ["## Sections", ""] + _table(["section", "status", "seconds"], [
        [k, v.get("status"), v.get("seconds")] for k, v in results.get("sections", {}).items()])
    lines += ["## Correctness (eager, vs float64 reference and between backends)", ""]
    lines += _checks(results, "correctness", ["schedule", "backend", "H", "T", "rank"])
    lines += ["## CUDA-graph replays (every replay checked)", ""]
    lines += _checks(results, "graphs",
                     ["schedule", "H", "T", "rank", "replays", "bad_replays"])
    lines += ["## DBO: two slots on two streams", ""]
    lines += _checks(results, "dbo", ["schedule", "H", "T", "order", "rank", "iters"])
    lines += ["## Latency (us, median over CUDA-graph replays, max over ranks)", ""]
    samples = ", ".join(f"{x:.2f}" for x in results.get("floor_samples_us", []))
    lines.append(f"Signal-only floor: {_fmt(results.get('floor_us'), '.2f')} us"
                 + (f" (median of {samples})" if samples else "") + ". "
                 f"Peer copy 134 MB: {_fmt((results.get('peer_copy') or {}).get('gbps'))} GB/s"
                 " received per rank.")
    lines.append("")
    lat = latency_table(results)
    by_h: dict[int, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for (m, H, T), us in lat.items():
        by_h[H][m][T] = us
    for H in sorted(by_h):
        ts = sorted({t for row in by_h[H].values() for t in row})
        lines += [f"### H = {H}", ""]
        lines += _table(["method"] + [f"T={t}" for t in ts],
                        [[m] + [by_h[H][m].get(t) for t in ts] for m in by_h[H]])
    kv = results.get("kv", [])
    if kv:
        lines += ["## KV gather bandwidth (GB/s = bytes received per rank / time per call)",
                  ""]
        methods = ["kv_gather+release", "kv_gather", "peer_copy"]
        lines += _table(["MB/rank"] + [f"{m} us" for m in methods] +
                        [f"{m} GB/s" for m in methods],
                        [[r["mb_per_rank"]] + [(r.get(m) or {}).get("us") for m in methods] +
                         [(r.get(m) or {}).get("gbps") for m in methods] for r in kv])
    lines += ["## Targets", ""]
    tg = targets(results)
    rows = [[t["target"], t["H"], t.get("mb_per_rank", t["T"]), t["us"], t["ref_us"],
             format(t["ratio"], ".3f"), format(t["limit"], "g"),
             "PASS" if t["pass"] else "FAIL"] for t in tg]
    lines += _table(["target", "H", "T or MB", "us", "ref us", "ratio", "limit", "result"],
                    rows) if tg else ["_no target could be evaluated_", ""]
    gain = staging_gain(results)
    if gain:
        lines += ["## Direct-to-final vs staging", ""]
        lines += _table(["H", "T", "direct us", "staging us", "gain %"],
                        [[g["H"], g["T"], g["direct_us"], g["staging_us"], g["gain_pct"]]
                         for g in gain])
    errors = results.get("errors", [])
    if errors:
        lines += [f"## Errors ({len(errors)})", ""]
        lines += [f"- r{e.get('rank')} {e['section']}/{e['item']}: "
                  f"{e['error'][:300].replace(chr(10), ' ')}" for e in errors[:60]]
        lines.append("")
    return "\n".join(lines)
