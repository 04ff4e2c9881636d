"""weighted_combine: the top-k weighted sum of returned expert outputs (MoE combine).

``src: [x, weights]``, ``dst`` [T, H]: ``dst[t] = sum_k weights[t, k] * row(t, k)``,
k = 0, 1, ..., K-1 in that order, accumulated in fp32 and rounded once into dst's
dtype (an fp8 ``dst`` divided by ``output_scale``). ``weights`` is [T, K]. T may be
several dims (``weights`` [*T, K], ``dst`` [*T, H], ``index`` [*T, K]): DeepEP normal
mode's forwarder reduces straight into its [N, C, H] RDMA send blocks. With
``index`` ([T, K] integers) ``row(t, k)`` is row ``index[t, k]`` of ``x`` seen as
[rows, H] (all dims but the last flattened: a ragged all_to_all's [W, capacity, H]
receive buffer, DeepEP's combine layout); a negative
index is an empty slot that contributes exactly 0 (never read), an index >= rows is an
error (``DcpcArgumentError``). Without ``index`` ``x`` is [T, K, H] and ``row(t, k) =
x[t, k]``. Local: no peer is read or written.
Lowerings: ``lower`` below + templates/ops/weighted_combine.py.j2;
dcpc/runtime/collectives.py ``weighted_combine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import product
from dcpc.lang.nodes import Name, OpBase, Step
from dcpc.ops._reduce import floats_only
from dcpc.ops.common import (
    OUTPUT_SCALE,
    Scope,
    Semantics,
    integer_index,
    keyed,
    local,
    merge_input_rules,
    typed,
)
from dcpc.ops.iface import RowIndex
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import InputRule, LowerRules, ShapeRules, SimView


class WeightedCombine(OpBase):
    op: Literal["weighted_combine"]
    src: list[Name] = Field(min_length=2, max_length=2, description="[x, weights]")
    dst: Name
    index: Name | None = Field(
        default=None, description="[T, K] integers: the row of x of each slot (< 0: none)"
    )
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    return local(keyed(op, "src") + keyed(op, "index") + keyed(op, OUTPUT_SCALE),
                 keyed(op, "dst"))


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, WeightedCombine)
    x, weights = v.refs("src")
    (dst,) = v.refs("dst")
    floats_only(v, step, [x, weights, dst],
                "it sums in fp32, so it reads and writes floating-point values")
    ws, xs, ds = v.shape(weights.name), v.shape(x.name), v.shape(dst.name)
    if ws is None or xs is None:
        return
    if len(ws) < 2:
        v.error(weights.mark, "shape-mismatch",
                f"weights '{weights.name}' of step '{step.name}' has {len(ws)} dims; it must "
                "be [T, K] (or [*T, K]): the top-k weights of each token")
        return
    index = v.refs("index")
    if index:
        (idx,) = index
        if integer_index(v, step, idx, "row numbers") is not None:
            v.expect(idx, list(ws), f"one row of x per weight of '{weights.name}'")
        if len(xs) < 2:
            v.error(x.mark, "shape-mismatch",
                    f"x '{x.name}' of step '{step.name}' has {len(xs)} dims; it must be "
                    "[..., H]: rows of H values")
            return
    else:
        v.expect(x, [*ws, xs[-1]], f"one row per weight of '{weights.name}', then H")
    if ds is not None:
        v.expect(dst, [*ws[:-1], xs[-1]], "one combined row per token")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: WeightedCombine = step.op  # type: ignore[assignment]
    x_name, w_name = op.src
    for r in range(sim.world):
        bufs = sim.bufs[r]
        weights = bufs[w_name]
        x = bufs[x_name]
        rows = x.reshape(-1, x.shape[-1])
        topk = weights.shape[-1]
        weights = weights.reshape(-1, topk)  # tokens over [*T]
        tokens = weights.shape[0]
        if op.index is None:
            index = torch.arange(tokens * topk).reshape(tokens, topk)
        else:
            index = bufs[op.index].to(torch.int64).reshape(tokens, topk)
            if bool((index >= len(rows)).any()):
                raise ValueError(f"simulator: step {step.name}: rank {r}'s index holds a row "
                                 f"past the {len(rows)} rows of {x_name}")
        out = torch.zeros(tokens, x.shape[-1], dtype=torch.float64)
        size = torch.zeros_like(out)  # sum_k |w_k x_k| (the fp32 error's magnitude)
        for k in range(topk):
            live = index[:, k] >= 0
            part = torch.where(live[:, None], weights[:, k, None] * rows[index[:, k].clamp(min=0)],
                               0.0)  # an empty slot: exactly 0
            out += part
            size += part.abs()
        shape = (*sim.shape(op.dst)[:-1], x.shape[-1])
        sim.store(r, op.dst, sim.scaled(op, r, out.reshape(shape),
                                        sim.fp32_error(topk, size.reshape(shape))))


def io(op: WeightedCombine) -> IO:
    reads = list(op.src) + [n for n in (op.index, op.output_scale) if n]
    return reads, [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, WeightedCombine)
    x, weights = op.src
    xs, ws = ctx.shape(x), ctx.shape(weights)
    roles = {"x": x, "weights": weights, "dst": op.dst}
    if op.index is not None:
        roles["index"] = op.index
    plan = ctx.plan(
        step,
        params=ctx.engine([x, weights, op.index]),
        returns=[op.dst],
        roles=roles,
        scalars=[("tokens", product(ws[:-1])), ("topk", ws[-1]), ("row_len", xs[-1]),
                 ("rows", product(xs[:-1]))],
        tiles=[xs[-1]],
        attrs={"index": op.index is not None},
    )
    ctx.output_scale(op, plan)
    return plan


def inputs(op: WeightedCombine) -> dict[str, InputRule]:
    """``index``: rows of x that exist (some -1), and the fp8 ``output_scale``."""
    rows = {op.index: RowIndex(op.src[0])} if op.index is not None else {}
    return {**rows, **merge_input_rules(op)}


DEF = define(OpDef("weighted_combine", WeightedCombine, semantics, verify, reference, io, lower,
                   inputs=inputs))
