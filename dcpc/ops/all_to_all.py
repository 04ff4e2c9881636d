"""all_to_all: ``src`` split in W parts along ``dim``; part j of rank p lands in
``dst[p]`` on rank j (dst has a leading W axis). ``src``/``dst`` may be lists of the
same length: one exchange of several payloads. ``scale``: a cast inside the move
(dcpc/ops/cast.py; one payload split along dim 0, lowered with ragged_all_to_all's
kernel at full counts).
Lowerings: dcpc/codegen/rules.py ``all_to_all`` + templates/ops/all_to_all.py.j2;
dcpc/runtime/collectives.py ``all_to_all``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops import cast
from dcpc.ops.cast import Scale
from dcpc.ops.common import (
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    effects,
    exchange,
    keyed,
)
from dcpc.ops.registry import IO, OpDef, define, names

if TYPE_CHECKING:
    from dcpc.check.ops import Verify
    from dcpc.harness.simulate import Sim


class AllToAll(OpBase):
    op: Literal["all_to_all"]
    src: Name | list[Name]
    dst: Name | list[Name]
    dim: Int = 0
    scale: Scale | None = None


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, keyed(op, "dst"), Region("index", 0))
    return exchange(before + cast.effects(c.schedule, op), [], step)


def verify(v: Verify, step: Step) -> None:
    if step.op.scale is not None:  # type: ignore[attr-defined]
        cast.verify_move(v)
        return
    for src, dst in v.pairs(v.refs("src"), v.refs("dst")):
        v.scatter(src, dst)


def reference(sim: Sim, step: Step) -> None:
    op: AllToAll = step.op  # type: ignore[assignment]
    if op.scale is not None:
        cast.all_to_all_reference(sim, op)
        return
    for src, dst in zip(names(op.src), names(op.dst), strict=True):
        sim.all_to_all(src, dst, op.dim)


def io(op: AllToAll) -> IO:
    scale = [op.scale.buffer] if op.scale is not None else []  # read, or sent (symmetric)
    return names(op.src) + scale, names(op.dst)


DEF = define(OpDef("all_to_all", AllToAll, semantics, verify, reference, io))
