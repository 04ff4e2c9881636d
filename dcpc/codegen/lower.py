"""Stage 4, lower: ``Schedule`` -> ``Plan``, one lowering rule per op.

Rules live in ``LOWERINGS`` keyed by op name (JAX's register_lowering style): a rule
gets a ``Ctx`` and the step and returns its ``StepPlan``. Adding an op = one model
class, one rule in rules.py, one template under templates/ops/, one test.

Every rule views its buffers through canonical factors (products of shape ASTs), so
that one kernel template serves every layout: e.g. an all_gather along ``dim`` sees
``src`` as ``[outer, rows, row_len]`` and ``dst`` as ``[outer, W * rows, row_len]``.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable, Iterable
from typing import Any

import dcpc
from dcpc.codegen.plan import BufferPlan, Expr, Plan, SizePlan, StepPlan
from dcpc.diagnostics import Diagnostic, DiagnosticError, Mark
from dcpc.lang import expr as ex
from dcpc.lang import model as m
from dcpc.lang.semantics import table

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
# 4 warps, 4096-element tiles (2048 for the fused exchange+merge), at most 128 programs;
# a call with fewer tiles than that gets shorter tiles and fewer programs
# (dcpc.runtime.module.ScheduleModule._launch). Both slots' kernels must be co-resident
# (a program spins on its peer's twin): 2 x 128 programs of 4 warps fit an H200 (132
# SMs) several times over, and two slots on two streams at 128 ran clean on 2xH200.
DEFAULT_TUNING = {"programs": 128, "num_warps": 4, "block": 4096}
OP_TUNING = {"all_to_all_combine": {"block": 2048}}
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


# The rules register themselves in LOWERINGS on import.
from dcpc.codegen import rules as _rules  # noqa: E402,F401


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
    semantics = table(schedule)
    steps = []
    for step in ctx.steps:
        plan = LOWERINGS[step.kind](ctx, step)
        if plan.template is not None and not plan.tuning:
            plan.tuning = {**DEFAULT_TUNING, **OP_TUNING.get(step.kind, {})}
        plan.effects = list(semantics[step.index].effects)
        plan.sync = semantics[step.index].sync  # polls None: a wait nothing signals (emit refuses)
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
