"""reduce: rank ``root`` gets the elementwise reduction over ranks of ``src`` in ``dst``
(``reduce: sum | max``, floats); ``root`` is a team index: a rank, or over ``axis:`` a
member index of each team (below the team's size at every shape checked). Every other
rank's ``dst`` is set to 0, so that no reader there sees a stale value (MPI leaves it
undefined; a defined value keeps every rank's output checkable).

Lowered as: every rank pushes its whole ``src`` into index ``rank`` of the ROOT's
symmetric receive buffer ``via`` ([W, *src]; implicit ``<step>_recv``), every rank
signals every peer and waits for every peer, then the root reduces ``via[0] .. via[W-1]``
in that order in fp32 into ``dst`` (an fp8 ``dst`` divided by ``output_scale``; the other
ranks write 0).
Semantics, exact: the pushes store into the ROOT's ``via`` only and only the root reads
it (``Effect.root``), so a later read of ``via`` on every rank reads, off the root, what
nothing wrote (read-before-write, dcpc.check.flow); ``dst`` is written on every rank (the
other ranks write their zeros). The happens-before checkers take root-only accesses on
every rank (their symmetry needs the same accesses on every rank): an over-approximation,
sound for races. The tests compare both with an exact brute force.
Lowerings: ``lower`` below + templates/ops/reduce.py.j2;
dcpc/runtime/collectives.py ``reduce``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops._reduce import lower_elementwise, verify_elementwise, verify_root, via_of
from dcpc.ops.common import (
    AFTER,
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    buffers_of,
    effects,
    exchange,
    keyed,
    merge_input_rules,
    merge_inputs,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class Reduce(OpBase):
    op: Literal["reduce"]
    src: Name
    dst: Name
    root: Int = Field(default=0, ge=0, description="the team index that gets the reduction")
    reduce: Literal["sum", "max"] = "sum"
    via: Name | None = Field(
        default=None, description="symmetric receive buffer [W, *src]; implicit if omitted"
    )
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


def semantics(c: Scope, step: Step) -> Semantics:
    """all_reduce's (sum, max) effects and sync, with the pushes into, and the reduction's
    read of, the root's ``via`` only."""
    op: Reduce = step.op  # type: ignore[assignment]
    via = [via_of(step)]
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, via, Region("index", 0), root=op.root)
    after = effects(READ, AFTER, via, root=op.root) + effects(READ, AFTER, merge_inputs(op))
    after += effects(WRITE, AFTER, keyed(op, "dst"))  # every rank checks its own scale
    return exchange(before, after, step)


def verify(v: ShapeRules, step: Step) -> None:
    verify_elementwise(v, step)  # all_reduce's rules: floats, dst = src's shape, via [W, *src]
    verify_root(v, step)


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    from dcpc.numerics import ieee_max

    op: Reduce = step.op  # type: ignore[assignment]
    parts = torch.stack([sim.bufs[r][op.src].to(torch.float64) for r in range(sim.world)])
    total = parts.sum(dim=0) if op.reduce == "sum" else ieee_max(parts)
    for r in range(sim.world):  # every rank checks its own scale; the root's divides
        value = total if r == op.root else torch.zeros_like(total)
        terms = sim.world if op.reduce == "sum" and r == op.root else 0  # a max is exact
        err = sim.fp32_error(terms, parts.abs().sum(dim=0))
        sim.store(r, op.dst, sim.scaled(op, r, value, err))
    if op.via is not None:
        sim.store(op.root, op.via, parts.clone())


def io(op: Reduce) -> IO:
    return [op.src] + buffers_of(merge_inputs(op)), [op.dst] + ([op.via] if op.via else [])


def lower(ctx: LowerRules, step: Step) -> Any:
    plan = lower_elementwise(ctx, step)
    plan.attrs["root"] = typed(step, Reduce).root
    return plan


__all__ = ["Reduce", "via_of"]
DEF = define(OpDef("reduce", Reduce, semantics, verify, reference, io, lower, teams=True,
                   inputs=merge_input_rules))
