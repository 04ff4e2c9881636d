"""Each op is one definition (dcpc/ops/), and every stage reads that one."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from dcpc.check import ops as check_ops
from dcpc.codegen.lower import LOWERINGS
from dcpc.harness import synth
from dcpc.lang import model, semantics
from dcpc.lang.parse import parse_text
from dcpc.ops import MODULES, OP_NAMES, OPS

ROOT = Path(__file__).resolve().parents[1]


def test_every_op_is_one_registered_definition():
    assert OP_NAMES == model.OP_NAMES == tuple(OPS)
    assert set(OP_NAMES) == set(LOWERINGS)
    for name, op in OPS.items():
        assert op.model.model_fields["op"].annotation == typing.Literal[name]
        assert op.model.__module__.startswith("dcpc.ops."), name
        assert op.model.__module__.rsplit(".", 1)[1] in MODULES, name
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
