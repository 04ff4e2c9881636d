"""all_reduce: every rank gets the elementwise reduction over ranks of ``src`` (over the
ranks of its team with ``axis:``, W then the team's size).

``reduce: sum`` (default) or ``max``. Every rank pushes its whole ``src`` into index
``rank`` of every rank's symmetric receive buffer ``via`` ([W, *src shape]; implicit
``<step>_recv`` when omitted), signals, waits, then reduces ``via[0] .. via[W-1]`` IN
THAT ORDER in fp32 into ``dst`` (src's shape; an fp8 ``dst`` divided by
``output_scale``): every rank adds the same values in the same order, so every rank's
``dst`` is bitwise identical.

``reduce: lse`` (tree attention, PCP): ``src: [o, lse]`` partials ([*rows, D], [*rows]),
``via: [o_recv, lse_recv]`` ([W, *rows, D], [W, *rows], symmetric, required), and every
rank gets the LSE-weighted merge of the W partials in ``dst`` (and the merged LSE in
``return_lse``), with ``mask_empty``/``lse_base``/``output_scale`` as ``lse_combine``:
the push of every whole partial, then lse_combine's merge (the same math) of ``via``.
Lowerings: ``lower`` below + templates/ops/all_reduce.py.j2;
dcpc/runtime/collectives.py ``all_reduce``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from dcpc.lang.expr import product
from dcpc.lang.nodes import LseBase, MaskEmpty, Name, OpBase, Step, _lse_base
from dcpc.ops._merge import combine, lower_merge
from dcpc.ops._reduce import REDUCTIONS, lower_elementwise, verify_elementwise, via_of
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


class AllReduce(OpBase):
    op: Literal["all_reduce"]
    src: Name | list[Name] = Field(description="a buffer; [o, lse] for reduce: lse")
    dst: Name
    reduce: Literal["sum", "max", "lse"] = "sum"
    via: Name | list[Name] | None = Field(
        default=None, description="symmetric receive buffer(s) [W, *src]; implicit if omitted "
        "(sum, max)"
    )
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = Field(default=None, description="the merged LSE (reduce: lse)")
    lse_base: LseBase | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)


def vias(step: Step) -> list[tuple[str, str]]:
    """(buffer, key) of every receive buffer: [o_recv, lse_recv] for reduce: lse."""
    op: AllReduce = step.op  # type: ignore[assignment]
    if op.reduce == "lse" or isinstance(op.via, list):  # a list under sum is reported
        return keyed(op, "via")
    return [via_of(step)]


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    via = vias(step)
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, via, Region("index", 0))
    after = effects(READ, AFTER, via + merge_inputs(op))
    after += effects(WRITE, AFTER, keyed(op, "dst") + keyed(op, "return_lse"))
    return exchange(before, after, step)


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, AllReduce)
    if op.reduce == "lse":
        _verify_lse(v, step)
        return
    verify_elementwise(v, step)


def _verify_lse(v: ShapeRules, step: Step) -> None:
    op: AllReduce = step.op  # type: ignore[assignment]
    srcs, via = v.refs("src"), v.refs("via")
    if len(srcs) != 2 or len(via) != 2:
        key = "src" if len(srcs) != 2 else "via"
        v.error(op.mark(key) if key in op.src_marks else step.mark(), "bad-reduce",
                f"all_reduce '{step.name}' with reduce: lse needs 'src: [o, lse]' and "
                f"'via: [o_recv, lse_recv]' (symmetric, a leading W axis); it has "
                f"{len(srcs)} src and {len(via)} via buffer(s)",
                hint="e.g. 'src: [o, lse], via: [o_recv, lse_recv]'")
        return
    for src, recv in zip(srcs, via, strict=True):
        v.transfer(src, recv, symmetric=True)
        shape = v.shape(src.name)
        if shape is not None and v.shape(recv.name) is not None:
            v.expect(recv, [v.W, *shape], f"src '{src.name}' of every rank, along a leading "
                     "W axis")
    v.merge(via[0], via[1], stacked=True)


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    from dcpc.numerics import ieee_max

    op: AllReduce = step.op  # type: ignore[assignment]
    if op.reduce == "lse":
        for src, recv in zip(op.src, op.via, strict=True):  # type: ignore[arg-type]
            parts = torch.stack([sim.bufs[r][src] for r in range(sim.world)])
            for r in range(sim.world):
                sim.store(r, recv, parts.clone())
        combine(sim, op, op.via[0], op.via[1])  # type: ignore[index]
        return
    parts = torch.stack([sim.bufs[r][op.src].to(torch.float64) for r in range(sim.world)])
    for r in range(sim.world):
        if op.via is not None:
            sim.store(r, op.via, parts.clone())
        total = parts.sum(dim=0) if op.reduce == "sum" else ieee_max(parts)
        terms = sim.world if op.reduce == "sum" else 0  # a max is exact
        err = sim.fp32_error(terms, parts.abs().sum(dim=0))
        sim.store(r, op.dst, sim.scaled(op, r, total, err))


def io(op: AllReduce) -> IO:
    via = [op.via] if isinstance(op.via, str) else list(op.via or [])
    lse = [op.return_lse] if op.return_lse else []
    srcs = [op.src] if isinstance(op.src, str) else list(op.src)
    return srcs + buffers_of(merge_inputs(op)), [op.dst] + lse + via


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, AllReduce)
    if op.reduce != "lse":
        return lower_elementwise(ctx, step)
    # Push every whole partial [o, lse] into via[rank] of every rank (rows x row_len
    # tiles), signal, wait; then lse_combine's merge of via in a second launch.
    o, lse = op.src
    via_o, via_lse = op.via  # type: ignore[misc]
    plan = ctx.plan(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"src_o": o, "src_lse": lse, "o": via_o, "lse": via_lse, "dst": op.dst},
        scalars=[("push_rows", product(ctx.shape(lse)))],
        attrs={"reduce": REDUCTIONS.index(op.reduce)},
        signalling=True,
    )
    plan.tiles.append(ctx.shape(o)[-1])  # the push's tiles; the merge's are tiles[1]
    return lower_merge(ctx, step, via_o, via_lse, plan)


DEF = define(OpDef("all_reduce", AllReduce, semantics, verify, reference, io, lower,
                   teams=True, inputs=merge_input_rules))
