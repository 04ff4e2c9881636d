"""The lowering rules, one per op: ``@register("op")`` puts a rule in ``LOWERINGS``.

The op itself (model, semantics, verifier, float64 reference) is defined in
dcpc/ops/<op>.py; its Triton lowering is registered here against the same name
(docs/internals.md says why it stays in the codegen package).

A rule gets the lowering context and the step and returns the step's ``StepPlan``;
its template is ``templates/ops/<op>.py.j2``. See dcpc/codegen/lower.py for the
driver and the canonical-factor convention the rules follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from dcpc.codegen.lower import (
    ONE,
    SYNC_TUNING,
    Ctx,
    W,
    div,
    product,
    register,
    team_w,
)
from dcpc.codegen.plan import BufferPlan, StepPlan
from dcpc.lang import model as m
from dcpc.ops.all_to_all_combine import self_copy
from dcpc.ops.common import Scope
from dcpc.ops.reduce_scatter import via_of
from dcpc.ops.registry import names

OpT = TypeVar("OpT", bound=m.OpBase)


def typed(step: m.Step, cls: type[OpT]) -> OpT:
    """The step's op as the model class its rule is registered for."""
    assert isinstance(step.op, cls), (step.name, type(step.op).__name__)
    return step.op


def _step(step: m.Step, **kw: Any) -> StepPlan:
    return StepPlan(step.name, step.index, step.kind, f"ops/{step.kind}.py.j2", step.op.doc, **kw)


def _layout(ctx: Ctx, plan: StepPlan, role: str, a: int, b: int, unit: bool = False) -> None:
    """The kernel addresses ``role``'s buffer as axes dims[:a], dims[a:b], dims[b:], one
    stride each. An engine buffer's strides come from the tensor passed in (checked and
    read once per call by dcpc.runtime.validate); a module-owned one's are packed."""
    plan.layouts[role] = (a, b, unit)
    name = plan.roles[role]
    if ctx.buffers[name].kind != "engine":
        shape = ctx.shape(name)
        plan.scalars += [
            (f"{role}_s0", product(shape[a:])),
            (f"{role}_s1", product(shape[b:])),
            (f"{role}_s2", ONE),
        ]


def _mask(ctx: Ctx, op: Any, plan: StepPlan) -> None:
    """Roles, scalars and statics of ``mask_empty`` (empty shards and padding rows)."""
    mask = op.mask_empty
    plan.attrs["mask"] = mask is not None
    # the kernels' INTERLEAVE: >= 1 for full lengths, 0 for local ones ([B, W])
    local = mask is not None and mask.local_seq_lens is not None
    plan.attrs["mask_interleave"] = 0 if local else (mask.interleave if mask else 1)
    if mask is None:
        return
    plan.roles["seq_lens"], plan.roles["query_start_loc"] = mask.lengths, mask.query_start_loc
    plan.params += [n for n in ctx.engine([mask.lengths, mask.query_start_loc])]
    plan.scalars.append(("batch", ctx.shape(mask.lengths)[0]))
    plan.statics["batch"] = ctx.shape(mask.lengths)[0]


def _scale(ctx: Ctx, op: Any, plan: StepPlan) -> None:
    """``output_scale``: dst = clamp(out / scale[0]) (an fp8 output)."""
    scale = getattr(op, "output_scale", None)
    plan.attrs["scale"] = scale is not None
    if scale is not None:
        plan.roles["out_scale"] = scale
        plan.params += [n for n in ctx.engine([scale]) if n not in plan.params]


@register("all_gather")
def _all_gather(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllGather)
    srcs, dsts = names(op.src), names(op.dst)
    plan = _step(step, params=ctx.engine(srcs), returns=list(dsts), signalling=True)
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
        _layout(ctx, plan, f"src{p}", d, min(d + 1, len(src)))
        stacks.append(stack)
    plan.attrs["payloads"] = [("" if k == 0 else str(k), stack) for k, stack in enumerate(stacks)]
    return plan


@register("all_to_all")
def _all_to_all(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllToAll)
    srcs = op.src if isinstance(op.src, list) else [op.src]
    dsts = op.dst if isinstance(op.dst, list) else [op.dst]
    plan = _step(step, params=ctx.engine(srcs), returns=list(dsts), signalling=True)
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        shape = ctx.shape(s)
        plan.roles[f"src{k}"], plan.roles[f"dst{k}"] = s, t
        part = div(product(shape[op.dim :]), team_w(ctx, step))
        plan.scalars += [
            (f"outer{k}", product(shape[: op.dim])),
            (f"part{k}", part),
            (f"inner{k}", product(shape[op.dim + 1 :])),
        ]
        _layout(ctx, plan, f"src{k}", op.dim, op.dim + 1)
        plan.tiles.append(part)
        plan.scratch[f"send{k}"] = (product(shape), ctx.buffers[s].dtype)
    plan.attrs["payloads"] = len(srcs)
    return plan


@register("reduce_scatter")
def _reduce_scatter(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.ReduceScatter)
    shape = ctx.shape(op.src)
    outer, part = product(shape[: op.dim]), div(product(shape[op.dim :]), team_w(ctx, step))
    via = via_of(step)[0]  # the implicit <step>_recv when the schedule names none
    if op.via is None:  # implicit receive buffer [W, outer * part]
        ctx.buffers[via] = BufferPlan(
            via, [W, product([outer, part])], ctx.buffers[op.src].dtype, "symmetric"
        )
    plan = _step(
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
    _scale(ctx, op, plan)
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
    _mask(ctx, op, plan)
    _scale(ctx, op, plan)
    return plan


def _local_merge(cls: type[m.LseCombine] | type[m.LseCorrect]) -> Callable[[Ctx, m.Step], StepPlan]:
    """The rule of a merge on this rank only: ``src: [o, lse]`` into ``dst``."""

    def rule(ctx: Ctx, step: m.Step) -> StepPlan:
        op = typed(step, cls)
        o, lse = op.src
        plan = _step(
            step,
            params=ctx.engine([o, lse]),
            returns=[op.dst],
            roles={"o": o, "lse": lse, "dst": op.dst},
        )
        if cls is m.LseCorrect:  # o is this rank's partial [*rows, Dv]: rows = lse's [1:]
            n = len(ctx.shape(o))
            _layout(ctx, plan, "o", n - len(ctx.shape(lse)) + 1, n - 1, unit=True)
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
    plan = _step(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"src_o": o, "src_lse": lse, "o": via_o, "lse": via_lse, "dst": op.dst},
        scalars=[
            ("outer", product(shape[: op.dim])),
            ("part_rows", div(product(shape[op.dim :]), team_w(ctx, step))),
        ],
        scratch={
            "send_o": (product(ctx.shape(o)), ctx.buffers[o].dtype),
            "send_lse": (product(shape), ctx.buffers[lse].dtype),
        },
        signalling=True,
    )
    _layout(ctx, plan, "src_o", op.dim, len(ctx.shape(o)) - 1, unit=True)
    _layout(ctx, plan, "src_lse", op.dim, len(shape))
    # The own part need not travel through via[RANK] unless another step reads via.
    plan.attrs["self_copy"] = self_copy(Scope(ctx.schedule), step)
    return _merge_common(ctx, step, via_o, via_lse, plan)


@register("copy")
def _copy(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.Copy)
    return _step(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("numel", product(ctx.shape(op.src)))],
    )


@register("barrier")
def _barrier(ctx: Ctx, step: m.Step) -> StepPlan:
    return _step(
        step,
        attrs={"peers": "all", "wait_index": step.index, "signal": True, "wait": True},
        tuning=dict(SYNC_TUNING),
        signalling=True,
    )


@register("signal")
def _signal(ctx: Ctx, step: m.Step) -> StepPlan:
    return _step(
        step,
        attrs={"peers": typed(step, m.Signal).to.value, "signal": True, "wait": False},
        tuning=dict(SYNC_TUNING),
        signalling=True,
    )


@register("wait")
def _wait(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.Wait)
    return _step(
        step,
        attrs={"peers": op.from_.value, "signal": False, "wait": True},
        tuning=dict(SYNC_TUNING),
        signalling=True,
    )


@register("external")
def _external(ctx: Ctx, step: m.Step) -> StepPlan:
    return StepPlan(
        step.name,
        step.index,
        "external",
        None,
        step.op.doc,
        reads=list(typed(step, m.External).reads),
        writes=list(typed(step, m.External).writes),
    )
