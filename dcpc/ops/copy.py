"""copy: a local copy of ``src`` into ``dst`` of the same shape and dtype (the staging
path's materialization).
Lowerings: ``lower`` below + templates/ops/copy.py.j2; the torch
backend copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dcpc.lang.expr import product
from dcpc.lang.nodes import Name, OpBase, Step
from dcpc.ops.common import Scope, Semantics, keyed, local, typed
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class Copy(OpBase):
    """A local copy into a buffer of the same shape (the staging path's materialization)."""

    op: Literal["copy"]
    src: Name
    dst: Name


def semantics(c: Scope, step: Step) -> Semantics:
    return local(keyed(step.op, "src"), keyed(step.op, "dst"))


def verify(v: ShapeRules, step: Step) -> None:
    assert isinstance(step.op, Copy)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    v.transfer(src, dst, symmetric=False)
    s = v.shape(src.name)
    if s is not None and v.shape(dst.name) is not None:
        v.expect(dst, list(s), f"a copy of src '{src.name}'")


def reference(sim: SimView, step: Step) -> None:
    op: Copy = step.op  # type: ignore[assignment]
    for r in range(sim.world):
        sim.store(r, op.dst, sim.bufs[r][op.src].clone())


def io(op: Copy) -> IO:
    return [op.src], [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, Copy)
    return ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("numel", product(ctx.shape(op.src)))],
    )


DEF = define(OpDef("copy", Copy, semantics, verify, reference, io, lower, exact=True))
