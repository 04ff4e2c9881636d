"""The Markdown report of one_gpu_results.json (benchmarks/one_gpu.py). Pure Python."""

from __future__ import annotations

from collections import defaultdict
from typing import Any


def _count(recs: list[dict[str, Any]]) -> str:
    return f"{sum(bool(r.get('ok')) for r in recs)}/{len(recs)}"


def _worst(recs: list[dict[str, Any]], buf: str) -> float:
    errs = [b.get("max_err", 0.0) for r in recs for name, b in (r.get("buffers") or {}).items()
            if name == buf and isinstance(b, dict)]
    return max(errs) if errs else float("nan")


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _configs(recs: list[dict[str, Any]]) -> int:
    return len({(x.get("H"), x.get("T")) for x in recs})


def _clean(recs: list[dict[str, Any]], key: str) -> int:
    """The fewest clean replays (or iterations) any (schedule, rank) got, over all configs."""
    total: dict[tuple[Any, Any], int] = defaultdict(int)
    for x in recs:
        total[(x.get("schedule"), x.get("rank"))] += x.get(key, 0) if x.get("ok") else 0
    return min(total.values()) if total else 0


def render(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    out = ["# dcpc on ONE GPU: W ranks as threads (backend `local`)", "",
           "**One-device numbers.** Every rank's peer is the same GPU's memory: no NVLink. "
           "The timings show how the kernels' own cost grows with W; they are not what W "
           "GPUs measure (benchmarks/results/gpu_results.md has 2xH200).", "",
           f"- date: {meta.get('date')}; device: {meta.get('device')}; torch "
           f"{meta.get('torch')}, triton {meta.get('triton')}, python {meta.get('python')}",
           f"- commit: {meta.get('commit')}; CUDA_MODULE_LOADING="
           f"{meta.get('cuda_module_loading')}; argv: {meta.get('argv')}",
           f"- status: {_first_line(results.get('status', 'running'))}; "
           f"{results.get('seconds', '?')} s", ""]
    out += ["## Checks per W", "",
            "| W | correctness (rank records) | worst merge err vs float64 | graph replays "
            "(records ok; H x T configs; clean replays per schedule and rank, min) | DBO "
            "(records ok; configs; clean iterations per schedule and rank, min) | errors |",
            "| --- | --- | --- | --- | --- | --- |"]
    for W, r in results.get("worlds", {}).items():
        g, d = r.get("graphs", []), r.get("dbo", [])
        out.append(f"| {W} | {_count(r.get('correctness', []))} | "
                   f"{_worst(r.get('correctness', []), 'out'):.4f} | {_count(g)}; "
                   f"{_configs(g)}; {_clean(g, 'replays')} | {_count(d)}; {_configs(d)}; "
                   f"{_clean(d, 'iters')} | {len(r.get('errors', []))}"
                   + (f" ({_first_line(r['error'])[:120]})" if r.get("error") else "") + " |")
    out += ["", "Correctness: every decode schedule at every H x T of the run (H a multiple "
            "of W), random request layouts with empty shards, padding rows, NaN/inf garbage "
            "in masked partials; gathers and exchanges bit-exact, merges within bf16 "
            "tolerance of float64; kv_gather at 1, 7, 1000 rows.", ""]
    for W, r in results.get("worlds", {}).items():
        bad = [x for x in r.get("correctness", []) + r.get("graphs", []) + r.get("dbo", [])
               if not x.get("ok")]
        for x in bad[:10]:
            out.append(f"- W={W} FAIL {x.get('schedule')} H={x.get('H')} T={x.get('T')} "
                       f"rank {x.get('rank')}: {str(x.get('error') or x.get('buffers'))[:200]}")
    out += ["", "## Latency per W (one device; median us per call over CUDA-graph replays, "
            "max over ranks)", ""]
    table: dict[tuple[str, Any, Any], dict[str, float]] = defaultdict(dict)
    worlds = list(results.get("worlds", {}))
    for W, r in results.get("worlds", {}).items():
        for rec in r.get("latency", []):
            key = (rec["method"], rec.get("H"), rec.get("T") or rec.get("mb_per_rank"))
            table[key][W] = rec["us"]
    if table:
        out += ["| method | H | T (or MB/rank) | " + " | ".join(f"W={w}" for w in worlds) + " |",
                "| --- | --- | --- | " + " | ".join("---" for _ in worlds) + " |"]
        for (m, H, T), per in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                     kv[0][2] or 0)):
            out.append(f"| {m} | {H if H is not None else ''} | {T if T is not None else ''} | "
                       + " | ".join(f"{per[w]:.1f}" if w in per else "" for w in worlds) + " |")
    guard = [(W, r) for W, r in results.get("worlds", {}).items() if r.get("latency_guard_off")]
    if guard:
        out += ["", "## The run-time guard's device cost (one device; us per call, graph "
                "replays; guard on = the default)", "",
                "| W | method | H | T | guard on | guard off |",
                "| --- | --- | --- | --- | --- | --- |"]
        for W, r in guard:
            on = {(x["method"], x["H"], x["T"]): x["us"] for x in r.get("latency", [])}
            for x in r["latency_guard_off"]:
                k = (x["method"], x["H"], x["T"])
                out.append(f"| {W} | {k[0]} | {k[1]} | {k[2]} | "
                           f"{f'{on[k]:.1f}' if k in on else ''} | {x['us']:.1f} |")
    eng = results.get("engines")
    if eng:
        counts = ", ".join(f"{n} {k}" for k, n in eng.get("counts", {}).items())
        out += ["", "## Engine adapters on this GPU (dcpc.engines; "
                "tests/engines/test_engines_local.py with DCPC_TEST_DEVICE=cuda:0, "
                "the kernel-side empty-shard mask)", "",
                f"- status: {eng.get('status')}; {counts or 'no counts'}"]
        if eng.get("status") != "ok":
            out += ["", "```", *eng.get("tail", []), "```"]
    host = results.get("host", {})
    if host.get("methods"):
        out += ["", f"## Host time per eager call (W = 1, one thread, H={host['H']} "
                f"T={host['T']}; median of {host['reps']} x {host['calls']} calls; target "
                f"<= {host['target_us']:.0f} us)", "",
                "Host us per call through dcpc's launch path (dcpc.runtime.fastlaunch, the "
                "default; DCPC_FAST_LAUNCH=0 turns it off) and through Triton's own "
                "`kernel[grid](...)`, measured in turn in the same process.", "",
                "| schedule | method | host us (guard on) | Triton's launch | guard off | "
                "Triton's launch | replaces | its host us |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]

        def us(x: Any) -> str:
            return f"{x:.1f}" if x else ""

        for row in host["methods"]:
            out.append(f"| {row['schedule']} | {row['method']} | {us(row.get('host_us'))} | "
                       f"{us(row.get('host_us_triton_launch'))} | "
                       f"{us(row.get('host_us_guard_off'))} | "
                       f"{us(row.get('host_us_guard_off_triton_launch'))} | "
                       f"{row.get('anchor') or ''} | {us(row.get('anchor_us'))} |")
    elif host.get("error"):
        out += ["", f"Host section failed: {host['error']}"]
    for W, r in results.get("worlds", {}).items():
        res = r.get("residency") or {}
        if res.get("kernels"):
            per: dict[str, list[dict[str, int]]] = defaultdict(list)
            for name, k in res["kernels"].items():
                per[name.split(":")[0]].append(k)
            out += ["", f"## Co-residency (kernels loaded by the first W run, W={W}; "
                    f"{res.get('sms')} SMs)", "",
                    f"Programs per signalling launch used at W={W}: {r.get('programs')}", "",
                    "| kernel | variants | regs (max) | spills (max) | shared B (max) | warps | "
                    "programs per SM (min) |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for name, ks in sorted(per.items()):
                out.append(f"| {name} | {len(ks)} | {max(k['regs'] for k in ks)} | "
                           f"{max(k['spills'] for k in ks)} | {max(k['shared'] for k in ks)} | "
                           f"{max(k['num_warps'] for k in ks)} | "
                           f"{min(k.get('programs_per_sm', 0) for k in ks)} |")
            break
    errors = [(W, e) for W, r in results.get("worlds", {}).items() for e in r.get("errors", [])]
    if errors:
        out += ["", "## Errors (first 15)", ""]
        for W, e in errors[:15]:
            out.append(f"- W={W} r{e.get('rank')} {e.get('section')}/{e.get('item')}: "
                       f"{_first_line(e.get('error', ''))[:300]}")
    return "\n".join(out) + "\n"
