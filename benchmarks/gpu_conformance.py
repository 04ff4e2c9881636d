"""The GPU conformance suite: every schedule, run on a real GPU, against float64.

Every file in schedules/, schedules/gallery/ and schedules/ops/ runs through
`dcpc run --device cuda` (the harness `dcpc run` uses on CPU, with the compiled kernels:
backend local, W ranks as threads of one process on one GPU, every kernel compiled and
loaded before any rank launches) at W = 2, 4, 8 (mesh schedules at 2x2, 2x4, 4x2),
REPEAT runs each (seeds 0, 1, ...), two slots interleaved where a schedule has two,
random per-call sizes up to a maximum that is a multiple of 16 (call 0 at it, call 1 at
1, the others random: non-multiples of 16 included), the module's own tuning (several
programs per launch), poisoned memory. JOBS cases run at once, so every case shares the
GPU with other GPU processes (the contention that showed races on 2026-12-04).

    python3 -m benchmarks.gpu_conformance --out DIR [--jobs 6] [--repeat 3] [FILE ...]
    python3 -m benchmarks.gpu_conformance --out DIR --merge A.json B.json ...


Writes DIR/gpu_conformance_<commit>.json (one record per schedule, world and repeat:
status, mismatches, first mismatch, errors, and the case's key: what the run executed,
benchmarks/gpu_keys.py, by which benchmarks/gpu_pending.py settles the case later)
and DIR/gpu_conformance_<commit>.md (a table). Exit 0 only when every case ran clean.
Without a GPU every case fails at once with dcpc run's own message.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PLAIN_WORLDS = ["2", "4", "8"]
MESH_WORLDS = ["2x2", "2x4", "4x2"]
SIZE_MAX = 32  # the largest per-call size: a multiple of 16 (Triton specialises on it)
# `python -m dcpc` that writes, on its way out, the dcpc modules it imported to the file
# argv[1] names (then runs with the rest): what a case executed, to check against its key
IMPORTS = ("import atexit, json, runpy, sys\n"
           "out = sys.argv.pop(1)\n"
           "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(\n"
           "    m for m in list(sys.modules) if m == 'dcpc' or m.startswith('dcpc.')))))\n"
           "runpy.run_module('dcpc', run_name='__main__', alter_sys=True)\n")


def schedule_files() -> list[Path]:
    return [p for folder in ("schedules", "schedules/gallery", "schedules/ops")
            for p in sorted((ROOT / folder).glob("*.yaml"))]


def _claimed(path: Path) -> list[str] | None:
    """The worlds a file's `# check:` header claims (None: no header)."""
    found = re.search(r"^# check: (.+)$", path.read_text(), re.M)
    if not found:
        return None
    from dcpc.lang.mesh import parse_shapes

    out: list[str] = []
    for part in found.group(1).split():
        if "x" in part:
            out += [str(s) for s in parse_shapes(part, 1024)]
        else:
            lo, _, hi = part.partition("..")
            out += [str(w) for w in range(int(lo), int(hi or lo) + 1)]
    return out


def cases(files: list[Path]) -> list[dict[str, Any]]:
    """(file, world, sizes, order) for every file and the worlds the suite runs."""
    from dcpc.lang.mesh import MeshWorld
    from dcpc.lang.parse import parse_file

    out = []
    for path in files:
        mesh = bool(re.search(r"^mesh:", path.read_text(), re.M))
        schedule = parse_file(path, world=MeshWorld([2, 2]) if mesh else 2)
        worlds = MESH_WORLDS if mesh else PLAIN_WORLDS
        claimed = _claimed(path)
        if claimed is not None:
            worlds = [w for w in worlds if w in claimed]
        axes = {str(v) for v in (getattr(schedule, "mesh", None) or {}).values()}
        sizes = {name: min(spec.max, SIZE_MAX) for name, spec in schedule.sizes.items()
                 if not isinstance(spec, int) and spec.max is not None and name not in axes}
        slots = schedule.slots
        for world in worlds:
            out.append({"file": str(path.relative_to(ROOT)), "world": world, "sizes": sizes,
                        "order": "interleaved" if slots >= 2 else "sequential"})
    return out


def run_case(case: dict[str, Any], repeat: int, calls: int, wait_s: float, timeout_s: float,
             tmp: Path, device: str = "cuda") -> list[dict[str, Any]]:
    """One file at one world, REPEAT runs: the records of `dcpc run --json`."""
    tag = f"{Path(case['file']).stem}_{case['world']}"
    out, imports = tmp / f"{tag}.json", tmp / f"{tag}.imports.json"
    base = [sys.executable, "-c", IMPORTS, str(imports), "run", case["file"], "--device", device,
            "--backend", "local", "--world", case["world"], "--calls", str(calls),
            "--repeat", str(repeat), "--order", case["order"], "--jitter-ms", "0.5",
            "--wait-timeout", str(wait_s), "--timeout", str(timeout_s), "--json", str(out),
            "--debug"]
    tries = [base + (["--sizes", ",".join(f"{k}={v}" for k, v in case["sizes"].items())]
                     if case["sizes"] else []), base]
    t0 = time.monotonic()
    text, code = "", 0
    for cmd in tries:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  timeout=timeout_s * repeat + 120)
            text, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            text, code = f"killed after {exc.timeout:.0f} s\n{exc.stdout or ''}", -9
        if not (code == 2 and "--sizes" in text):
            break  # sizes the schedule refuses: once more with the harness's own
    records = json.loads(out.read_text()) if out.exists() else []
    if not records and code == 0:
        code = -1  # no record written: say so below
    for r in records:
        r["case"] = case
    if code != 0 and (not records or all(r["ok"] for r in records)):
        records.append({"case": case, "ok": False, "status": f"exit {code}",
                        "schedule": Path(case["file"]).stem, "world": case["world"],
                        "errors": [text[-3000:]], "outputs": {}, "mismatches": 0})
    unkeyed = unkeyed_imports(imports, device)
    for r in records:
        r["case_s"] = round(time.monotonic() - t0, 1)
        if unkeyed:
            r.update(ok=False, status="ran code its key leaves out",
                     errors=[*r.get("errors", []), f"imported outside the key: {unkeyed}"])
        if not r["ok"]:
            r["log_tail"] = text[-4000:]
    return records


def unkeyed_imports(imports: Path, device: str) -> list[str]:
    """The dcpc modules a case imported (the file IMPORTS wrote) that its key leaves out
    (benchmarks/gpu_keys.py: not in a code part; on cuda, the CPU-only files too: they
    must not run there). [] where nothing was written (the run died first)."""
    from benchmarks.gpu_keys import CPU_ONLY_FILES, code_files

    if not imports.exists():
        return []
    keyed = {f for files in code_files(ROOT).values() for f in files}
    if device != "cuda":
        keyed |= set(CPU_ONLY_FILES)
    out = []
    for name in json.loads(imports.read_text()):
        base = ROOT.joinpath(*name.split("."))
        rel = next((p.relative_to(ROOT).as_posix() for p in (base.with_suffix(".py"),
                                                             base / "__init__.py")
                    if p.is_file()), None)
        if rel is not None and rel not in keyed:
            out.append(name)
    return out


def table(records: list[dict[str, Any]], commit: str, device: str, wall_s: float,
          merged: int = 0) -> str:
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        rows.setdefault(r["case"]["file"], {}).setdefault(r["case"]["world"], []).append(r)
    worlds = PLAIN_WORLDS + MESH_WORLDS
    clean = sum(r["ok"] for r in records)
    lines = [f"# GPU conformance at {commit}", "",
             f"{time.strftime('%Y-%m-%d')}, {device}, `python3 -m benchmarks.gpu_conformance`: "
             f"{clean} of {len(records)} runs clean, "
             + (f"{wall_s:.0f} s summed over {merged} result files merged (their runs side "
                "by side)" if merged else f"{wall_s:.0f} s") + ". Each cell: clean runs of "
             "the repeats (backend local, W ranks as threads on one GPU, other cases "
             "running beside it).", "",
             "| schedule | " + " | ".join(worlds) + " |",
             "| --- | " + " | ".join("---" for _ in worlds) + " |"]
    for file, by_world in rows.items():
        cells = []
        for w in worlds:
            got = by_world.get(w)
            if not got:
                cells.append("")
                continue
            ok = sum(r["ok"] for r in got)
            cell = f"{ok}/{len(got)}"
            if ok < len(got):
                bad = next(r for r in got if not r["ok"])
                cell += f" **{bad.get('status', 'fail')}**"
            cells.append(cell)
        lines.append(f"| {file} | " + " | ".join(cells) + " |")
    failures = [r for r in records if not r["ok"]]
    if failures:
        lines += ["", "## Failures (first of each case)", ""]
        seen = set()
        for r in failures:
            key = (r["case"]["file"], r["case"]["world"])
            if key in seen:
                continue
            seen.add(key)
            firsts = [f"{k}: {v['first']}" for k, v in r.get("outputs", {}).items()
                      if v.get("first")]
            what = "; ".join(firsts) or "; ".join(r.get("errors", []))[:600]
            lines.append(f"- {key[0]} at {key[1]} (seed {r.get('seed', '?')}): "
                         f"{what[:800]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="schedule files (default: every one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=6, help="cases at once (default 6)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--worlds", default=None, help="only these worlds, e.g. 2,4,2x2")
    ap.add_argument("--wait-timeout", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per run")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--deadline", type=float, default=520.0,
                    help="start no case after this many seconds (default 520)")
    ap.add_argument("--keys", type=Path, default=None, metavar="JSON",
                    help="the cases' keys computed beside the plans (gpu_pending --plans "
                         "DIR: DIR/keys.json), used where they are this tree's")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge these result files of one commit into one table; run nothing")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, Path(a.out))
    files = [Path(f).resolve() for f in a.files] or schedule_files()
    todo = cases(files)
    if a.worlds:
        keep = set(a.worlds.split(","))
        todo = [c for c in todo if c["world"] in keep]
    # the biggest worlds first: they take longest
    todo.sort(key=lambda c: -eval_world(c["world"]))
    commit = os.environ.get("COMMIT") or _git_commit()
    device, versions = _device_name(), _versions()
    keys = run_keys(todo, a.keys)
    start = time.monotonic()
    records: list[dict[str, Any]] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_conformance: {len(todo)} cases x {a.repeat} runs, {a.jobs} at once, on "
          f"{device}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dcpc-conf-") as tmp, \
            ThreadPoolExecutor(a.jobs) as pool:

        def one(case: dict[str, Any]) -> list[dict[str, Any]]:
            if time.monotonic() - start > a.deadline:
                return [{"case": case, "ok": False, "status": "not run (deadline)",
                         "schedule": Path(case["file"]).stem, "world": case["world"],
                         "errors": [], "outputs": {}, "mismatches": 0}]
            got = run_case(case, a.repeat, a.calls, a.wait_timeout, a.timeout, Path(tmp),
                           a.device)
            for r in got:
                r["key"] = keys[(case["file"], case["world"])]
                r["versions"] = versions
            bad = [r for r in got if not r["ok"]]
            print(f"{'ok  ' if not bad else 'FAIL'} {case['file']} W={case['world']} "
                  f"{len(got) - len(bad)}/{len(got)} {got[0].get('case_s', '')} s"
                  + (f"  {bad[0].get('status')}: " + json.dumps(
                      {k: v['first'] for k, v in bad[0].get('outputs', {}).items()
                       if v.get('first')} or bad[0].get('errors', [])[:1])[:400]
                     if bad else ""), flush=True)
            return got

        name = f"gpu_conformance_{commit}"

        def save() -> float:
            """The records so far (after every case: a device call cut short keeps them)."""
            wall = time.monotonic() - start
            for suffix, text in (("json", json.dumps(
                    {"commit": commit, "device": device, "versions": versions,
                     "date": time.strftime("%Y-%m-%d"),
                     "wall_s": round(wall, 1), "repeat": a.repeat, "calls": a.calls,
                     "records": records}, indent=1)),
                    ("md", table(records, commit, device, wall))):
                part = out / f"{name}.{suffix}.part"
                part.write_text(text)
                part.replace(out / f"{name}.{suffix}")
            return wall

        for got in pool.map(one, todo):
            records.extend(got)
            save()
    wall = save()
    clean = all(r["ok"] for r in records)
    print(f"gpu_conformance: {sum(r['ok'] for r in records)}/{len(records)} clean in "
          f"{wall:.0f} s -> {out / name}.md", flush=True)
    return 0 if clean else 1


def merge(paths: list[str], out: Path) -> int:
    """One table of several result files: per (file, world) the records of the last file
    that ran the case (not "not run (deadline)")."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    commits = {r["commit"] for r in runs}
    if len(commits) != 1:
        raise SystemExit(f"--merge: result files of several commits: {sorted(commits)}")
    by_case: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        got: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for r in run["records"]:
            got.setdefault((r["case"]["file"], r["case"]["world"]), []).append(r)
        for key, records in got.items():
            ran = [r for r in records if r.get("status") != "not run (deadline)"]
            if ran or key not in by_case:
                by_case[key] = ran or records
    records = [r for rs in by_case.values() for r in rs]
    commit, device = runs[0]["commit"], runs[0]["device"]
    wall = sum(run["wall_s"] for run in runs)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_conformance_{commit}"
    (out / f"{name}.json").write_text(json.dumps(
        {"commit": commit, "device": device, "date": runs[0]["date"], "wall_s": wall,
         "merged_from": [Path(p).name for p in paths],
         "repeat": sorted({run["repeat"] for run in runs}), "calls": runs[0]["calls"],
         "records": records}, indent=1))
    (out / f"{name}.md").write_text(table(records, commit, device, wall, merged=len(runs)))
    clean = sum(r["ok"] for r in records)
    print(f"gpu_conformance: merged {len(paths)} runs: {clean}/{len(records)} clean -> "
          f"{out / name}.md")
    return 0 if clean == len(records) else 1


def run_keys(todo: list[dict[str, Any]], given: Path | None = None
             ) -> dict[tuple[str, str], dict[str, str | None]]:
    """(file, world) -> the case's key (benchmarks/gpu_keys.py): the module `dcpc run`
    compiles for it (the same compile, here, once; or read from ``given``, keys computed
    beside the plans, where its tree digest is this tree's), the code parts."""
    from benchmarks.gpu_keys import case_id, code_keys, module_keys, tree_digest

    wanted = [(c["file"], c["world"]) for c in todo]
    code = code_keys(ROOT)
    modules: dict[str, str | None] = {}
    if given is not None and given.exists():
        got = json.loads(given.read_text())
        if got.get("tree") == tree_digest(ROOT) and all(got.get(p) == code[p] for p in code):
            modules = got.get("modules", {})
        else:
            print(f"gpu_conformance: {given} holds another tree's keys: compiling here",
                  flush=True)
    missing = [(f, w) for f, w in wanted if case_id(f, w) not in modules]
    modules.update(module_keys(ROOT, missing) if missing else {})
    return {(f, w): {"module": modules[case_id(f, w)], **code} for f, w in wanted}


def eval_world(world: str) -> int:
    n = 1
    for part in world.split("x"):
        n *= int(part)
    return n


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict[str, str | None]:
    """The torch and triton this run imports (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in ("torch", "triton"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    except ImportError:
        pass
    return "no GPU"


if __name__ == "__main__":
    sys.exit(main())
