"""The lower and emit stages: every shipped schedule compiles to a ruff-clean,
deterministic module that imports without the compiler's dependencies; free text
cannot escape its string; every op has one rule and one template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.kernels import ROOT, SCHEDULES, load
from support.ruff import RUFF, RUFF_CONFIG

from dcpc import __version__
from dcpc.codegen.emit import emit
from dcpc.codegen.lower import lower
from dcpc.codegen.templates import template_dir
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.model import OP_NAMES
from dcpc.lang.parse import parse_file, parse_text
from dcpc.ops import OPS

SHIPPED = sorted(SCHEDULES.glob("*.yaml"))


def compile_path(path: Path) -> str:
    return emit(lower(parse_file(path), range(2, 9)))


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gen")
    files = {}
    for path in SHIPPED:
        target = out / f"{path.stem}.py"
        target.write_text(compile_path(path))
        files[path.stem] = target
    return files


def test_every_shipped_schedule_compiles(generated):
    assert set(generated) == {p.stem for p in SHIPPED} and len(generated) >= 5


def test_generated_modules_are_ruff_clean(generated):
    files = [str(p) for p in generated.values()]
    check = subprocess.run(
        RUFF + ["check", "--no-cache", *RUFF_CONFIG, *files], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        RUFF + ["format", "--no-cache", "--check", "--diff", *RUFF_CONFIG, *files],
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_compile_is_deterministic(path):
    first, second = compile_path(path), compile_path(path)
    assert first == second
    assert json.loads(lower(parse_file(path), [2, 3]).to_json())["schedule"] == path.stem


def test_header_states_version_hash_worlds_and_contract(generated):
    text = generated["kimi_k3_dcp"].read_text()
    sha = parse_file(SCHEDULES / "kimi_k3_dcp.yaml").source_sha256
    assert f"# dcpc {__version__}" in text
    assert f"# source sha256 {sha}" in text and len(sha) == 64
    assert "# checked for W in 2..8" in text
    header = " ".join(line.strip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "query_gather() -> [attention] -> out_exchange() -> merge()" in header
    assert "call i uses slot=i % 2" in header
    assert "timestamp" not in text.lower()


def test_module_imports_without_compiler_dependencies(generated):
    """pydantic, networkx, jinja2 and yaml are blocked; the module imports and runs."""
    script = f"""
import importlib.abc, os, sys
os.environ["TRITON_INTERPRET"] = "1"
BLOCKED = ("pydantic", "networkx", "jinja2", "yaml", "dcpc.lang", "dcpc.codegen", "dcpc.check")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith(BLOCKED):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
sys.path.insert(0, {str(generated["kv_gather"].parent)!r})
import torch, kv_gather
m = kv_gather.KvGather(None, sizes={{"N": 8}}, programs=2)
kv = torch.randn(5, 576).to(torch.bfloat16)
assert torch.equal(m.kv_gather(kv), kv)
m.release()
m.close()
print("imported", sorted(k for k in sys.modules if k.startswith(BLOCKED)))
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "imported []" in run.stdout


EVIL_DOC = (
    'He said "hi" \\ and \'\'\'x\'\'\' """\nimport os; os._exit(3)\n""" {{ plan }} {% if x %}\x07'
)


def test_free_text_cannot_escape_the_docstring(tmp_path):
    text = (SCHEDULES / "kv_gather.yaml").read_text()
    schedule = parse_text(text, "kv.yaml")
    schedule.doc = EVIL_DOC
    schedule.steps[0]["kv_gather"].doc = EVIL_DOC
    source = emit(lower(schedule, [2]))
    compile(source, "evil.py", "exec")
    path = tmp_path / "kv_gather.py"
    path.write_text(source)
    module = load(path)
    doc = " ".join(module.__doc__.split())
    assert 'He said "hi" \\ and \'\'\'x\'\'\' """ import os; os._exit(3) """' in doc
    assert "{{ plan }} {% if x %}" in doc
    method_doc = " ".join(module.KvGather.kv_gather.__doc__.split())
    assert '""" import os; os._exit(3) """' in method_doc


def test_every_op_has_one_rule_and_one_template():
    assert all(callable(OPS[op].lower) for op in OP_NAMES)  # OpDef.lower, in its module
    for op in OP_NAMES:
        if op != "external":
            assert (template_dir() / "ops" / f"{op}.py.j2").is_file(), op
    assert template_dir() == ROOT / "templates"


def test_reserved_step_names_are_diagnostics():
    text = (SCHEDULES / "kv_gather.yaml").read_text().replace("  - release:", "  - close:")
    with pytest.raises(DiagnosticError) as err:
        lower(parse_text(text, "kv.yaml"), [2])
    (diag,) = err.value.diagnostics
    assert diag.code == "reserved-name" and "close" in diag.message
    assert diag.mark.file == "kv.yaml" and diag.mark.line > 0


def test_epochs_advance_by_one_scalar_atomic(generated):
    """A GPU-only invariant the interpreter cannot exercise (it runs a program's block at
    once): every warp of a program must agree on its epoch, so the counter is advanced by
    one scalar atomic whose result is broadcast, never by a load and a store that warps
    execute at different times (that race desynchronised ranks and hung two-stream runs
    on 2xH200)."""
    library = (ROOT / "dcpc" / "runtime" / "device.py").read_text()
    start = library.index("def _dcpc_advance_epoch(")
    body = library[start : library.index("\n\n\n", start)]
    assert "tl.atomic_add(counter, 1" in body
    assert "tl.store(" not in body and "tl.load(" not in body
    for name, path in generated.items():  # every module calls the library's, none its own
        text = path.read_text()
        assert "def _dcpc_advance_epoch(" not in text, name
        assert "_dcpc_advance_epoch(epochs, channel, sig_programs)" in text, name


def _fused_with_via_reader() -> str:
    """The fused schedule plus an engine step that reads the exchange's via buffers."""
    text = (SCHEDULES / "kimi_k3_dcp_fused.yaml").read_text()
    return text + "  - inspect:      {op: external, reads: [o_recv, lse_recv]}\n"


def test_fused_exchange_skips_its_own_part_unless_via_is_read(generated):
    """The fused op reads this rank's own part from src (no copy into via[rank]) only
    when no other step reads via; a reader of via gets the full exchange."""
    shipped = generated["kimi_k3_dcp_fused"].read_text()
    assert "FROM_SRC=self.rank," in shipped
    plan = lower(parse_text(_fused_with_via_reader(), "fused_via_read.yaml"), range(2, 9))
    combine = next(s for s in plan.steps if s.name == "combine")
    assert combine.attrs["self_copy"] is True
    assert "FROM_SRC=-1," in emit(plan)


GALLERY = sorted((ROOT / "schedules" / "gallery").glob("*.yaml"))


def test_gallery_modules_are_ruff_clean(tmp_path: Path) -> None:
    """Every gallery layout's module checks and formats clean too (a schedule with a mesh
    at 2x2, a loop naming W at W=4): the device library holds the helpers, the emitted
    code wraps its long unpackings and stride lists."""
    from dcpc import pipeline
    from dcpc.lang.mesh import MeshWorld

    files = []
    for path in GALLERY:
        world = MeshWorld([2, 2]) if "\nmesh:" in path.read_text() else 4
        c = pipeline.run(path, pipeline.Options(worlds=[world]), until="emit")
        files.append(tmp_path / f"{path.stem}.py")
        files[-1].write_text(c.module_text)
    for args in (["check"], ["format", "--check", "--diff"]):
        done = subprocess.run(RUFF + [*args, "--no-cache", *RUFF_CONFIG, *map(str, files)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_seed_schedule_module_keeps_only_what_is_its_own(generated) -> None:
    """The signal/wait protocol and the merge live once, in dcpc/runtime/device.py: the
    seed's module is its kernels, its class and its tables (it was 1,573 lines with every
    helper copied in)."""
    lines = generated["kimi_k3_dcp"].read_text().count("\n")
    assert lines < 900, lines


def test_a_long_wait_step_name_over_a_team_stays_ruff_clean(tmp_path: Path) -> None:
    """A team wait's torch body named the step twice on one line: a name past 13
    characters made a line over 100 (the gallery's double_ring had to shorten its names)."""
    from dcpc import pipeline
    from dcpc.lang.mesh import MeshWorld

    name = "all_peers_in_this_node_have_read_it"
    text = (ROOT / "schedules" / "ops" / "sync_axis.yaml").read_text()
    assert "  - all_read:  {op: wait" in text
    path = tmp_path / "sync_axis.yaml"
    path.write_text(text.replace("  - all_read:  {op: wait", f"  - {name}: {{op: wait"))
    c = pipeline.run(path, pipeline.Options(worlds=[MeshWorld([2, 2])]), until="emit")
    assert f'_team_comm("{name}", slot)' in c.module_text
    (tmp_path / "sync_axis.py").write_text(c.module_text)
    for args in (["check"], ["format", "--check", "--diff"]):
        done = subprocess.run(RUFF + [*args, "--no-cache", *RUFF_CONFIG,
                                      str(tmp_path / "sync_axis.py")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
