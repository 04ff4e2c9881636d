"""What a lowering rule may use: ``Ctx``, the rule table ``LOWERINGS`` and ``register``,
the shape-AST helpers (``W``, ``ONE``, ``product``, ``div``, ``team_w``) and the launch
defaults.

Below both dcpc/codegen/rules.py (the rules, which import this) and
dcpc/codegen/lower.py (the driver, which imports the rules), so neither imports the
other back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dcpc.codegen.plan import BufferPlan, Expr, StepPlan
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import model as m
from dcpc.lang.mesh import mesh_of

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


def team_w(ctx: Ctx, step: m.Step) -> Expr:
    """The size of a step's team (dcpc.lang.mesh): what a team op splits its parts by."""
    return mesh_of(ctx.schedule).team_size(step.op)


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
