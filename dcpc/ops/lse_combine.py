"""lse_combine: merge this rank's W stacked partials ``src: [o, lse]`` (o [W, *rows, D],
lse [W, *rows]) into ``dst`` by their LSE weights; empty shards and padding rows
(``mask_empty``) weigh 0; optionally the merged LSE (``return_lse``) and an fp8
``dst`` divided by ``output_scale``. Local: no peer is written.
Lowerings: dcpc/codegen/rules.py ``lse_combine`` + templates/ops/lse_combine.py.j2;
dcpc/runtime/collectives.py ``lse_combine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from dcpc.lang.nodes import LseBase, MaskEmpty, Name, OpBase, Step, _lse_base
from dcpc.ops.common import Scope, Semantics, buffers_of, keyed, local, merge_inputs
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.check.ops import Verify
    from dcpc.harness.simulate import Sim


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


def merge_semantics(c: Scope, step: Step) -> Semantics:
    """A merge on this rank: reads its partials and masks, writes dst (and return_lse)."""
    op = step.op
    return local(keyed(op, "src") + merge_inputs(op), keyed(op, "dst") + keyed(op, "return_lse"))


def verify(v: Verify, step: Step) -> None:
    assert isinstance(step.op, LseCombine)
    o, lse = v.refs("src")
    v.merge(o, lse, stacked=True)


def combine(sim: Sim, op: Any, o_name: str, lse_name: str) -> None:
    """dst = sum_p w_p * o[p] on every rank, w the LSE weights (masked); the merged LSE
    into return_lse. Shared with all_to_all_combine, which merges what it received."""
    for r in range(sim.world):
        weights, merged = sim.merge_weights(op, r, lse_name)
        sim.store(r, op.dst, sim.scaled(op, r, sim.weighted_sum(weights, sim.bufs[r][o_name])))
        if op.return_lse:
            sim.store(r, op.return_lse, merged)


def reference(sim: Sim, step: Step) -> None:
    o_name, lse_name = step.op.src  # type: ignore[attr-defined]
    combine(sim, step.op, o_name, lse_name)


def merge_io(op: Any) -> IO:
    """A local merge's io: partials and masks in, dst and return_lse out."""
    lse = [op.return_lse] if op.return_lse else []
    return list(op.src) + buffers_of(merge_inputs(op)), [op.dst] + lse


DEF = define(OpDef("lse_combine", LseCombine, merge_semantics, verify, reference, merge_io))
