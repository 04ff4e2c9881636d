"""Structural checks of ``dcpc check``: every error of a file, in one run.

    check(schedule, worlds) -> list[Diagnostic]

The passes, in order: names (identifiers, duplicates, unknown buffers), buffers
(flag and LSE-dtype rules), sizes (expressions, divisibility, non-positive dims for
every W), ops (per-op shapes, dtypes, dims, symmetric destinations, LSE bases), then
flow (reads of what nothing wrote, signal/wait channels). Each pass appends to one
list; nothing raises for bad input, and nothing from the input is executed.
"""

from __future__ import annotations

from collections.abc import Iterable

from dcpc.check.context import Context, show
from dcpc.check.flow import check_channels, check_reads
from dcpc.check.names import check_buffers, check_names, check_references
from dcpc.check.ops import check_ops
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import expr as ex
from dcpc.lang.model import Schedule
from dcpc.lang.semantics import table
from dcpc.lang.sizes import Samples, size_table, world_diagnostics

DEFAULT_WORLDS = tuple(range(2, 9))


def check(schedule: Schedule, worlds: Iterable[int] = DEFAULT_WORLDS) -> list[Diagnostic]:
    """Every structural error (and warning) of a parsed schedule, sorted by position.

    ``worlds`` are the group sizes W to check sizes and shapes for (e.g. 2..72).
    An empty result means the schedule is structurally clean.
    """
    worlds = sorted(set(worlds))
    bad = [w for w in worlds if not isinstance(w, int) or isinstance(w, bool) or w < 1]
    if bad:
        return [Diagnostic(Mark(schedule.source_file, 0, 0), "bad-world",
                           f"group sizes must be positive integers, not {bad[0]!r}")]
    too_large = check_limits(schedule)
    if too_large:
        return too_large
    table = size_table(schedule)
    found = table.diagnostics + world_diagnostics(schedule, table, worlds)
    samples = Samples(table, sampled_worlds(worlds))
    ctx = Context(schedule, table, samples, schedule.step_list(), out=found)
    check_names(ctx)
    check_references(ctx)
    check_buffers(ctx)
    check_shapes(ctx)
    check_ops(ctx)
    check_reads(ctx)
    check_channels(ctx)
    unique = {(d.mark, d.code, d.message): d for d in ctx.out}
    return sorted(unique.values(), key=lambda d: (d.mark, d.code))


MAX_STEPS = 256
MAX_ACCESSES = 20_000


def check_limits(schedule: Schedule) -> list[Diagnostic]:
    """A schedule past these limits is refused at once: checking it would take minutes
    (docs/language.md, "Limits"); within them `dcpc check` takes seconds."""
    steps = schedule.step_list()
    if len(steps) > MAX_STEPS:
        return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                           f"the schedule has {len(steps)} steps, above the limit of "
                           f"{MAX_STEPS}", hint="split it into several schedules")]
    accesses = sum(len(sem.effects) for sem in table(schedule))
    if accesses > MAX_ACCESSES:
        return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                           f"the steps name buffers {accesses} times in all, above the limit "
                           f"of {MAX_ACCESSES}", hint="split it into several schedules")]
    return []


# Shapes are checked on sampled bindings at every W up to this one (a rack: NVL72)...
EVERY_WORLD_UP_TO = 72
# ... and, above it, at this many group sizes of the range (its largest among them).
WORLDS_ABOVE = 24


def sampled_worlds(worlds: list[int]) -> list[int]:
    """The group sizes the sampled shape checks bind: every W up to 72, then powers
    of two, the largest W and an even spread of the rest (shape questions are
    decided on samples; races and deadlocks are proved for every W, dcpc.check.hb)."""
    low = [w for w in worlds if w <= EVERY_WORLD_UP_TO]
    high = [w for w in worlds if w > EVERY_WORLD_UP_TO]
    if len(high) <= WORLDS_ABOVE:
        return low + high
    picked = {high[-1]} | {w for w in high if w & (w - 1) == 0}
    step = len(high) / max(1, WORLDS_ABOVE - len(picked))
    picked |= {high[int(i * step)] for i in range(WORLDS_ABOVE - len(picked))}
    return low + sorted(picked)


def check_shapes(ctx: Context) -> None:
    """Every dimension of every buffer is a whole, positive number for every W."""
    for name, shape in ctx.table.shapes.items():
        if shape is None:
            continue
        buffer = ctx.schedule.buffers[name]
        for i, dim in enumerate(shape):
            mark = buffer.mark(f"shape[{i}]")
            example = ctx.samples.inexact(dim)
            if example is not None:
                ctx.error(mark, "inexact-division",
                          f"{example.detail} is not a whole number for W={example.world}"
                          + (f" ({example.names([dim])})" if example.names([dim]) else "")
                          + f" in dimension {i} of buffer '{name}'",
                          hint="declare the size with 'multiple_of', e.g. "
                          "'H: {multiple_of: W}', or narrow the W range")
                continue
            example = ctx.samples.nonpositive(dim)
            if example is not None:
                where = example.names([dim])
                ctx.error(mark, "nonpositive-dim",
                          f"dimension {i} of buffer '{name}' {show([dim])} is {example.detail} "
                          f"for W={example.world}" + (f" ({where})" if where else "")
                          + "; dimensions must be positive")
            elif dim[0] == "num" and dim[1] > 1 << 40:
                ctx.error(mark, "nonpositive-dim",
                          f"dimension {i} of buffer '{name}' is {ex.unparse(dim)}, far beyond "
                          "any memory", severity="warning")
