"""Adding an op touches its own files only: a copy of the package gains an op module and
its template, nothing else, and the new op is parsed, checked, compiled and run against
float64 (the house recipe of docs/internals.md, held by running it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCHEDULE = """\
schedule: echo_probe
slots: 1
sizes:
  T: {max: 8}
  D: 16
buffers:
  x: {shape: [T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32}
  g: {shape: [T, W * D], dtype: f32, symmetric: true}
steps:
  - keep: {op: echo, src: x, dst: y}
  - gather: {op: all_gather, src: y, dst: g, dim: 1}
"""


def _tree_with_echo(tmp: Path) -> Path:
    """The checkout's dcpc/ and templates/ with one more op, 'echo' (copy's meaning)."""
    shutil.copytree(ROOT / "dcpc", tmp / "dcpc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "templates", tmp / "templates")
    text = (ROOT / "dcpc/ops/copy.py").read_text()
    text = re.sub(r"\bCopy\b", "Echo", text).replace('"copy"', '"echo"')
    (tmp / "dcpc/ops/echo.py").write_text(text)
    shutil.copy(ROOT / "templates/ops/copy.py.j2", tmp / "templates/ops/echo.py.j2")
    return tmp


def _dcpc(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-m", "dcpc", *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)


def test_an_op_module_and_its_template_are_all_a_new_op_needs(tmp_path: Path) -> None:
    tree = _tree_with_echo(tmp_path / "tree")
    before = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dcpc").rglob("*.py")}
    after = {p.relative_to(tree).as_posix() for p in (tree / "dcpc").rglob("*.py")}
    assert after - before == {"dcpc/ops/echo.py"}  # no other file of the package changed
    schedule = tmp_path / "echo.yaml"
    schedule.write_text(SCHEDULE)

    checked = _dcpc(tree, "check", str(schedule), "--world", "2..3")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ran = _dcpc(tree, "run", str(schedule), "--world", "2", "--calls", "2")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "result     OK: every output matches (0 mismatches)" in ran.stdout, ran.stdout
    assert re.search(r"^  y +4 +0 +0$", ran.stdout, re.M), ran.stdout  # the echo's output

    # the op is the language's: an unknown key of it is a located error, as for any op
    schedule.write_text(SCHEDULE.replace("dst: y}", "dst: y, bogus: 1}", 1))
    bad = _dcpc(tree, "check", str(schedule), "--world", "2")
    said = bad.stdout + bad.stderr
    assert bad.returncode == 1 and "echo.yaml:11:38: error: unknown key 'bogus'" in said, said
