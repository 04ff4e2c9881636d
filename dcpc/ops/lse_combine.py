"""lse_combine: merge this rank's W stacked partials ``src: [o, lse]`` (o [W, *rows, D],
lse [W, *rows]) into ``dst`` by their LSE weights; empty shards and padding rows
(``mask_empty``) weigh 0; optionally the merged LSE (``return_lse``) and an fp8
``dst`` divided by ``output_scale``. Local: no peer is written.
Lowerings: ``lower`` below + templates/ops/lse_combine.py.j2;
dcpc/runtime/collectives.py ``lse_combine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from dcpc.lang.nodes import LseBase, MaskEmpty, Name, OpBase, Step, _lse_base
from dcpc.ops._merge import combine, local_plan, lower_merge, merge_io, merge_semantics
from dcpc.ops.common import merge_input_rules, typed
from dcpc.ops.registry import OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class LseCombine(OpBase):
    op: Literal["lse_combine"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[o, lse]")
    dst: Name
    mask_empty: MaskEmpty | None = None
    return_lse: Name | None = Field(default=None, description="buffer for the merged LSE")
    lse_base: LseBase | None = None
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )

    _norm_base = field_validator("lse_base", mode="before")(_lse_base)


def verify(v: ShapeRules, step: Step) -> None:
    assert isinstance(step.op, LseCombine)
    o, lse = v.refs("src")
    v.merge(o, lse, stacked=True)


def reference(sim: SimView, step: Step) -> None:
    o_name, lse_name = step.op.src  # type: ignore[attr-defined]
    combine(sim, step.op, o_name, lse_name)


def lower(ctx: LowerRules, step: Step) -> Any:
    o, lse = typed(step, LseCombine).src
    return lower_merge(ctx, step, o, lse, local_plan(ctx, step))


DEF = define(OpDef("lse_combine", LseCombine, merge_semantics, verify, reference, merge_io, lower,
                   inputs=merge_input_rules))
