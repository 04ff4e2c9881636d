"""broadcast: rank ``root``'s ``src`` lands in every rank's symmetric ``dst`` (src's
shape); ``root`` is a team index: a rank, or over ``axis:`` a member index of each team
(below the team's size at every shape checked: ``_reduce.verify_root``).

Lowered as: the root pushes its whole ``src`` into every rank's ``dst`` (its own
included); every rank signals every peer and waits for every peer (so no rank returns
before the root's stores into it, nor before every peer entered the step).
Modelled soundly for the happens-before checker: the step's effects are the same on
every rank (SPMD), so every rank is given a store into every rank's ``dst``, in a
partition of its own per root (``Region("root", root)``: stores of that partition from
different ranks are disjoint, from the same rank overlap, and overlap every other
partition and every local access). The root's real store is among them, so every race
of the real store is found; the other ranks' stores exist only in the model (an
over-approximation: it may refuse, never prove, more).
Lowerings: ``lower`` below + templates/ops/broadcast.py.j2;
dcpc/runtime/collectives.py ``broadcast``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops._reduce import verify_root
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
    typed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class Broadcast(OpBase):
    op: Literal["broadcast"]
    src: Name
    dst: Name
    root: Int = Field(default=0, ge=0, description="the team index whose src every rank gets")


def semantics(c: Scope, step: Step) -> Semantics:
    op: Broadcast = step.op  # type: ignore[assignment]
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, keyed(op, "dst"), Region("root", op.root))
    return exchange(before, [], step)


def verify(v: ShapeRules, step: Step) -> None:
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    v.transfer(src, dst, symmetric=True)
    shape = v.shape(src.name)
    if shape is not None and v.shape(dst.name) is not None:
        v.expect(dst, shape, f"the root's src '{src.name}'")
    verify_root(v, step)


def reference(sim: SimView, step: Step) -> None:
    op: Broadcast = step.op  # type: ignore[assignment]
    value = sim.bufs[op.root][op.src]
    for r in range(sim.world):
        sim.store(r, op.dst, value.clone())


def io(op: Broadcast) -> IO:
    return [op.src], [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, Broadcast)
    shape = ctx.shape(op.src)
    return ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("outer", product(shape[:-1])), ("part", shape[-1])],
        tiles=[shape[-1]],
        attrs={"root": op.root},
        signalling=True,
    )


DEF = define(OpDef("broadcast", Broadcast, semantics, verify, reference, io, lower, teams=True,
                   exact=True))
