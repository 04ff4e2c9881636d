"""sum: the local sum of ``src`` over its dim ``dim`` into ``dst`` (src's shape without
that dim): ``dst = src[.., 0, ..] + src[.., 1, ..] + ... + src[.., n-1, ..]`` in that
order, accumulated in fp32 from +0 and rounded once into dst's dtype (an fp8 ``dst``
divided by ``output_scale``). Floats only. Local: no peer is read or written; after a
``pull`` it is vLLM's one-shot custom all-reduce (schedules/gallery/custom_all_reduce.yaml).
Lowerings: ``lower`` below + templates/ops/sum.py.j2 (its torch body inline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops._reduce import floats_only
from dcpc.ops.common import (
    OUTPUT_SCALE,
    Scope,
    Semantics,
    keyed,
    local,
    merge_input_rules,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class Sum(OpBase):
    """dst = the fp32 sum of src over dim ``dim``, rounded once (a local reduction)."""

    op: Literal["sum"]
    src: Name
    dst: Name
    dim: Int = Field(default=0, description="the dim of src summed away")
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    return local(keyed(op, "src") + keyed(op, OUTPUT_SCALE), keyed(op, "dst"))


def verify(v: ShapeRules, step: Step) -> None:
    op = typed(step, Sum)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    floats_only(v, step, [src, dst],
                "it sums in fp32, so it reads and writes floating-point values")
    s = v.shape(src.name)
    if s is None:
        return
    if len(s) < 2:
        v.error(src.mark, "shape-mismatch",
                f"src '{src.name}' of sum '{step.name}' has {len(s)} dim; it needs at least "
                "2: the dim summed away and the dims dst keeps")
        return
    dim = v.dim(src, len(s))
    if dim is None or v.shape(dst.name) is None:
        return
    v.expect(dst, [*s[:dim], *s[dim + 1:]],
             f"src '{src.name}' summed over its dim {op.dim}")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op = typed(step, Sum)
    for r in range(sim.world):
        x = sim.bufs[r][op.src]
        out = torch.zeros(x.select(op.dim, 0).shape, dtype=torch.float64)  # +0: -0s sum to +0
        for k in range(x.shape[op.dim]):  # in order, as the kernel
            out = out + x.select(op.dim, k)
        err = sim.fp32_error(x.shape[op.dim], x.abs().sum(dim=op.dim))
        sim.store(r, op.dst, sim.scaled(op, r, out, err))


def io(op: Sum) -> IO:
    return [op.src] + ([op.output_scale] if op.output_scale else []), [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    """src as [outer, parts, inner] (parts: its dim ``dim``), dst as [outer, inner]."""
    op = typed(step, Sum)
    s, d = ctx.shape(op.src), op.dim  # the verifier refuses a dim out of range
    plan = ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("outer", product(s[:d])), ("parts", s[d]), ("inner", product(s[d + 1:]))],
        attrs={"dim": d},
    )
    ctx.output_scale(op, plan)
    return plan


DEF = define(OpDef("sum", Sum, semantics, verify, reference, io, lower,
                   inputs=merge_input_rules))
