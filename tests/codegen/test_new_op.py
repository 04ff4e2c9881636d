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

import pytest
from support.ruff import RUFF, RUFF_CONFIG
from support.schedules import GATHER_NO_BARRIER

ROOT = Path(__file__).resolve().parents[2]

# the gather of tests/support/schedules.py, its copy the new op, with a barrier at the end:
# without it rank 1's next call pushes into rank 0's g before rank 0's gather returns it
# (a race `dcpc check` names as the engine's read of what the gather returned;
# tests/run/test_run_replay.py replays it)
SCHEDULE = (GATHER_NO_BARRIER.replace("gather_no_barrier", "echo_probe")
            .replace("op: copy", "op: echo") + "  - release: {op: barrier}\n")


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


BEAM = """\
schedule: beam_probe
slots: 2
sizes:
  T: {max: 8}
  D: 16
buffers:
  x: {shape: [T, D], dtype: bf16}
  y: {shape: [T, D], dtype: bf16, symmetric: true}
  k: {shape: [T, 2, D], dtype: fp8e4m3}
  z: {shape: [T, 2, D], dtype: fp8e4m3, symmetric: true}
  out: {shape: [T, D], dtype: f32}
steps:
  - from_one: {op: beam, src: x, dst: y, root: 1}
  - from_zero: {op: beam, src: k, dst: z}
  - use: {op: external, reads: [y, z], writes: [out]}
  - release: {op: barrier}
"""

# the new op's own torch body (no collective of dcpc/runtime/collectives.py is edited)
BEAM_TORCH = '''

def torch_body(comm: TorchComm, src: torch.Tensor, dst: torch.Tensor, root: int,
               world: int) -> None:
    """Rank ``root``'s src lands in every rank's dst (one torch.distributed broadcast)."""
    import torch.distributed as dist  # copied into the generated module, which runs it

    if root >= world:
        comm.refuse(f"beam: root {root} is not a rank of a group of {world}")
    if comm.rank == root:
        dst.copy_(src)
    if world > 1 and dst.numel():
        root_rank = dist.get_global_rank(comm.group, root)
        work = dist.broadcast(comm.wire(dst), src=root_rank, group=comm.group, async_op=True)
        comm.wait(work, "beam")


'''


def _tree_with_beam(tmp: Path) -> Path:
    """The checkout's dcpc/ and templates/ with one more communication op, 'beam'
    (broadcast's meaning and kernel), whose torch backend is its own body
    (``OpDef.torch``), not broadcast's collective."""
    shutil.copytree(ROOT / "dcpc", tmp / "dcpc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "templates", tmp / "templates")
    text = (ROOT / "dcpc/ops/broadcast.py").read_text()
    text = re.sub(r"\bBroadcast\b", "Beam", text).replace('"broadcast"', '"beam"')
    text = text.replace("    from dcpc.ops.iface import LowerRules, ShapeRules, SimView\n",
                        "    import torch\n\n    from dcpc.ops.iface import LowerRules, ShapeRules,"
                        " SimView, TorchComm\n")
    assert "exact=True))" in text and "\nDEF = define(" in text
    text = text.replace("\nDEF = define(", BEAM_TORCH + "DEF = define(").replace(
        "exact=True))", "exact=True, torch=torch_body))")
    (tmp / "dcpc/ops/beam.py").write_text(text)
    template = (ROOT / "templates/ops/broadcast.py.j2").read_text()
    assert template.count("_rt.collectives.broadcast(") == 1
    (tmp / "templates/ops/beam.py.j2").write_text(
        template.replace("_rt.collectives.broadcast(", "_beam_torch("))
    return tmp


def test_a_communication_op_registers_its_own_torch_body(tmp_path: Path) -> None:
    """Issue 32: a communication op whose torch body is no existing collective registers
    it in its module (``OpDef.torch``); the emitter copies it into the generated module
    (which imports only dcpc.runtime), and it runs on gloo against float64, bit for bit."""
    tree = _tree_with_beam(tmp_path / "tree")
    before = {p.relative_to(ROOT).as_posix() for p in (ROOT / "dcpc").rglob("*.py")}
    after = {p.relative_to(tree).as_posix() for p in (tree / "dcpc").rglob("*.py")}
    assert after - before == {"dcpc/ops/beam.py"}  # no other file of the package changed
    schedule = tmp_path / "beam.yaml"
    schedule.write_text(BEAM)

    out = tmp_path / "out"
    compiled = _dcpc(tree, "compile", str(schedule), "--world", "2..4", "-o", str(out))
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    module = (out / "beam_probe.py").read_text()
    assert module.count("\ndef _beam_torch(comm, src, dst, root, world):\n") == 1, module
    assert "_rt.collectives.broadcast" not in module and "import torch.distributed" in module
    assert "from dcpc import runtime as _rt" in module and "dcpc.ops" not in module
    body = tmp_path / "body.py"  # the copied body as ruff-format writes it
    body.write_text(module[module.index("def _beam_torch("):module.index("\n\n\nclass ")] + "\n")
    for args in (["check", str(out / "beam_probe.py")], ["format", "--check", "--diff", str(body)]):
        lint = subprocess.run(RUFF + [args[0], "--no-cache", *RUFF_CONFIG, *args[1:]],
                              capture_output=True, text=True, timeout=120)
        assert lint.returncode == 0, lint.stdout + lint.stderr
    for world in ("2", "3", "4"):
        ran = _dcpc(tree, "run", str(schedule), "--world", world, "--backend", "torch",
                    "--calls", "3")
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert "result     OK: every output matches (0 mismatches)" in ran.stdout, ran.stdout
        compared = 3 * int(world)  # every call on every rank, none off
        assert re.search(rf"^  y +{compared} +0 +0$", ran.stdout, re.M), ran.stdout


def _long_body(comm, src, dst, root=0, scales=(1, 2), *, world, label="a long keyword"):
    """A body with defaults and keyword-only parameters."""
    return None


def test_a_torch_body_is_copied_with_its_parameters_and_without_annotations() -> None:
    """``torch_source`` writes the def under the module's name, parameters as written
    (defaults, keyword-only), annotations dropped, one parameter a line past 100
    columns; a decorated body is refused (its decorator would not be copied)."""
    import functools

    from dcpc.codegen.emit import torch_source

    text = torch_source(_long_body, "_probe_long_name_of_an_op_torch")
    assert text.splitlines()[:10] == [
        "def _probe_long_name_of_an_op_torch(", "    comm,", "    src,", "    dst,",
        "    root=0,", "    scales=(1, 2),", "    *,", "    world,",
        '    label="a long keyword",', "):"]
    assert text.splitlines()[10:] == [
        '    """A body with defaults and keyword-only parameters."""', "    return None"]

    def short(comm: object, src: object) -> None:
        comm.wait(src, "x")  # type: ignore[attr-defined]

    assert torch_source(short, "_s_torch").splitlines() == [
        "def _s_torch(comm, src):", '    comm.wait(src, "x")  # type: ignore[attr-defined]']

    @functools.cache
    def decorated(comm: object) -> None:
        return None

    with pytest.raises(ValueError, match="plain def"):
        torch_source(decorated.__wrapped__, "_d_torch")


def _rows_of(rows: int, world: int) -> list[tuple[int, int]]:
    """A helper of a (test) op module, which a torch body may not call by this name."""
    return [(0, rows)] * world


def _body_calling_a_helper(comm, src, dst, stage, outer, rows, prows, row_len, world,
                           reduce):
    """pull's split forms, calling a helper of its module that is not in torch_uses."""
    return _rows_of(rows, world)


def test_a_torch_body_that_calls_a_module_helper_is_refused_at_emit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An op's torch body is copied into the module as text: a helper of its op module
    that it calls (not listed in ``OpDef.torch_uses``) is not there, and the module would
    compile and fail only on the torch backend (NameError). Emit refuses it, naming the
    op and the name (the real body calls pull's parts by its copy's name, _pull_parts,
    which torch_uses puts in the module: it emits)."""
    import dataclasses

    from dcpc.codegen.emit import emit
    from dcpc.codegen.lower import lower
    from dcpc.lang.parse import parse_file
    from dcpc.ops import OPS

    plan = lower(parse_file(ROOT / "schedules/ops/pull_split.yaml"), range(2, 5))
    text = emit(plan)  # the real body: every name it uses is there
    assert "def _pull_torch(" in text and "\ndef _pull_parts(" in text
    monkeypatch.setitem(OPS, "pull", dataclasses.replace(OPS["pull"],
                                                         torch=_body_calling_a_helper))
    with pytest.raises(ValueError, match=r"^op 'pull': its torch function _pull_torch "
                       r"\(copied into the module\) uses '_rows_of', which the emitted "
                       r"module does not define"):
        emit(plan)
