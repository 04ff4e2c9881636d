"""What the LSE merges share: lse_combine, lse_correct, all_to_all_combine and all_reduce's
``reduce: lse``.

A helper of the op modules, not an op: it imports only what an op may import
(tests/codegen/test_layers.py), so that no op module imports another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dcpc.lang.expr import product
from dcpc.ops.common import Scope, Semantics, buffers_of, keyed, local, merge_inputs
from dcpc.ops.registry import IO

if TYPE_CHECKING:
    from dcpc.lang.nodes import Step
    from dcpc.ops.iface import LowerRules, SimView


def merge_semantics(c: Scope, step: Step) -> Semantics:
    """A merge on this rank: reads its partials and masks, writes dst (and return_lse)."""
    op = step.op
    return local(keyed(op, "src") + merge_inputs(op), keyed(op, "dst") + keyed(op, "return_lse"))


def combine(sim: SimView, op: Any, o_name: str, lse_name: str) -> None:
    """dst = sum_p w_p * o[p] on every rank, w the LSE weights (masked); the merged LSE
    into return_lse: lse_combine's reference; all_to_all_combine and all_reduce (reduce:
    lse) merge what they received with it."""
    for r in range(sim.world):
        weights, merged = sim.merge_weights(op, r, lse_name)
        parts = sim.bufs[r][o_name]
        sim.store(r, op.dst, sim.scaled(op, r, sim.weighted_sum(weights, parts),
                                        sim.merge_error(weights, parts)))
        if op.return_lse:
            sim.store(r, op.return_lse, merged)


def merge_io(op: Any) -> IO:
    """A local merge's io: partials and masks in, dst and return_lse out."""
    lse = [op.return_lse] if op.return_lse else []
    return list(op.src) + buffers_of(merge_inputs(op)), [op.dst] + lse


def local_plan(ctx: LowerRules, step: Step) -> Any:
    """The plan of a merge on this rank only, ``src: [o, lse]`` into ``dst`` (lse_combine,
    lse_correct), before ``lower_merge``."""
    op: Any = step.op
    o, lse = op.src
    return ctx.plan(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"o": o, "lse": lse, "dst": op.dst},
    )


def lower_merge(ctx: LowerRules, step: Step, o: str, lse: str, plan: Any) -> Any:
    """What every merge's plan adds for its partials ``o`` and ``lse`` (as it reads them):
    rows, the base, return_lse, mask_empty and output_scale."""
    op: Any = step.op
    lse_shape = ctx.shape(lse)
    plan.scalars += [
        ("rows", product(lse_shape[1:])),
        ("group_rows", product(lse_shape[2:])),
        ("row_len", ctx.shape(o)[-1]),
    ]
    plan.tiles.append(ctx.shape(o)[-1])
    plan.attrs["base"] = ctx.base(op, lse)
    plan.attrs["return_lse"] = op.return_lse is not None
    if op.return_lse:
        plan.roles["dst_lse"] = op.return_lse
        plan.returns.append(op.return_lse)
    ctx.mask(op, plan)
    ctx.output_scale(op, plan)
    return plan
