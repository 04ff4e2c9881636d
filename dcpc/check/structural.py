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
from dcpc.check.mesh import check_mesh, mesh_diagnostics
from dcpc.check.names import check_buffers, check_names, check_references
from dcpc.check.ops import check_ops
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import expr as ex
from dcpc.lang.loops import MAX_STEPS
from dcpc.lang.mesh import MeshWorld, WorldError, fit_worlds, mesh_of
from dcpc.lang.model import AllGather, Schedule, Streams
from dcpc.lang.nodes import Step
from dcpc.lang.questions import Samples
from dcpc.lang.semantics import table
from dcpc.lang.sizes import MAX_SIZE, size_table, world_diagnostics
from dcpc.ops.registry import names

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
    broken = mesh_diagnostics(schedule)  # every later check reads W through the mesh
    if broken:
        return broken
    try:
        worlds = sorted(set(fit_worlds(mesh_of(schedule), worlds)))
    except WorldError as err:
        return [Diagnostic(schedule.mark("mesh") if schedule.mesh is not None
                           else Mark(schedule.source_file, 0, 0), "bad-world", str(err))]
    too_large = check_limits(schedule, worlds)
    if too_large:
        return too_large
    table = size_table(schedule)
    found = table.diagnostics + world_diagnostics(schedule, table, worlds)
    samples = Samples(table, worlds)
    ctx = Context(schedule, table, samples, schedule.step_list(), out=found)
    check_names(ctx)
    check_mesh(ctx)
    check_references(ctx)
    check_buffers(ctx)
    check_shapes(ctx)
    check_ops(ctx)
    check_interleave(ctx)
    check_reads(ctx)
    check_channels(ctx)
    unique = {(d.mark, d.code, d.message): d for d in ctx.out}
    return sorted(unique.values(), key=lambda d: (d.mark, d.code))


MAX_ACCESSES = 20_000


# The happens-before analysis computes, for every W it analyses, a clock of W entries
# per event of the calls it unrolls (copies of slot 0 cost nothing). A ring of many
# next/prev waits raises the world bound, below which every W is analysed: 127 hops
# analyse every W up to 511 (67 million entries). The limit keeps the largest analysis
# it admits near 1 s of CPU on this project's 2-core machine (a ring of 256 steps with
# 28 next waits at --world 2..1024: issue 31), so a check answers within 2 s on a
# loaded machine. A mesh's entries cost MESH_COST plain ones: its clocks are translated
# by permutations of the torus, a plain W's by rotations (list slices).
MAX_HB_WORK = 4_000_000
MESH_COST = 4


def check_limits(schedule: Schedule, worlds: list[int] | None = None) -> list[Diagnostic]:
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
    return _hb_work(schedule, steps, worlds or [])


def hb_calls(slots: int, per_slot_streams: bool) -> int:
    """The calls per rank whose clocks the happens-before checker computes: 2 with
    per-slot streams (the other slots' calls are copies), else 2 * slots."""
    return 2 if per_slot_streams and slots > 1 else 2 * slots


def hb_work(worlds: list[int], steps: int, calls: int) -> int:
    """The clock entries of analysing ``worlds`` (those the checker analyses) for a
    program of ``steps`` steps and ``calls`` computed calls: the limit's measure."""
    return sum(int(w) * (MESH_COST if isinstance(w, MeshWorld) else 1)
               for w in worlds) * steps * calls


def _hb_work(schedule: Schedule, steps: list, worlds: list[int]) -> list[Diagnostic]:
    # the world bounds and representatives the checker itself uses (hb imports this
    # module, hence imported here)
    from dcpc.check.hb.checker import bound_for, mesh_representatives, representatives
    from dcpc.ops.common import ring_hops

    sems = table(schedule)
    calls = 2 * schedule.slots
    worlds = sorted(worlds)
    if schedule.mesh is None:
        ring = sum(ring_hops(sem.sync.wait) for sem in sems)
        bound = bound_for(ring, calls)
        analysed = representatives(worlds, bound)
        upto = f"every W up to {bound}"
    else:  # each axis' bound from the next/prev waits along it alone (axis_bounds)
        every = tuple(range(len(schedule.mesh)))
        hops = [sum(ring_hops(sem.sync.wait) for sem in sems
                    if (sem.sync.axes if sem.sync.axes is not None else every) == (a,))
                for a in every]
        ring = sum(hops)
        bounds = [bound_for(h, calls) for h in hops]
        analysed = mesh_representatives(worlds, bounds)
        upto = "every axis size up to " + "x".join(map(str, bounds))
    work = hb_work(analysed, len(steps),
                   hb_calls(schedule.slots, schedule.streams == Streams.per_slot))
    if work <= MAX_HB_WORK:
        return []
    raised = f", raised by {ring} next/prev waits per call" if ring > 0 else ""
    return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                       f"the happens-before checker would analyse {len(analysed)} group "
                       f"sizes ({upto}{raised}) of {len(steps)} steps: "
                       f"{work} clock entries, above the limit of {MAX_HB_WORK}",
                       hint="check a narrower --world range, or use fewer ring hops (a "
                       "'from: all' wait orders every rank at once), steps or slots")]


def check_shapes(ctx: Context) -> None:
    """Every dimension of every buffer is a whole, positive number for every W."""
    for name, shape in ctx.table.shapes.items():
        if shape is None:
            continue
        buffer = ctx.schedule.buffers[name]
        for i, dim in enumerate(shape):
            mark = buffer.mark(f"shape[{i}]")
            example = ctx.samples.inexact(dim) or ctx.samples.nonpositive(dim)
            if example is not None and example.undecided:
                ctx.error(mark, "shape-undecided",
                          f"dimension {i} of buffer '{name}' {show([dim])} cannot be checked "
                          f"for every binding of its sizes: {example.detail}",
                          hint="write it as a simpler expression of the sizes (a product "
                          "of sizes and small sums), or lower the 'max' of its sizes")
                continue
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


def check_interleave(ctx: Context) -> None:
    """A gather's ``interleave: I`` must divide its rows for every binding (row j of
    rank r lands at (j // I) * W * I + r * I + j % I, inside dst only then), and a
    mask's interleave fits the kernels' 32-bit integers."""
    for step in ctx.steps:
        op = step.op
        mask = getattr(op, "mask_empty", None)
        if mask is not None and mask.interleave > MAX_SIZE:
            ctx.error(mask.mark("interleave"), "bad-interleave",
                      f"interleave {mask.interleave} of step '{step.name}' is above the "
                      f"largest size {MAX_SIZE} (2**31-1)",
                      hint="use the engine's KV interleave size (1 when tokens are "
                      "round-robin)")
        if not isinstance(op, AllGather) or op.interleave is None:
            continue
        srcs, dsts = names(op.src), names(op.dst)
        if len(srcs) != len(dsts):
            continue  # the op's own checks report it
        for src_name, dst_name in zip(srcs, dsts, strict=True):
            _check_interleave_rows(ctx, step, op, src_name, dst_name)


def _check_interleave_rows(ctx: Context, step: Step, op: AllGather, src_name: str,
                           dst_name: str) -> None:
    """One payload of an interleaved gather: ``interleave`` divides src's rows."""
    src, dst = ctx.shape(src_name), ctx.shape(dst_name)
    if not src or dst is None or len(src) != len(dst) or op.dim % len(src) != 0:
        return  # no rows to split: the op's own checks report it
    rows = src[0]
    example = ctx.samples.inexact(("/", rows, ("num", op.interleave)))
    if example is not None:
        where = example.names([rows])
        ctx.error(op.mark("interleave"), "bad-interleave",
                  f"interleave {op.interleave} of step '{step.name}' must divide the "
                  f"rows of src '{src_name}' ({ex.unparse(rows)}), but "
                  + (example.detail if example.undecided else "does not")
                  + f" for W={example.world}" + (f" ({where})" if where else ""),
                  hint=f"use 'interleave: 1', or declare the rows' size as a multiple "
                  f"of it, e.g. '{{multiple_of: {min(op.interleave, 64)}}}'")
