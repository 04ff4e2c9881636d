"""The lowering rules, one per op: ``@register("op")`` puts a rule in ``LOWERINGS``.

The op itself (model, semantics, verifier, float64 reference) is defined in
dcpc/ops/<op>.py; its Triton lowering is registered here against the same name
(docs/internals.md says why it stays in the codegen package).

A rule gets the lowering context and the step and returns the step's ``StepPlan``;
its template is ``templates/ops/<op>.py.j2``. See dcpc/codegen/lower.py for the
driver and the canonical-factor convention the rules follow, dcpc/codegen/ctx.py for
what a rule may use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from dcpc.codegen.ctx import Ctx, register
from dcpc.codegen.plan import StepPlan
from dcpc.lang import model as m
from dcpc.lang.expr import ONE, W, div, product
from dcpc.ops import all_reduce as ar
from dcpc.ops import all_to_all as a2a
from dcpc.ops import broadcast as bc
from dcpc.ops import cast
from dcpc.ops import reduce as rd
from dcpc.ops.all_to_all_combine import self_copy
from dcpc.ops.common import Scope
from dcpc.ops.reduce_scatter import via_of
from dcpc.ops.registry import names

OpT = TypeVar("OpT", bound=m.OpBase)


def typed(step: m.Step, cls: type[OpT]) -> OpT:
    """The step's op as the model class its rule is registered for."""
    assert isinstance(step.op, cls), (step.name, type(step.op).__name__)
    return step.op


@register("all_gather")
def _all_gather(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllGather)
    srcs, dsts = names(op.src), names(op.dst)
    plan = ctx.plan(step, params=ctx.engine(srcs), returns=list(dsts), signalling=True)
    stacks = []
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        p = str(k) if k else ""  # payload 0 keeps the unsuffixed names
        src, dst = ctx.shape(s), ctx.shape(t)
        d = op.dim
        stack = len(dst) == len(src) + 1
        outer = product(src[:d])
        if stack:  # a concat of W blocks of src[d] rows each (interleave = rows): one layout
            rows = src[d] if d < len(src) else ONE
            row_len, interleave = product(src[d + 1 :]), rows
        else:
            rows, row_len = src[d], product(src[d + 1 :])
            interleave = ("num", op.interleave) if op.interleave else rows
        plan.roles[f"src{p}"], plan.roles[f"dst{p}"] = s, t
        plan.scalars += [
            (f"outer{p}", outer),
            (f"rows{p}", rows),
            (f"row_len{p}", row_len),
            (f"interleave{p}", interleave),
        ]
        plan.tiles.append(row_len)
        plan.scratch[f"stage{p}"] = (product([W, *src]), ctx.buffers[s].dtype)
        ctx.layout(plan, f"src{p}", d, min(d + 1, len(src)))
        stacks.append(stack)
    plan.attrs["payloads"] = [("" if k == 0 else str(k), stack) for k, stack in enumerate(stacks)]
    return plan


@register("all_to_all")
def _all_to_all(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllToAll)
    if op.scale is not None:  # a cast: ragged_all_to_all's kernel at full counts
        return _cast_move(ctx, step)
    srcs, dsts = names(op.src), names(op.dst)
    plan = ctx.plan(step, params=ctx.engine(srcs), returns=list(dsts), signalling=True)
    concat = a2a.concat(op)
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        shape = ctx.shape(s)
        d, cat = a2a.dims(op, len(shape)) if concat else (op.dim, 0)
        plan.roles[f"src{k}"], plan.roles[f"dst{k}"] = s, t
        part = div(product(shape[d:]), ctx.team_w(step))
        plan.scalars += [
            (f"outer{k}", product(shape[:d])),
            (f"part{k}", part),
            (f"inner{k}", product(shape[d + 1 :])),
        ]
        if concat:  # a part's dims [cat:] make one block of dst, rank p's at block p
            chunk = [div(x, W) if i == d else x for i, x in enumerate(shape)]
            plan.scalars.append((f"block{k}", product(chunk[cat:])))
            plan.scratch[f"recv{k}"] = (product(shape), ctx.buffers[s].dtype)
        ctx.layout(plan, f"src{k}", d, d + 1)
        plan.tiles.append(part)
        plan.scratch[f"send{k}"] = (product(shape), ctx.buffers[s].dtype)
    plan.attrs["payloads"] = len(srcs)
    if concat:  # absent otherwise: a stacking exchange's plan and module stay as they were
        plan.attrs["concat"] = True
    return plan


@register("reduce_scatter")
def _reduce_scatter(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.ReduceScatter)
    shape = ctx.shape(op.src)
    outer, part = product(shape[: op.dim]), div(product(shape[op.dim :]), ctx.team_w(step))
    via = via_of(step)[0]  # the implicit <step>_recv when the schedule names none
    if op.via is None:  # implicit receive buffer [W, outer * part]
        ctx.add_buffer(via, [W, product([outer, part])], ctx.buffers[op.src].dtype, "symmetric")
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


def _merge_common(ctx: Ctx, step: m.Step, o: str, lse: str, plan: StepPlan) -> StepPlan:
    op: m.LseCombine | m.LseCorrect | m.AllToAllCombine = step.op  # type: ignore[assignment]
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


def _local_merge(cls: type[m.LseCombine] | type[m.LseCorrect]) -> Callable[[Ctx, m.Step], StepPlan]:
    """The rule of a merge on this rank only: ``src: [o, lse]`` into ``dst``."""

    def rule(ctx: Ctx, step: m.Step) -> StepPlan:
        op = typed(step, cls)
        o, lse = op.src
        plan = ctx.plan(
            step,
            params=ctx.engine([o, lse]),
            returns=[op.dst],
            roles={"o": o, "lse": lse, "dst": op.dst},
        )
        if cls is m.LseCorrect:  # o is this rank's partial [*rows, Dv]: rows = lse's [1:]
            n = len(ctx.shape(o))
            ctx.layout(plan, "o", n - len(ctx.shape(lse)) + 1, n - 1, unit=True)
        return _merge_common(ctx, step, o, lse, plan)

    return rule


register("lse_combine")(_local_merge(m.LseCombine))
register("lse_correct")(_local_merge(m.LseCorrect))


@register("all_to_all_combine")
def _all_to_all_combine(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllToAllCombine)
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
    return _merge_common(ctx, step, via_o, via_lse, plan)


@register("copy")
def _copy(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.Copy)
    return ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("numel", product(ctx.shape(op.src)))],
    )


@register("barrier")
def _barrier(ctx: Ctx, step: m.Step) -> StepPlan:
    return ctx.plan(
        step,
        attrs={"peers": "all", "wait_index": step.index, "signal": True, "wait": True},
        signalling=True,
    )


@register("signal")
def _signal(ctx: Ctx, step: m.Step) -> StepPlan:
    return ctx.plan(
        step,
        attrs={"peers": typed(step, m.Signal).to.value, "signal": True, "wait": False},
        signalling=True,
    )


@register("wait")
def _wait(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.Wait)
    return ctx.plan(
        step,
        attrs={"peers": op.from_.value, "signal": False, "wait": True},
        signalling=True,
    )


@register("external")
def _external(ctx: Ctx, step: m.Step) -> StepPlan:
    return ctx.plan(
        step,
        template=None,
        reads=list(typed(step, m.External).reads),
        writes=list(typed(step, m.External).writes),
    )


@register("shift")
def _shift(ctx: Ctx, step: m.Step) -> StepPlan:
    """A direct push of src into the peer's whole dst, one signal (no staging copy). A
    ``phase: wait`` step launches the grid its put launched (same scalars, the put's
    tuning: program i polls the put's program i) and returns dst."""
    from dcpc.ops.shift import delta, matched

    op = typed(step, m.Shift)
    k = delta(op)
    shape = ctx.shape(op.src)
    put = matched(ctx).polls.get(step.name) if op.phase == "wait" else step
    plan = ctx.plan(
        step,
        params=[] if op.phase == "wait" else ctx.engine([op.src]),
        returns=[] if op.phase == "put" else [op.dst],
        roles={"dst": op.dst} if op.phase == "wait" else {"src": op.src, "dst": op.dst},
        scalars=[("rows", shape[0]), ("row_len", product(shape[1:]))],
        tiles=[product(shape[1:])],
        attrs={"offset": k,
               "signal": op.phase != "wait", "wait": op.phase != "put",
               "tune_of": put.name if put is not None else step.name},
        signalling=True,
    )
    if op.phase != "wait":
        ctx.layout(plan, "src", 0, 1)
    return plan


@register("all_reduce")
def _all_reduce(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, ar.AllReduce)
    if op.reduce == "lse":
        return _all_reduce_lse(ctx, step, op)
    return _elementwise(ctx, step, op)


def _elementwise(ctx: Ctx, step: m.Step, op: Any) -> StepPlan:
    """all_reduce (sum, max) and reduce: src pushed whole into via, reduced into dst."""
    assert isinstance(op.src, str)
    shape = ctx.shape(op.src)
    # src seen as [outer, part]: part its last dim (one tile row), outer the rest
    outer, part = product(shape[:-1]), shape[-1]
    via = ar.via_of(step)[0]  # the implicit <step>_recv when the schedule names none
    if op.via is None:  # implicit receive buffer [W, outer * part]
        ctx.add_buffer(via, [W, product([outer, part])], ctx.buffers[op.src].dtype, "symmetric")
    plan = ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "via": via, "dst": op.dst},
        scalars=[("outer", outer), ("part", part)],
        tiles=[part],
        scratch={"acc": (product(shape), "f32")},
        attrs={"reduce": ar.REDUCTIONS.index(op.reduce)},
        signalling=True,
    )
    ctx.output_scale(op, plan)
    return plan


def _all_reduce_lse(ctx: Ctx, step: m.Step, op: ar.AllReduce) -> StepPlan:
    """Push every whole partial [o, lse] into via[rank] of every rank (rows x row_len
    tiles), signal, wait; then lse_combine's merge of via in a second launch."""
    o, lse = op.src
    via_o, via_lse = op.via  # type: ignore[misc]
    plan = ctx.plan(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"src_o": o, "src_lse": lse, "o": via_o, "lse": via_lse, "dst": op.dst},
        scalars=[("push_rows", product(ctx.shape(lse)))],
        attrs={"reduce": ar.REDUCTIONS.index(op.reduce)},
        signalling=True,
    )
    plan.tiles.append(ctx.shape(o)[-1])  # the push's tiles; the merge's are tiles[1]
    return _merge_common(ctx, step, via_o, via_lse, plan)  # type: ignore[arg-type]


@register("broadcast")
def _broadcast(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, bc.Broadcast)
    shape = ctx.shape(op.src)
    return ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("outer", product(shape[:-1])), ("part", shape[-1])],
        tiles=[shape[-1]],
        attrs={"root": op.root},
        signalling=True,
    )


@register("reduce")
def _reduce(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, rd.Reduce)
    plan = _elementwise(ctx, step, op)
    plan.attrs["root"] = op.root
    return plan


# CAST of ragged_all_to_all's kernel: 0 none, 1 quantise per token (the scales travel),
# 2 quantise per tensor, 3 dequantise per token, 4 dequantise per tensor
CAST_MODES = {("quantise", "token"): 1, ("quantise", "tensor"): 2,
              ("dequantise", "token"): 3, ("dequantise", "tensor"): 4}


def _cast_attrs(ctx: Ctx, op: Any) -> dict[str, Any]:
    way = cast.direction(ctx.schedule, op)
    mode = CAST_MODES[(way, op.scale.per)] if way is not None and op.scale is not None else 0
    return {"cast": mode, "scale": op.scale.per if op.scale is not None else None,
            "bf16_out": ctx.buffers[op.dst].dtype == "bf16"}


@register("ragged_all_to_all")
def _ragged_all_to_all(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.RaggedAllToAll)
    shape = ctx.shape(op.src)
    roles = {"src": op.src, "dst": op.dst, "counts": op.counts, "recv_counts": op.recv_counts}
    scale = op.scale.buffer if op.scale is not None else None
    if scale is not None:
        roles["scale"] = scale
    return ctx.plan(
        step,
        params=ctx.engine([op.src, op.counts, scale]),
        returns=[op.dst, op.recv_counts],
        roles=roles,
        scalars=[("cap", shape[1]), ("row_len", product(shape[2:]))],
        tiles=[product(shape[2:])],
        signalling=True,
        attrs={"ragged": True, **_cast_attrs(ctx, op)},
    )


def _cast_move(ctx: Ctx, step: m.Step) -> StepPlan:
    """An all_to_all with a cast (one payload along dim 0, dcpc/ops/cast.py): src seen as
    [W, cap, row_len], every row live: ragged_all_to_all's kernel without counts."""
    op = typed(step, m.AllToAll)
    assert isinstance(op.src, str) and isinstance(op.dst, str) and op.scale is not None
    shape = ctx.shape(op.src)
    row_len = shape[-1]
    return ctx.plan(
        step,
        template="ops/ragged_all_to_all.py.j2",
        params=ctx.engine([op.src, op.scale.buffer]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst, "scale": op.scale.buffer},
        scalars=[("cap", div(product(shape[:-1]), W)), ("row_len", row_len)],
        tiles=[row_len],
        signalling=True,
        attrs={"ragged": False, **_cast_attrs(ctx, op)},
    )


@register("weighted_combine")
def _weighted_combine(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.WeightedCombine)
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
        scalars=[("tokens", ws[0]), ("topk", ws[1]), ("row_len", xs[-1]),
                 ("rows", product(xs[:-1]))],
        tiles=[xs[-1]],
        attrs={"index": op.index is not None},
    )
    ctx.output_scale(op, plan)
    return plan
