"""Each op is one definition (dcpc/ops/), and every stage reads that one.

Which keys of a step name buffers (and whether the step reads or writes them) is
dcpc.lang.nodes.BUFFER_KEYS, which the checker's reference and aliasing rules read; an
op whose model has a buffer field not listed there is refused when it is defined."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import Field

from dcpc.check import ops as check_ops
from dcpc.harness import synth
from dcpc.lang import model, semantics
from dcpc.lang.nodes import BUFFER_KEYS, Name, OpBase
from dcpc.lang.parse import parse_text
from dcpc.ops import OP_NAMES, OPS
from dcpc.ops.registry import OpDef, buffer_fields, define

ROOT = Path(__file__).resolve().parents[2]


def test_every_op_is_one_registered_definition():
    assert OP_NAMES == model.OP_NAMES == tuple(OPS)
    for name, op in OPS.items():
        assert op.model.model_fields["op"].annotation == typing.Literal[name]
        assert op.model.__module__.startswith("dcpc.ops."), name
        assert (ROOT / "dcpc/ops" / f"{op.model.__module__.rsplit('.', 1)[1]}.py").is_file()
        # the Triton rule is the op's too: in its module, read by the lowering from OPS
        assert callable(op.lower) and op.lower.__module__ == op.model.__module__, name
        assert getattr(model, op.model.__name__) is op.model  # the public name stays
        assert semantics.RULES[name] is op.semantics
        assert check_ops.RULES.get(name) is op.verify
        if name != "external":
            assert (ROOT / "templates" / "ops" / f"{name}.py.j2").is_file(), name


def test_the_union_parses_each_op_into_its_registered_class():
    text = """
schedule: every_op
buffers:
  x: {shape: [4], dtype: f32, symmetric: true}
  y: {shape: [4], dtype: f32, symmetric: true}
steps:
  - a: {op: copy, src: x, dst: y}
  - b: {op: barrier}
  - c: {op: signal, channel: k}
  - d: {op: wait, channel: k}
  - e: {op: external, reads: [y], writes: [x]}
"""
    steps = parse_text(text, "every_op.yaml").step_list()
    assert [type(s.op) for s in steps] == [OPS[s.kind].model for s in steps]
    assert [s.kind for s in steps] == ["copy", "barrier", "signal", "wait", "external"]
    # the simulator and the synthetic inputs go through the same entries
    assert synth.op_io(steps[0].op) == (["x"], ["y"])
    assert synth.op_io(steps[4].op) == (["y"], ["x"])
    assert synth.op_io(steps[1].op) == ([], [])


def test_the_compiler_imports_no_torch():
    """The op modules import torch only inside their float64 reference."""
    script = (
        "import sys\n"
        "from dcpc import pipeline\n"
        "pipeline.run('schedules/kimi_k3_dcp.yaml', pipeline.Options(worlds=(2, 3)))\n"
        "print(sorted(k for k in ('torch', 'triton') if k in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]"


def test_every_op_s_buffer_fields_are_listed_once() -> None:
    seen = {f for op in OPS.values() for f in buffer_fields(op.model)}
    assert seen == set(BUFFER_KEYS)  # no listed key without an op, none missing
    assert set(BUFFER_KEYS.values()) == {"read", "write"}
    assert buffer_fields(OPS["signal"].model) == []  # a channel is not a buffer


def test_an_op_with_an_unlisted_buffer_key_is_refused() -> None:
    class Odd(OpBase):
        src: Name
        dst: Name
        scratch: Name | list[Name] = Field(default="x")

    ref = OPS["copy"]
    odd = OpDef("odd_copy", Odd, ref.semantics, ref.verify, ref.reference, ref.io, ref.lower)
    with pytest.raises(ValueError, match=r"'odd_copy'.*\['scratch'\].*BUFFER_KEYS"):
        define(odd)
    assert "odd_copy" not in OPS


def test_the_checker_reads_and_writes_by_the_table() -> None:
    from dcpc.check.ops import READ_KEYS, WRITTEN_KEYS

    assert set(READ_KEYS) | set(WRITTEN_KEYS) == set(BUFFER_KEYS)
    assert not set(READ_KEYS) & set(WRITTEN_KEYS)
    assert {"dst", "via", "return_lse", "recv_counts"} <= set(WRITTEN_KEYS)
    assert {"src", "counts", "index", "output_scale"} <= set(READ_KEYS)


def _names_of_ops(path: Path) -> tuple[list[str], list[str]]:
    """The op names (outside docstrings) and the op-specific fields (``<x>.op.<field>``,
    ``getattr(<x>.op, "<field>")``) a file's syntax tree holds. Allowed: the engine step
    (``external``, which the harness stands in for: its ``reads``/``writes`` and the
    ``rows`` of them chosen by an index's values) and a move's src/dst (every move's)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef) and node.body
            and isinstance(node.body[0], ast.Expr)}
    named = sorted({node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and id(node) not in docs
                    and node.value in OPS and node.value != "external"})
    generic = {"op", "src", "dst", "reads", "writes", "rows"}

    def on_op(node: ast.AST) -> bool:  # ``<anything>.op``
        return isinstance(node, ast.Attribute) and node.attr == "op"

    fields = sorted({node.attr for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and on_op(node.value)
                     and node.attr not in generic}
                    | {node.args[1].value for node in ast.walk(tree)
                       if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                       and node.func.id == "getattr" and len(node.args) >= 2
                       and on_op(node.args[0]) and isinstance(node.args[1], ast.Constant)
                       and node.args[1].value not in generic})
    return named, fields


def test_the_harness_names_no_op() -> None:
    """Issue 32: an op's rules for ``dcpc run`` are its module's: its synthetic inputs
    (``OpDef.inputs``: counts within their capacity, index rows that exist, fp8 scales,
    the request mask) and what of its outputs is compared (``OpDef.outputs``: a ragged
    exchange's unsent rows); every file of dcpc/harness/ asks the registry. Before,
    synth.py named ragged_all_to_all and weighted_combine and read their fields (counts,
    capacity, index, src) and any op's mask_empty, output_scale and scale; worker.py
    named ragged_all_to_all and read its dst and scale to find the unsent rows."""
    files = sorted((ROOT / "dcpc" / "harness").glob("*.py"))
    assert ROOT / "dcpc/harness/synth.py" in files and ROOT / "dcpc/harness/worker.py" in files
    found = {p.name: _names_of_ops(p) for p in files}
    assert {k: v for k, v in found.items() if v != ([], [])} == {}


def test_every_scale_and_mask_of_the_conformance_schedules_has_its_input_rule() -> None:
    """The keys several ops share get their rule from the op's ``OpDef.inputs`` (no longer
    from synth reading any op's fields): on every schedules/ops/ record, each
    ``output_scale`` and ``per: tensor`` cast scale is a ``TensorScale``, each
    ``mask_empty`` buffer the ``Requests`` mask over dst's rows, each ragged move's
    counts ``Counts`` of its capacity (its index a ``Placement`` in it), each weighted
    combine's index a ``RowIndex``."""
    from dcpc.lang.parse import parse_file
    from dcpc.ops import iface

    seen: set[str] = set()
    for path in sorted((ROOT / "schedules/ops").glob("*.yaml")):
        if "_axis" in path.name:
            continue  # a mesh's record: the same ops
        schedule = parse_file(path, world=2)
        for step, rules in zip(schedule.step_list(), synth.input_rules(schedule), strict=True):
            op = step.op
            want: dict[str, object] = {}
            if getattr(op, "output_scale", None):  # it scales into dst (its fp8 range)
                want[op.output_scale] = iface.TensorScale((op.dst,))
            scale = getattr(op, "scale", None)
            if scale is not None and scale.per == "tensor":  # between the cast payload's
                src, dst = (op.src, op.dst) if isinstance(op.src, str) else (op.src[0], op.dst[0])
                want[scale.buffer] = iface.TensorScale((src, dst))
            mask = getattr(op, "mask_empty", None)
            if mask is not None:
                want[mask.lengths] = want[mask.query_start_loc] = iface.Requests(mask, op.dst)
            if step.kind == "ragged_all_to_all":
                want[op.counts] = iface.Counts(str(op.capacity))
                if op.index:  # the rows each row lands at: distinct, within a slot
                    want[op.index] = iface.Placement(str(op.capacity))
            if step.kind == "weighted_combine" and op.index:
                want[op.index] = iface.RowIndex(op.src[0])
            assert rules == want, (path.name, step.name)
            seen.update(type(r).__name__ for r in want.values())
    assert seen == {"TensorScale", "Requests", "Counts", "RowIndex", "Placement"}
