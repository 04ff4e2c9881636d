"""benchmarks/gpu_pending.py: which GPU conformance cases a committed result settles.
A clean record settles its case only while neither the file nor the device code
changed since its commit; a failed record, an unknown commit or a change keeps it
pending with its reason, and the commands list exactly the pending cases."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_pending as gp

ROOT = Path(__file__).resolve().parents[2]
COPY, PULL = "schedules/ops/copy.yaml", "schedules/ops/pull.yaml"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"no git history here ({exc})")


def _results(tmp_path: Path, commit: str, records: list[tuple[str, str, bool]]) -> Path:
    (tmp_path / f"gpu_conformance_{commit[:7]}.json").write_text(json.dumps({
        "commit": commit, "records": [{"ok": ok, "case": {"file": f, "world": w}}
                                      for f, w, ok in records]}))
    return tmp_path


def _rows(results: Path) -> dict[tuple[str, str], dict]:
    return {(r["file"], r["world"]): r for r in gp.pending(results)}


def test_a_clean_record_at_head_settles_its_case_only(tmp_path: Path) -> None:
    if _git("status", "--porcelain", "--", COPY, *gp.DEVICE_PATHS):
        pytest.skip("this checkout has uncommitted device code (a clean clone runs it)")
    head = _git("rev-parse", "HEAD")
    rows = _rows(_results(tmp_path, head, [(COPY, "2", True), (PULL, "2", False)]))
    assert rows[(COPY, "2")]["settled"] == head and rows[(COPY, "2")]["why"] is None
    assert rows[(COPY, "4")]["why"] == "never ran clean on a GPU"
    assert rows[(PULL, "2")]["why"] == "never ran clean on a GPU"  # a failed run
    lines = gp.commands(list(rows.values()))
    assert not any(COPY in line and "--worlds 2," in line for line in lines)
    assert any(COPY in line and "--worlds 4,8 " in line for line in lines), lines


def test_a_change_since_the_run_or_an_unknown_commit_keeps_it_pending(tmp_path: Path) -> None:
    if _git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: its first commit is not the project's")
    first = _git("rev-list", "--max-parents=0", "HEAD").splitlines()[0]
    rows = _rows(_results(tmp_path, first, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["settled"] is None
    assert rows[(COPY, "2")]["why"] in (f"ran clean at {first}; the file changed since",
                                        f"ran clean at {first}; device code changed since")
    (tmp_path / "other").mkdir()
    rows = _rows(_results(tmp_path / "other", "0" * 40, [(COPY, "2", True)]))
    assert rows[(COPY, "2")]["why"] == f"ran clean at {'0' * 40}, a commit this clone does not have"


def test_the_shard_plans_run_every_pending_case_once_urgent_first() -> None:
    """plans(): every pending (file, world) in exactly one line of one shard; a file named
    first and a file that never ran open their shards with all their worlds; the others
    run at their smallest pending world before any second world."""
    rows = [{"file": f, "world": w, "settled": None if pend else "abc1234",
             "why": why if pend else None}
            for f, w, pend, why in [
                ("a.yaml", "2", True, "ran clean at x; the file changed since"),
                ("a.yaml", "4", True, "ran clean at x; the file changed since"),
                ("b.yaml", "2", True, "never ran clean on a GPU"),
                ("b.yaml", "8", True, "never ran clean on a GPU"),
                ("c.yaml", "2", False, None),
                ("c.yaml", "4", True, "ran clean at x; device code changed since"),
                ("d.yaml", "2x2", True, "ran clean at x; device code changed since"),
                ("d.yaml", "4x2", True, "ran clean at x; device code changed since"),
                ("e.yaml", "2", True, "ran clean at x; device code changed since")]]
    shards = gp.plans(rows, 2, first=["e.yaml"])
    got = [(f, w) for lines in shards for line in lines
           for w in line.split()[0].split(",") for f in line.split()[1:]]
    assert sorted(got) == sorted((r["file"], r["world"]) for r in rows if r["settled"] is None)
    assert shards == [["2,8 b.yaml", "2 a.yaml", "2x2 d.yaml", "4x2 d.yaml"],
                      ["2 e.yaml", "4 c.yaml", "4 a.yaml"]]
