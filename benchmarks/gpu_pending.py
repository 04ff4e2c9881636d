"""What has not run clean on a GPU since it last changed: the GPU conformance suite's
debt, read from the committed results and git.

A case (a schedule file at one world of the suite, benchmarks/gpu_conformance.py) is
settled by a clean record in some committed gpu_conformance_<commit>.json when what the
GPU run would execute now is what ran clean then: the same key (benchmarks/gpu_keys.py:
the sha256 of the module `dcpc run` compiles for the file at that world, and of the code
the run executes besides it: runtime, harness, reference, each an import closure within
dcpc), part by part, where a part may also be one that a reviewed entry of
RESULTS/gpu_equivalent.json pairs with it ({part: {"<sha now>": [["<sha then>",
"why: reviewed ..."]]}}: exact pairs of shas, so the next edit is pending again). A
record carries its key (gpu_conformance writes it); for an older one the key is
computed at its commit from git (`git archive`, that tree's own compiler), its module
keys read from RESULTS/gpu_keys.json or cached under build/gpu_keys (--update-cache
writes them into RESULTS/gpu_keys.json instead: a report rewrites no tracked file
unless asked). Where no key can be had (a commit this clone lacks, a tree that cannot
compile the file), the commit rule decides: neither the file nor the device paths
(templates and every file of the key's code parts, device_paths) changed since the
commit. Everything else is pending, with why ("module changed since <commit>",
"reference changed since <commit>", ...).

    python3 -m benchmarks.gpu_pending            # the table and the commands to run
    python3 -m benchmarks.gpu_pending --json     # the same as data (rule: key or commit)
    python3 -m benchmarks.gpu_pending --plans DIR [--shards 4] [--first FILE ...]
        # DIR/plan<i>.txt for benchmarks/conformance_shards.sh (one device call),
        # DIR/slow.txt: the cases that once took SLOW_S or more, a process of their own,
        # and DIR/keys.json: the cases' keys here, which gpu_conformance --keys reads there

Exit 0 either way (a report, not a gate): CI has no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from benchmarks.gpu_conformance import MESH_WORLDS, ROOT, cases, schedule_files
from benchmarks.gpu_keys import CODE_PARTS, case_id, code_files, code_keys, tree_digest
from dcpc.runtime.clock import wall_timeout

RESULTS = ROOT / "benchmarks" / "results"
KEYS_SCRIPT = Path(__file__).resolve().parent / "gpu_keys.py"
KEYS_FILE = "gpu_keys.json"  # beside the results: the module keys at their commits
EQUIVALENT_FILE = "gpu_equivalent.json"  # beside the results: reviewed pairs of shas
SLOW_S = 100.0  # a case whose newest recorded run took this long runs in slow.txt
PARTS = ("module", *CODE_PARTS)  # a key's parts (benchmarks/gpu_keys.py)
Key = dict[str, str]  # part -> sha256


def device_paths(root: Path = ROOT) -> tuple[str, ...]:
    """What the commit rule compares: the templates and every file of the key's code
    parts in ``root`` (gpu_keys.code_files: the runtime's, the harness's and the
    reference's import closures)."""
    return ("templates", *sorted({f for files in code_files(root).values() for f in files}))


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          timeout=60)


@cache
def _known(commit: str, root: Path = ROOT) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}", root=root).returncode == 0


@cache
def _changed(commit: str, paths: tuple[str, ...], root: Path = ROOT) -> bool:
    """Whether any of ``paths`` differs between ``commit`` and the working tree."""
    return _git("diff", "--quiet", commit, "--", *paths, root=root).returncode != 0


@cache
def _when(commit: str, root: Path = ROOT) -> int:
    """The commit's time (0: unknown), to try the newest clean run first."""
    out = _git("show", "-s", "--format=%ct", f"{commit}^{{commit}}", root=root).stdout
    return int(out.strip() or 0)


def clean_runs(results: Path = RESULTS) -> dict[tuple[str, str], list[tuple[str, Key | None]]]:
    """(file, world) -> (commit, the record's key or None) of each committed result where
    it ran clean."""
    out: dict[tuple[str, str], list[tuple[str, Key | None]]] = {}
    for path in sorted(results.glob("gpu_conformance_*.json")):
        data = json.loads(path.read_text())
        for r in data.get("records", []):
            case = r.get("case") or {}
            if r.get("ok") and case.get("file") and case.get("world"):
                runs = out.setdefault((case["file"], str(case["world"])), [])
                key = r.get("key") if isinstance(r.get("key"), dict) else None
                if all(c != data["commit"] or k != key for c, k in runs):
                    runs.append((data["commit"], key))
    return out


def case_seconds(results: Path = RESULTS, root: Path = ROOT) -> dict[tuple[str, str], float]:
    """(file, world) -> how long one run of it took on the GPU (a record's wall_s), as
    its newest committed record says (newest by commit time; a commit this clone lacks
    is the oldest)."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for path in sorted(results.glob("gpu_conformance_*.json")):
        data = json.loads(path.read_text())
        when = _when(data["commit"], root) if _known(data["commit"], root) else -1
        for r in data.get("records", []):
            case, took = r.get("case") or {}, r.get("wall_s")
            if case.get("file") and case.get("world") and isinstance(took, (int, float)):
                key = (case["file"], str(case["world"]))
                if when >= out.get(key, (-2, 0.0))[0]:
                    out[key] = (when, float(took))
    return {key: took for key, (_, took) in out.items()}


class KeysTimeout(RuntimeError):
    """benchmarks/gpu_keys.py ran out of time: no keys, and none cached."""


def compute_keys(tree: Path, wanted: list[tuple[str, str]]) -> dict[str, Any]:
    """benchmarks/gpu_keys.py run against ``tree`` (its own dcpc): {"runtime": sha,
    "harness": sha, "modules": {"file@world": sha | None}}; no module keys where that
    tree's dcpc cannot run the script (a tree older than dcpc.harness.run.compile_to).
    A run out of time is an error (KeysTimeout), never "no key": a key missing for that
    reason would be cached and keep the case on the commit rule for good. The limit is
    seconds of progress (dcpc.runtime.clock.wall_timeout), stretched on a loaded machine."""
    limit = wall_timeout(60 + 5 * len(wanted))
    try:
        done = subprocess.run([sys.executable, str(KEYS_SCRIPT), str(tree)],
                              input=json.dumps(wanted), capture_output=True, text=True,
                              timeout=limit)
        if done.returncode == 0:
            return json.loads(done.stdout)
    except subprocess.TimeoutExpired as exc:
        raise KeysTimeout(f"gpu_pending: computing {len(wanted)} module keys in {tree} took "
                          f"over {limit:.0f} s (benchmarks/gpu_keys.py); nothing was cached, "
                          "run it again on a less loaded machine") from exc
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return {**code_keys(tree), "modules": {case_id(f, w): None for f, w in wanted}}


def _unpack(commit: str, into: str, root: Path, *paths: str) -> None:
    archive = subprocess.run(["git", "archive", commit, *paths], cwd=root, timeout=120,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True, timeout=120)


def _stores(results: Path, root: Path) -> tuple[Path, Path]:
    """The module keys at commits: the tracked file beside the results, and the cache
    under root/build a report writes to."""
    return results / KEYS_FILE, root / "build" / "gpu_keys" / KEYS_FILE


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def commit_keys(commit: str, wanted: list[tuple[str, str]], results: Path,
                root: Path = ROOT, update_cache: bool = False) -> dict[str, Any]:
    """The keys of ``wanted`` at ``commit`` (None where not to be had): the code parts
    from its `git archive` of dcpc, the modules from RESULTS/gpu_keys.json, the build
    cache, or compiled in its whole `git archive` (then cached: under root/build, or in
    RESULTS/gpu_keys.json with ``update_cache``; a module's bytes at a commit never
    change)."""
    if not _known(commit, root):
        return {"modules": {}}
    tracked, cache = _stores(results, root)
    store = _read(tracked)
    modules = {**_read(cache).get(commit, {}), **store.get(commit, {})}
    missing = [(f, w) for f, w in wanted if case_id(f, w) not in modules]
    with tempfile.TemporaryDirectory(prefix="dcpc-keys-") as tmp:
        try:
            _unpack(commit, tmp, root, *(() if missing else ("dcpc",)))
        except (OSError, subprocess.SubprocessError):
            return {"modules": {}}  # no tree to be had at that commit: the commit rule
        if missing:
            modules.update(compute_keys(Path(tmp), missing)["modules"])
        path, saved = (tracked, store) if update_cache else (cache, _read(cache))
        now = {**saved.get(commit, {}), **{case_id(f, w): modules[case_id(f, w)]
                                           for f, w in wanted}}
        if now != saved.get(commit, {}):
            saved[commit] = dict(sorted(now.items()))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(sorted(saved.items())), indent=1) + "\n")
        return {**code_keys(Path(tmp)), "modules": modules}


def equivalent(results: Path = RESULTS) -> dict[str, dict[str, set[str]]]:
    """RESULTS/gpu_equivalent.json as part -> sha now -> the shas then a review judged
    to execute the same on a GPU."""
    data = _read(results / EQUIVALENT_FILE)
    return {part: {new: {old for old, _why in pairs} for new, pairs in by_new.items()}
            for part, by_new in data.items()}


def tree_keys(wanted: list[tuple[str, str]], root: Path = ROOT) -> dict[str, Any]:
    """The keys of ``wanted`` in ``root``'s working tree (and "tree": gpu_keys.tree_digest,
    what they were computed from): cached under root/build/gpu_keys by that digest."""
    tree = tree_digest(root)
    h = hashlib.sha256(json.dumps(sorted(wanted)).encode() + tree.encode())
    cached = root / "build" / "gpu_keys" / f"tree_{h.hexdigest()[:24]}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    got = {**compute_keys(root, wanted), "tree": tree}
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(got))
    return got


def _commit_rule(commit: str, file: str, root: Path) -> str | None:
    """Why the commit rule keeps a case pending (None: it settles it)."""
    if not _known(commit, root):
        return f"ran clean at {commit}, a commit this clone does not have"
    if _changed(commit, (file,), root):
        return f"ran clean at {commit}; the file changed since"
    if _changed(commit, device_paths(root), root):
        return f"ran clean at {commit}; device code changed since"
    return None


def pending(results: Path = RESULTS, root: Path = ROOT, files: list[str] | None = None,
            update_cache: bool = False) -> list[dict[str, Any]]:
    """Every case of the suite (of ``files`` only, if given) with ``settled`` (the commit
    of the clean run that settles it, or None), ``rule`` ("key": the same key, each part
    equal or a reviewed equivalent, ``equivalent`` naming those; "commit": nothing
    changed since, where no key could be had) and ``why`` (what keeps it pending: the
    newest clean run's reason)."""
    runs = clean_runs(results)
    same = equivalent(results)
    todo = [c for c in cases(schedule_files()) if files is None or c["file"] in files]
    now = tree_keys([(c["file"], c["world"]) for c in todo], root)
    at: dict[str, list[tuple[str, str]]] = {}
    for c in todo:
        for commit, key in runs.get((c["file"], c["world"]), []):
            if key is None:
                at.setdefault(commit, []).append((c["file"], c["world"]))
    then = {commit: commit_keys(commit, wanted, results, root, update_cache)
            for commit, wanted in at.items()}
    out = []
    for c in todo:
        cid = case_id(c["file"], c["world"])
        mine = {"module": now["modules"].get(cid), **{part: now[part] for part in CODE_PARTS}}
        settled = rule = None
        whys = []  # of each clean run, newest first: the newest one's is shown
        reviewed: list[str] = []
        for commit, key in sorted(runs.get((c["file"], c["world"]), []),
                                  key=lambda run: -_when(run[0], root)):
            if key is None and commit in then:
                key = {"module": then[commit]["modules"].get(cid),
                       **{part: then[commit].get(part) for part in CODE_PARTS}}
            if key and all(key.get(part) and mine[part] for part in PARTS):
                changed = [part for part in PARTS if key[part] != mine[part]]
                reviewed = [part for part in changed
                            if key[part] in same.get(part, {}).get(mine[part], ())]
                changed = [part for part in changed if part not in reviewed]
                if changed:
                    whys.append(f"{' and '.join(changed)} changed since {commit}")
                else:
                    settled, rule = commit, "key"
                    break
                continue
            found = _commit_rule(commit, c["file"], root)
            if found is None:
                settled, rule = commit, "commit"
                break
            whys.append(found)
        out.append({"file": c["file"], "world": c["world"], "settled": settled, "rule": rule,
                    "equivalent": reviewed if rule == "key" else [],
                    "why": None if settled else (whys or ["never ran clean on a GPU"])[0]})
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


def plans(rows: list[dict[str, Any]], shards: int, first: list[str],
          slow: frozenset[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """The pending cases as ``shards`` lists of lines "WORLDS FILE ...", each line one
    gpu_conformance run: in each shard the files named in ``first`` and those that never
    ran clean come first (all their pending worlds), then every other file at its smallest
    pending world (a small world runs fast: breadth before depth), then the rest. The
    ``slow`` cases are left out: ``slow_plan`` runs them."""
    worlds: dict[str, list[str]] = {}
    never: set[str] = set()
    for r in rows:
        if r["settled"] is None and (r["file"], r["world"]) not in slow:
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


def slow_plan(rows: list[dict[str, Any]], slow: dict[tuple[str, str], float],
              first: list[str] = ()) -> list[str]:
    """The pending ``slow`` cases (case -> seconds its newest run took) as lines "WORLDS
    FILE ...": the files of the same slow worlds on one line (gpu_conformance runs
    SLOW_JOBS of a line's cases at once), the lines with a file named in ``first`` first,
    then the longest first. conformance_shards.sh runs them beside the shards, with long
    rank timeouts (an 8-rank mesh that shares the GPU with the shards is slow, not hung:
    session 28's deepep_normal 2x4)."""
    worlds: dict[str, list[str]] = {}
    for r in rows:
        if r["settled"] is None and (r["file"], r["world"]) in slow:
            worlds.setdefault(r["file"], []).append(r["world"])
    lines: dict[str, list[str]] = {}
    for file in worlds:
        lines.setdefault(",".join(worlds[file]), []).append(file)

    def order(item: tuple[str, list[str]]) -> tuple[bool, float]:
        ws, files = item
        return (not any(f in first for f in files),
                -max(slow[(f, w)] for f in files for w in ws.split(",")))

    return [f"{ws} {' '.join(files)}" for ws, files in sorted(lines.items(), key=order)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="the folder of gpu_conformance_*.json (default: the committed)")
    ap.add_argument("--json", action="store_true", help="print the cases as JSON")
    ap.add_argument("--update-cache", action="store_true",
                    help=f"write module keys computed at commits into RESULTS/{KEYS_FILE} "
                         "(default: a cache under build/gpu_keys)")
    ap.add_argument("--plans", type=Path, default=None, metavar="DIR",
                    help="write DIR/plan<i>.txt for benchmarks/conformance_shards.sh and "
                         "DIR/keys.json (gpu_conformance --keys)")
    ap.add_argument("--shards", type=int, default=4, help="processes side by side (4)")
    ap.add_argument("--first", nargs="+", default=[], metavar="FILE",
                    help="schedule files to run first, every pending world")
    args = ap.parse_args(argv)
    try:
        rows = pending(args.results, update_cache=args.update_cache)
    except KeysTimeout as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.plans is not None:
        args.plans.mkdir(parents=True, exist_ok=True)
        took = case_seconds(args.results)
        slow = {c: s for c, s in took.items() if s >= SLOW_S}
        for i, lines in enumerate(plans(rows, args.shards, args.first, frozenset(slow)), 1):
            (args.plans / f"plan{i}.txt").write_text("".join(f"{x}\n" for x in lines))
        slow_lines = slow_plan(rows, slow, args.first)
        (args.plans / "slow.txt").write_text("".join(f"{x}\n" for x in slow_lines))
        (args.plans / "keys.json").write_text(json.dumps(tree_keys(
            [(r["file"], r["world"]) for r in rows if r["settled"] is None])))
        print(f"{sum(r['settled'] is None for r in rows)} pending cases in {args.shards} "
              f"plans under {args.plans}, their keys in {args.plans / 'keys.json'}")
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    left = [r for r in rows if r["settled"] is None]
    by = {rule: sum(r["rule"] == rule for r in rows) for rule in ("key", "commit")}
    reviewed = {part: sum(part in r["equivalent"] for r in rows) for part in PARTS}
    print(f"{len(rows) - len(left)} of {len(rows)} GPU conformance cases settled ("
          f"{by['key']} by key: the same {', '.join(PARTS)} as a clean run"
          + "".join(f"; {n} of them with the {part} of a reviewed pair ({EQUIVALENT_FILE})"
                    for part, n in reviewed.items() if n)
          + f"; {by['commit']} by commit: neither the file nor the device paths changed "
            f"since, where no key could be had); {len(left)} pending")
    for r in left:
        print(f"  {r['file']} at {r['world']}: {r['why']}")
    if left:
        print("to run them:")
        for line in commands(rows):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
