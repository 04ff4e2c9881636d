"""all_to_all_combine: all_to_all of ``src: [o, lse]`` into the symmetric ``via:
[o_recv, lse_recv]`` fused with lse_combine of what arrived, into ``dst`` (push,
signal, wait and merge in one kernel). Its own part travels through ``via[rank]``
only when another step reads ``via`` (``self_copy``); otherwise the merge reads it
from ``src``.
Lowerings: ``lower`` below + templates/ops/all_to_all_combine.py.j2; the torch backend
runs all_to_all + lse_combine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from dcpc.lang.expr import div, product
from dcpc.lang.nodes import Int, LseBase, MaskEmpty, Name, OpBase, Step, _lse_base
from dcpc.ops._merge import combine, lower_merge
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
    mask_inputs,
    merge_input_rules,
    merge_inputs,
    typed,
)
from dcpc.ops.registry import IO, OPS, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class AllToAllCombine(OpBase):
    """Fused all_to_all + lse_combine: push, signal, wait and merge in one kernel."""

    op: Literal["all_to_all_combine"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse]")
    via: list[Name] = Field(min_length=2, max_length=2, description="[o_recv, lse_recv]")
    dst: Name
    dim: Int = 0
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = None
    lse_base: LseBase | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)


def self_copy(c: Scope, step: Step) -> bool:
    """Whether a fused exchange copies its own part into ``via[rank]``: only when
    another step reads ``via``; otherwise its merge reads that part from ``src``."""
    return _read_elsewhere(c, step, set(step.op.via))  # type: ignore[attr-defined]


def _read_elsewhere(c: Scope, step: Step, names: set[str]) -> bool:
    """Whether a step other than ``step`` reads one of ``names``. Another fused exchange's
    reads are its named buffers: its own semantics asks this question in turn."""
    for other in c.steps:
        if other.name == step.name:
            continue
        if other.kind == "all_to_all_combine":
            named = {b for key in ("src", "via") for b, _ in keyed(other.op, key)}
            reads = named | {b for b, _ in merge_inputs(other.op)}
        else:
            reads = set(OPS[other.kind].semantics(c, other).reads)
        if names & reads:
            return True
    return False


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, keyed(op, "via"), Region("index", 0))
    # the masks: a call in one launch (every row tile in one wave) looks its rows'
    # requests up before the push (query_start_loc; interleaved lengths too); a call in
    # two launches, in the merge launch after the wait. Both phases listed, each
    # ``either`` (the tracer demands one of them; [B, W] lengths are read after only).
    before += effects(READ, BEFORE, mask_inputs(op), either=True)
    after = effects(READ, AFTER, keyed(op, "via"))
    after += effects(READ, AFTER, mask_inputs(op), either=True)
    after += effects(READ, AFTER, keyed(op, "output_scale"))
    if not self_copy(c, step):  # the merge reads this rank's own part from src
        after += effects(READ, AFTER, keyed(op, "src"))
    after += effects(WRITE, AFTER, keyed(op, "dst") + keyed(op, "return_lse"))
    return exchange(before, after, step)


def verify(v: ShapeRules, step: Step) -> None:
    assert isinstance(step.op, AllToAllCombine)
    (o, lse), (vo, vl) = v.refs("src"), v.refs("via")
    v.scatter(o, vo)
    v.scatter(lse, vl)
    v.merge(vo, vl, stacked=True)


def reference(sim: SimView, step: Step) -> None:
    op: AllToAllCombine = step.op  # type: ignore[assignment]
    for src, dst in zip(op.src, op.via, strict=True):
        sim.all_to_all(src, dst, op.dim)
    combine(sim, op, *op.via)


def io(op: AllToAllCombine) -> IO:
    lse = [op.return_lse] if op.return_lse else []
    return list(op.src) + buffers_of(merge_inputs(op)), [op.dst] + lse + list(op.via)


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, AllToAllCombine)
    o, lse = op.src
    via_o, via_lse = op.via
    shape = ctx.shape(lse)
    plan = ctx.plan(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"src_o": o, "src_lse": lse, "o": via_o, "lse": via_lse, "dst": op.dst},
        scalars=[
            ("outer", product(shape[: op.dim])),
            ("part_rows", div(product(shape[op.dim :]), ctx.team_w(step))),
        ],
        scratch={
            "send_o": (product(ctx.shape(o)), ctx.buffers[o].dtype),
            "send_lse": (product(shape), ctx.buffers[lse].dtype),
        },
        signalling=True,
    )
    ctx.layout(plan, "src_o", op.dim, len(ctx.shape(o)) - 1, unit=True)
    ctx.layout(plan, "src_lse", op.dim, len(shape))
    # The own part need not travel through via[RANK] unless another step reads via.
    plan.attrs["self_copy"] = self_copy(Scope(ctx.schedule), step)
    return lower_merge(ctx, step, via_o, via_lse, plan)


DEF = define(OpDef("all_to_all_combine", AllToAllCombine, semantics, verify, reference, io, lower,
                         teams=True, inputs=merge_input_rules))
