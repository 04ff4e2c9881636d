"""What every op does, written once: its buffer effects and its synchronisation.

    semantics(schedule, step) -> Semantics(effects, sync)
    table(schedule) -> [Semantics]           (every step, in program order)
    channels(schedule) -> Channels          (which signal step each wait polls)

Every stage reads this table and nothing else: the dataflow graph (dcpc.graph), the
read-before-write check (dcpc.check.flow), the lowering (dcpc.codegen), which copies
the effects and the sync into the plan, and the happens-before checker and the
execution oracle, which analyse that plan (the exact signal slots and epochs the
kernels use). Each op's rule is defined with the rest of the op, in its module under
dcpc/ops/ (``OpDef.semantics``); what the rules share (``Effect``, ``Region``,
``Sync``, ``Scope``, ``channels``) is in dcpc/ops/common.py. This module is the
stages' view of them.
"""

from __future__ import annotations

import re

from dcpc.lang import model as m
from dcpc.ops import OPS
from dcpc.ops.all_to_all_combine import self_copy  # noqa: F401  (re-exported)
from dcpc.ops.common import (  # noqa: F401  (re-exported: the stages import them from here)
    AFTER,
    BEFORE,
    REACHES,
    READ,
    WRITE,
    ChannelError,
    Channels,
    Effect,
    Region,
    Rule,
    Scope,
    Semantics,
    Sync,
    channels,
    effect_mark,
    on_team,
)
from dcpc.ops.reduce_scatter import via_of  # noqa: F401  (re-exported)

# One rule per op, read from the op registry (the rules themselves live in dcpc/ops/).
RULES: dict[str, Rule] = {name: op.semantics for name, op in OPS.items()}


def semantics(schedule: m.Schedule, step: m.Step) -> Semantics:
    """The effects and the sync of one step (its op's rule)."""
    return on_team(schedule, step, OPS[step.kind].semantics(Scope(schedule), step))


def table(schedule: m.Schedule, known: list[Semantics] | None = None) -> list[Semantics]:
    """The semantics of every step, by step index (program order).

    The pipeline makes it once per schedule, in its parse stage
    (``Compilation.semantics``), and hands it to the stages that read it, which pass it
    here as ``known`` (returned as is); called without it (tests, the hints' edited
    schedules) it is made anew."""
    if known is not None:
        # one entry per step of step_list(), which numbers an item of two steps (or
        # none, both the checker's bad-step) consecutively: not len(schedule.steps)
        assert len(known) == len(schedule.step_list()), (len(known), schedule.schedule)
        return known
    scope = Scope(schedule)
    return [on_team(schedule, step, OPS[step.kind].semantics(scope, step))
            for step in scope.steps]


def describe(sem: Semantics) -> tuple[str, str, str]:
    """One step's semantics in words, by the keys that name its buffers (a list's items
    as one key), each key once: (before its signal, after its wait, its sync).
    docs/language.md's generated op table is made of these (tests/cli/test_docs.py), so
    the table and the ops' rules cannot drift."""

    def region(e: Effect) -> str:
        r = e.region
        if r is None:
            return ""
        part = {"block": "block `r` along a dim", "index": "index `r` of a dim",
                "interleave": "rows of `r`, interleaved",
                "peer": f"rank r{r.offset:+d}'s, whole",
                "line": f"rank r{r.offset:+d}'s, whole, when it is a rank",
                "perm": "rank perm(r)'s, whole, when r is a source",
                "root": "whole, as the root's broadcast",
                "whole": "whole, read by `r`"}[r.scheme]
        if r.scheme in ("peer", "line", "perm"):
            return f" ({part})"
        if r.peer is not None:  # a ragged_all_to_all by offset: one peer's instance
            whose = f"rank r{r.peer:+d}'s" if r.peer else "its own"
            return f" ({whose}: {part})"
        return f" ({'the root' if e.root is not None else 'every rank'}: {part})"

    def one(e: Effect) -> str:
        key = re.sub(r"\[\d+\]", "", e.key) or "an implicit buffer"
        lands = ", landing at its wait" if e.lands is not None else ""
        return f"{e.kind}s {key}{region(e)}{lands}" + (" (either phase)" if e.either else "")

    def phase(when: str) -> str:
        out: list[str] = []
        for e in sem.effects:
            if e.when == when and one(e) not in out:
                out.append(one(e))
        return "; ".join(out) or "-"

    s = sem.sync
    # a perm's peers are a table of one W: in words, the same for every perm
    signal = "perm(r)" if (s.signal or "").startswith("perm:") else s.signal
    wait = "perm^-1(r)" if (s.wait or "").startswith("perm:") else s.wait
    sync = "-" if s.signal is None and s.wait is None else (
        f"signals {signal or '-'}, waits {wait or '-'}")
    return phase(BEFORE), phase(AFTER), sync
