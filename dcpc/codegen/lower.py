"""Stage 4, lower: ``Schedule`` -> ``Plan``, one lowering rule per op.

Rules live in ``LOWERINGS`` keyed by op name (JAX's register_lowering style): a rule
gets a ``Ctx`` and the step and returns its ``StepPlan``. Adding an op = one model
class, one rule here, one template under templates/ops/, one test.

Every rule views its buffers through canonical factors (products of shape ASTs), so
that one kernel template serves every layout: e.g. an all_gather along ``dim`` sees
``src`` as ``[outer, rows, row_len]`` and ``dst`` as ``[outer, W * rows, row_len]``.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import dcpc
from dcpc.codegen.plan import BufferPlan, Expr, Plan, SizePlan, StepPlan
from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark
from dcpc.lang import expr as ex
from dcpc.lang import model as m

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Names the generated class, its methods' locals or its imports already use.
RESERVED = frozenset(
    {
        "self",
        "slot",
        "sizes",
        "env",
        "tune",
        "torch",
        "triton",
        "tl",
        "close",
        "buffer",
        "check_errors",
        "group",
        "rank",
        "world",
        "device",
        "backend",
        "spin_limit",
        "poison",
        "outer",
        "rows",
        "row_len",
        "interleave",
        "part",
        "group_rows",
        "batch",
        "numel",
        "part_rows",
    }
)
# Launch defaults, from benchmarks/tune_gpu.py on 2xH200 (benchmarks/results/tuning.md):
# 4 warps, 4096-element tiles (2048 for the fused exchange+merge); the grid shrinks with
# the call's tiles (dcpc.runtime.module.ScheduleModule._grid) up to `programs`.
# `programs` is capped at 64, not the sweep's faster 128: the kernels of both slots
# must be co-resident on a GPU (a program spins on its peer's twin), and two slots of
# 128-program fused kernels hung a two-stream (DBO) run at H=96, T=64.
DEFAULT_TUNING = {"programs": 64, "num_warps": 4, "block": 4096}
OP_TUNING = {"all_to_all_combine": {"block": 2048}}
SERIAL_PROGRAMS = 128  # one slot (or one stream): the sweep's best for large payloads
SYNC_TUNING = {"programs": 1, "num_warps": 1, "block": 1}
W: Expr = ("sym", "W")
ONE: Expr = ("num", 1)


def product(exprs: Iterable[Expr]) -> Expr:
    """The product of shape ASTs (constants folded, 1 when empty)."""
    const, syms = 1, []
    for e in exprs:
        if e[0] == "num":
            const *= e[1]
        else:
            syms.append(e)
    out: Expr | None = ("num", const) if const != 1 or not syms else None
    for e in syms:
        out = e if out is None else ("*", out, e)
    assert out is not None
    return out


def div(a: Expr, b: Expr) -> Expr:
    return ("/", a, b)


class Ctx:
    """What a rule may look at: the schedule, its buffers (as plans) and its steps."""

    def __init__(self, schedule: m.Schedule, buffers: dict[str, BufferPlan]):
        self.schedule = schedule
        self.buffers = buffers
        self.steps = schedule.step_list()
        self.errors: list[Diagnostic] = []

    def shape(self, name: str) -> list[Expr]:
        return self.buffers[name].shape

    def engine(self, names: Iterable[str | None]) -> list[str]:
        """The engine-owned buffers among ``names``: a method's arguments."""
        out: list[str] = []
        for n in names:
            if n is not None and self.buffers[n].kind == "engine" and n not in out:
                out.append(n)
        return out

    def base(self, op: Any, lse: str) -> str:
        return getattr(op, "lse_base", None) or self.buffers[lse].lse_base or "e"

    def fail(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None:
        self.errors.append(Diagnostic(mark, code, message, hint))


Rule = Callable[[Ctx, m.Step], StepPlan]
LOWERINGS: dict[str, Rule] = {}


def register(op: str) -> Callable[[Rule], Rule]:
    def deco(rule: Rule) -> Rule:
        LOWERINGS[op] = rule
        return rule

    return deco


OpT = TypeVar("OpT", bound=m.OpBase)


def typed(step: m.Step, cls: type[OpT]) -> OpT:
    """The step's op as the model class its rule is registered for."""
    assert isinstance(step.op, cls), (step.name, type(step.op).__name__)
    return step.op


def _step(step: m.Step, **kw: Any) -> StepPlan:
    return StepPlan(step.name, step.index, step.kind, f"ops/{step.kind}.py.j2", step.op.doc, **kw)


def _mask(ctx: Ctx, op: Any, plan: StepPlan) -> None:
    """Roles, scalars and statics of ``mask_empty`` (empty shards and padding rows)."""
    mask = op.mask_empty
    plan.attrs["mask"] = mask is not None
    plan.attrs["mask_interleave"] = mask.interleave if mask else 1
    if mask is None:
        return
    plan.roles["seq_lens"], plan.roles["query_start_loc"] = mask.seq_lens, mask.query_start_loc
    plan.params += [n for n in ctx.engine([mask.seq_lens, mask.query_start_loc])]
    plan.scalars.append(("batch", ctx.shape(mask.seq_lens)[0]))
    plan.statics["batch"] = ctx.shape(mask.seq_lens)[0]


@register("all_gather")
def _all_gather(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllGather)
    src, dst = ctx.shape(op.src), ctx.shape(op.dst)
    d = op.dim
    stack = len(dst) == len(src) + 1
    outer = product(src[:d])
    if stack:
        rows, row_len, interleave = ONE, product(src[d:]), ONE
    else:
        rows, row_len = src[d], product(src[d + 1 :])
        interleave = ("num", op.interleave) if op.interleave else rows
    return _step(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[
            ("outer", outer),
            ("rows", rows),
            ("row_len", row_len),
            ("interleave", interleave),
        ],
        tiles=[row_len],
        scratch={"stage": (product([W, *src]), ctx.buffers[op.src].dtype)},
        attrs={"stack": stack},
        signalling=True,
    )


@register("all_to_all")
def _all_to_all(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.AllToAll)
    srcs = op.src if isinstance(op.src, list) else [op.src]
    dsts = op.dst if isinstance(op.dst, list) else [op.dst]
    plan = _step(step, params=ctx.engine(srcs), returns=list(dsts), signalling=True)
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        shape = ctx.shape(s)
        plan.roles[f"src{k}"], plan.roles[f"dst{k}"] = s, t
        part = div(product(shape[op.dim :]), W)
        plan.scalars += [(f"outer{k}", product(shape[: op.dim])), (f"part{k}", part)]
        plan.tiles.append(part)
        plan.scratch[f"send{k}"] = (product(shape), ctx.buffers[s].dtype)
    plan.attrs["payloads"] = len(srcs)
    return plan


@register("reduce_scatter")
def _reduce_scatter(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.ReduceScatter)
    shape = ctx.shape(op.src)
    outer, part = product(shape[: op.dim]), div(product(shape[op.dim :]), W)
    via = op.via or f"{step.name}_via"
    if op.via is None:  # implicit receive buffer [W, outer * part]
        ctx.buffers[via] = BufferPlan(
            via, [W, product([outer, part])], ctx.buffers[op.src].dtype, "symmetric"
        )
    return _step(
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
    return plan


@register("lse_combine")
def _lse_combine(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.LseCombine)
    o, lse = op.src
    plan = _step(
        step,
        params=ctx.engine([o, lse]),
        returns=[op.dst],
        roles={"o": o, "lse": lse, "dst": op.dst},
    )
    return _merge_common(ctx, step, o, lse, plan)


@register("lse_correct")
def _lse_correct(ctx: Ctx, step: m.Step) -> StepPlan:
    op = typed(step, m.LseCorrect)
    o, lse_all = op.src
    plan = _step(
        step,
        params=ctx.engine([o, lse_all]),
        returns=[op.dst],
        roles={"o": o, "lse": lse_all, "dst": op.dst},
    )
    return _merge_common(ctx, step, o, lse_all, plan)


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
            ("part_rows", div(product(shape[op.dim :]), W)),
        ],
        scratch={
            "send_o": (product(ctx.shape(o)), ctx.buffers[o].dtype),
            "send_lse": (product(shape), ctx.buffers[lse].dtype),
        },
        signalling=True,
    )
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
    match = [
        s for s in ctx.steps if s.kind == "signal" and typed(s, m.Signal).channel == op.channel
    ]
    if not match:
        ctx.fail(
            op.mark("channel"),
            "unmatched-wait",
            f"wait '{step.name}' names channel '{op.channel}', which no signal step uses",
            "add a signal step with the same channel before it",
        )
        return _step(step)
    return _step(
        step,
        attrs={
            "peers": op.from_.value,
            "signal": False,
            "wait": True,
            "signal_index": match[0].index,
        },
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


def _buffers(schedule: m.Schedule) -> dict[str, BufferPlan]:
    written: set[str | None] = set()
    for step in schedule.step_list():
        if step.kind != "external":
            for key in ("dst", "return_lse"):
                value = getattr(step.op, key, None)
                written.update(value if isinstance(value, list) else [value])
    out = {}
    for name, b in schedule.buffers.items():
        kind = (
            "shared"
            if b.shared
            else "symmetric"
            if b.symmetric
            else ("output" if name in written else "engine")
        )
        out[name] = BufferPlan(
            name, [ex.parse(d) for d in b.shape], b.dtype.value, kind, b.lse_base
        )
    return out


def _sizes(schedule: m.Schedule) -> list[SizePlan]:
    out = []
    for name, spec in schedule.sizes.items():
        if isinstance(spec, int):
            out.append(SizePlan(name, "const", spec))
        elif spec.max is not None:
            out.append(SizePlan(name, "max", spec.max))
        else:
            assert spec.multiple_of is not None  # the model requires max or multiple_of
            out.append(SizePlan(name, "multiple_of", None, ex.parse(spec.multiple_of)))
    return out


def _check_names(ctx: Ctx) -> None:
    s = ctx.schedule
    if not IDENT.match(s.schedule) or keyword.iskeyword(s.schedule):
        ctx.fail(s.mark("schedule"), "identifier", f"'{s.schedule}' is not an identifier")
    for name in s.buffers:
        if not IDENT.match(name) or keyword.iskeyword(name) or name in RESERVED:
            ctx.fail(
                s.mark(f"buffers/{name}", of_key=True),
                "reserved-name",
                f"buffer name '{name}' cannot be a Python argument of the generated "
                "module (not an identifier, a keyword or a reserved name)",
                f"rename it, e.g. '{name}_buf'" if IDENT.match(name) else None,
            )
    for step in ctx.steps:
        if (
            not IDENT.match(step.name)
            or keyword.iskeyword(step.name)
            or step.name in RESERVED
            or step.name.startswith("_")
        ):
            ctx.fail(
                step.mark(),
                "reserved-name",
                f"step name '{step.name}' cannot be a method of the generated class",
                f"rename it, e.g. '{step.name.strip('_')}_step'",
            )


def _contract(plan_steps: list[StepPlan], slots: int, streams: str) -> list[str]:
    order = " -> ".join(f"[{s.name}]" if s.op == "external" else f"{s.name}()" for s in plan_steps)
    lines = [
        f"per call, on every rank, in this order: {order}",
        "[bracketed] steps are the engine's own kernels, run between those calls",
        "every rank makes the same calls, in the same order, with the same sizes",
        f"call i uses slot=i % {slots}" if slots > 1 else "there is one slot: slot=0",
    ]
    if streams == "per_slot":
        lines.append(
            "streams: per_slot: a slot's calls are ordered on one stream; slots may overlap"
        )
    else:
        lines.append("streams: single: every call runs on one stream, one after another")
    for s in plan_steps:
        if s.op == "external":
            lines.append(
                f"{s.name} reads {', '.join(s.reads) or 'nothing'}; "
                f"writes {', '.join(s.writes) or 'nothing'}"
            )
    return lines


def lower(schedule: m.Schedule, worlds: Iterable[int]) -> Plan:
    """Lower a checked schedule to a kernel plan (raises DiagnosticError if it cannot)."""
    ctx = Ctx(schedule, _buffers(schedule))
    _check_names(ctx)
    steps = []
    for step in ctx.steps:
        plan = LOWERINGS[step.kind](ctx, step)
        if plan.template is not None and not plan.tuning:
            plan.tuning = {**DEFAULT_TUNING, **OP_TUNING.get(step.kind, {})}
            if schedule.slots == 1 or schedule.streams == m.Streams.single:
                plan.tuning["programs"] = SERIAL_PROGRAMS  # no other slot's kernels in flight
        steps.append(plan)
    if ctx.errors:
        raise DiagnosticError(ctx.errors)
    name = schedule.schedule
    return Plan(
        schedule=name,
        class_name="".join(part[:1].upper() + part[1:] for part in name.split("_")),
        version=dcpc.__version__,
        source_sha256=schedule.source_sha256,
        source_name=schedule.source_file.replace("\\", "/").rsplit("/", 1)[-1],
        worlds=sorted(set(worlds)),
        slots=schedule.slots,
        streams=schedule.streams.value,
        doc=schedule.doc,
        sizes=_sizes(schedule),
        buffers=list(ctx.buffers.values()),
        steps=steps,
        contract=_contract(steps, schedule.slots, schedule.streams.value),
    )
