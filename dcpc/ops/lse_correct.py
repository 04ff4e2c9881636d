"""lse_correct: scale this rank's own partial ``o`` ([*rows, D]) by its LSE weight
among the W stacked LSEs ``lse_all`` ([W, *rows]): ``dst = w_rank * o`` (masked rows
weigh 0; an fp8 ``dst`` divided by ``output_scale``); optionally the merged LSE
(``return_lse``). Local: no peer is written. It
shares lse_combine's merge (semantics, verifier, weights).
Lowerings: ``lower`` below + templates/ops/lse_correct.py.j2;
dcpc/runtime/collectives.py ``lse_correct``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.nodes import MaskEmpty, Name, OpBase, Step
from dcpc.ops._merge import local_plan, lower_merge, merge_io, merge_semantics
from dcpc.ops.common import merge_input_rules, typed
from dcpc.ops.registry import OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class LseCorrect(OpBase):
    op: Literal["lse_correct"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse_all]")
    dst: Name
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


def verify(v: ShapeRules, step: Step) -> None:
    assert isinstance(step.op, LseCorrect)
    o, lse = v.refs("src")
    v.merge(o, lse, stacked=False)


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: LseCorrect = step.op  # type: ignore[assignment]
    o_name, lse_name = op.src
    for r in range(sim.world):
        weights, merged = sim.merge_weights(op, r, lse_name)
        w = weights[r].unsqueeze(-1)
        out = torch.where(w == 0, 0.0, w * sim.bufs[r][o_name])
        err = sim.merge_error(weights, sim.bufs[r][o_name], only=r)
        sim.store(r, op.dst, sim.scaled(op, r, out, err))
        if op.return_lse:
            sim.store(r, op.return_lse, merged)


def lower(ctx: LowerRules, step: Step) -> Any:
    o, lse = typed(step, LseCorrect).src
    plan = local_plan(ctx, step)
    n = len(ctx.shape(o))  # o is this rank's partial [*rows, Dv]: rows = lse's [1:]
    ctx.layout(plan, "o", n - len(ctx.shape(lse)) + 1, n - 1, unit=True)
    return lower_merge(ctx, step, o, lse, plan)


DEF = define(OpDef("lse_correct", LseCorrect, merge_semantics, verify, reference, merge_io, lower,
                   inputs=merge_input_rules))
