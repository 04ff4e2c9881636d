"""The op registry: one ``OpDef`` per op, keyed by the op's name.

Every stage reads an op through its entry: the model's discriminated union
(dcpc.lang.model), the effects and sync (dcpc.lang.semantics), the shape and dtype
verifier (dcpc.check.ops), the float64 reference (dcpc.harness.simulate) and what a
step reads and writes for synthetic inputs (dcpc.harness.synth). The lowerings are
registered against the same name: the Triton rule in dcpc/codegen/rules.py with its
template templates/ops/<name>.py.j2, the torch backend in dcpc/runtime/collectives.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dcpc.lang.nodes import OpBase, Step
    from dcpc.ops.common import Scope, Semantics
    from dcpc.ops.iface import ShapeRules, SimView

IO = tuple[list[str], list[str]]


@dataclass(frozen=True)
class OpDef:
    """Everything an op means, in one record.

    ``semantics(scope, step)``: its buffer effects and signal slots.
    ``verify(v, step)``: its shape, dtype and base rules (``v``: the ``ShapeRules`` of
    dcpc.ops.iface, which the check stage's ``dcpc.check.ops.Verify`` implements); None
    for an op with nothing to check beyond its names.
    ``reference(sim, step)``: what it does to every rank's buffers in float64 (``sim``:
    the ``SimView`` of dcpc.ops.iface, which ``dcpc.harness.simulate.Sim`` implements).
    ``io(op)``: (buffers it reads, buffers it writes), in the order the step names them.
    ``teams``: whether the op may run over a subset of a mesh's axes (``axis:``, its
    team: dcpc.lang.mesh); an op without it runs over every axis only.
    """

    name: str
    model: type[OpBase]
    semantics: Callable[[Scope, Step], Semantics]
    verify: Callable[[ShapeRules, Step], None] | None
    reference: Callable[[SimView, Step], None]
    io: Callable[[Any], IO]
    teams: bool = False


OPS: dict[str, OpDef] = {}


def define(op: OpDef) -> OpDef:
    """Register ``op`` (once per name; the order of registration is the language's)."""
    if op.name in OPS:
        raise ValueError(f"op {op.name!r} is defined twice")
    OPS[op.name] = op
    return op


def names(value: str | list[str] | None) -> list[str]:
    """A key's buffer names, whether it holds one name or a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]
