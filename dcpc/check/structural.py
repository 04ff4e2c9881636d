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
    table = size_table(schedule)
    found = table.diagnostics + world_diagnostics(schedule, table, worlds)
    samples = Samples(table, worlds)
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
