"""reduce_scatter: ``src`` split in W parts along ``dim``; part j of every rank lands
in the symmetric receive buffer ``via`` ([W, part]; implicit ``<step>_recv`` when
omitted) on rank j, which sums them in fp32 into ``dst`` (an fp8 ``dst`` divided by
``output_scale``).
Lowerings: ``lower`` below + templates/ops/reduce_scatter.py.j2;
dcpc/runtime/collectives.py ``reduce_scatter``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import div, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops._reduce import floats_only, receive_buffer, via_of
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
    import torch

    from dcpc.ops.iface import LowerRules, ShapeRules, SimView



class ReduceScatter(OpBase):
    op: Literal["reduce_scatter"]
    src: Name
    dst: Name
    dim: Int = 0
    via: Name | None = Field(
        default=None, description="symmetric receive buffer [W, part]; implicit if omitted"
    )
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    via = [via_of(step)]
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, via, Region("index", 0))
    after = effects(READ, AFTER, via + merge_inputs(op)) + effects(WRITE, AFTER, keyed(op, "dst"))
    return exchange(before, after, step)


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, ReduceScatter)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    if op.via is not None:
        (via,) = v.refs("via")
        part = v.scatter(src, via)
    else:
        part = v.part(src) if v.buffer(src.name) is not None else None
    floats_only(v, step, [src, dst])  # summed in fp32, rounded once into dst
    if part is not None and v.shape(dst.name) is not None:
        v.expect(dst, part, f"this rank's part of src '{src.name}'")


def reference(sim: SimView, step: Step) -> None:
    op: ReduceScatter = step.op  # type: ignore[assignment]
    via = op.via or f"{op.dst}__via"

    def keep(r: int, name: str, value: torch.Tensor) -> None:
        sim.stash(r, name, value, like=op.src)  # an implicit via has src's dtype

    sim.all_to_all(op.src, via, op.dim, sim.store if op.via else keep)
    for r in range(sim.world):
        sim.store(r, op.dst, sim.scaled(op, r, sim.bufs[r][via].sum(dim=0)))


def io(op: ReduceScatter) -> IO:
    return [op.src] + buffers_of(merge_inputs(op)), [op.dst] + ([op.via] if op.via else [])


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, ReduceScatter)
    shape = ctx.shape(op.src)
    outer, part = product(shape[: op.dim]), div(product(shape[op.dim :]), ctx.team_w(step))
    via = receive_buffer(ctx, step, outer, part)
    plan = ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "via": via, "dst": op.dst},
        scalars=[("outer", outer), ("part", part)],
        tiles=[part],
        scratch={
            "send": (product(shape), ctx.buffers[op.src].dtype),
            "acc": (product(ctx.shape(op.dst)), "f32"),
        },
        signalling=True,
    )
    ctx.output_scale(op, plan)
    return plan


DEF = define(OpDef("reduce_scatter", ReduceScatter, semantics, verify, reference, io, lower,
                         teams=True, inputs=merge_input_rules))
