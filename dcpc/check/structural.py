"""Structural checks of ``dcpc check``: every error of a file, in one run.

    check(schedule, worlds) -> list[Diagnostic]

The passes, in order: names (identifiers, duplicates, unknown buffers), buffers
(flag and LSE-dtype rules), sizes (expressions, divisibility, non-positive dims for
every W), ops (per-op shapes, dtypes, dims, symmetric destinations, LSE bases), then
flow (reads of what nothing wrote, signal/wait channels). Each pass appends to one
list; nothing raises for bad input, and nothing from the input is executed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dcpc.check.context import Context, show
from dcpc.check.flow import check_channels, check_reads
from dcpc.check.mesh import check_mesh, mesh_diagnostics
from dcpc.check.names import check_buffers, check_names, check_references
from dcpc.check.ops import check_ops
from dcpc.check.when import check_when
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang import expr as ex
from dcpc.lang import when as wh
from dcpc.lang.loops import MAX_STEPS
from dcpc.lang.mesh import DEFAULT_WORLDS, MeshWorld, WorldError, fit_worlds, mesh_of
from dcpc.lang.model import Schedule, Streams
from dcpc.lang.nodes import Step
from dcpc.lang.questions import Samples
from dcpc.lang.semantics import Semantics, table
from dcpc.lang.sizes import MAX_SIZE, size_table, world_diagnostics
from dcpc.ops.all_gather import AllGather
from dcpc.ops.registry import names


def check(schedule: Schedule, worlds: Iterable[int] = DEFAULT_WORLDS,
          semantics: list[Semantics] | None = None) -> list[Diagnostic]:
    """Every structural error (and warning) of a parsed schedule, sorted by position.

    ``worlds`` are the group sizes W to check sizes and shapes for (e.g. 2..72).
    ``semantics``: the schedule's ``dcpc.lang.semantics.table`` (the pipeline's; asked
    here when not given). An empty result means the schedule is structurally clean.
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
    sems = table(schedule, semantics)
    too_large = check_limits(schedule, worlds, sems)
    if too_large:
        return too_large
    sizes = size_table(schedule)
    found = sizes.diagnostics + world_diagnostics(schedule, sizes, worlds)
    samples = Samples(sizes, worlds)
    ctx = Context(schedule, sizes, samples, schedule.step_list(), sems, out=found)
    check_names(ctx)
    check_mesh(ctx)
    check_references(ctx)
    check_buffers(ctx)
    check_shapes(ctx)
    check_ops(ctx)
    check_interleave(ctx)
    check_when(ctx)
    check_reads(ctx)
    check_channels(ctx)
    unique = {(d.mark, d.code, d.message): d for d in ctx.out}
    return sorted(unique.values(), key=lambda d: (d.mark, d.code))


MAX_ACCESSES = 20_000


# The happens-before checker's work, measured before it runs (issue 31: files within
# every other limit took minutes), in units of one clock entry of a plain W (about
# 0.05 us of CPU here): for every W it analyses, a clock of W entries per event of the
# calls it computes (copies of slot 0 cost nothing); on a mesh each clock is joined by
# one permutation per member of a partial team (MESH_COST units per entry and member)
# plus SHAPE_COST units per rank of each shape for its set-up; and the race search
# visits every pair of accesses to one instance of a symmetric buffer (PAIR_COST units
# each). Fitted on this project's 2-core machine (rings, shared buffers over many
# slots, meshes of 2..4 axes): the limit admits about 0.6 s of analysis. What a whole
# check of a file within every limit costs: docs/hb-checker.md ("Limits", measured by
# benchmarks/check_steps_bound.py).
MAX_HB_WORK = 12_000_000
MESH_COST = 2
SHAPE_COST = 320
PAIR_COST = 1.25


def check_limits(schedule: Schedule, worlds: list[int] | None = None,
                 semantics: list[Semantics] | None = None) -> list[Diagnostic]:
    """A schedule past these limits is refused at once: checking it would take minutes
    (docs/language.md, "Limits"); within them `dcpc check` takes seconds. ``semantics``:
    the schedule's table, asked when not given."""
    steps = schedule.step_list()
    if len(steps) > MAX_STEPS:
        return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                           f"the schedule has {len(steps)} steps, above the limit of "
                           f"{MAX_STEPS}", hint="split it into several schedules")]
    sems = table(schedule, semantics)
    accesses = sum(len(sem.effects) for sem in sems)
    if accesses > MAX_ACCESSES:
        return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                           f"the steps name buffers {accesses} times in all, above the limit "
                           f"of {MAX_ACCESSES}", hint="split it into several schedules")]
    checks = wh.rank_checks(schedule, worlds or [])
    if checks > wh.MAX_RANK_CHECKS:
        return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                           f"{len(wh.guarded(schedule))} steps with when: are decided rank "
                           f"by rank at every W checked: {checks} (step, rank) pairs over "
                           f"the {len(worlds or [])} W asked, above the limit of "
                           f"{wh.MAX_RANK_CHECKS}",
                           hint="check a narrower --world range (each W is proved on its "
                           "own: no W stands for another)")]
    return _hb_work(schedule, steps, worlds or [], sems)


def hb_calls(slots: int, per_slot_streams: bool) -> int:
    """The calls per rank whose clocks the happens-before checker computes: 2 with
    per-slot streams (the other slots' calls are copies), else 2 * slots."""
    return 2 if per_slot_streams and slots > 1 else 2 * slots


@dataclass
class HbCost:
    """What the happens-before checker would do for some group sizes, measured before
    it runs (the W it analyses, its clock entries and race-search pairs) and its work."""

    analysed: list[int]
    entries: int  # clock entries (a mesh: W x events x the largest partial team)
    pairs: int  # pairs of accesses the race search visits, over every W analysed
    buffer: str  # the buffer with the most pairs
    upto: str  # which W are analysed, in words
    ring: int  # next/prev waits per call

    @property
    def work(self) -> int:
        mesh = sum(int(w) for w in self.analysed if isinstance(w, MeshWorld))
        return self.entries + SHAPE_COST * mesh + int(PAIR_COST * self.pairs)


def hb_cost(schedule: Schedule, worlds: list[int],
            semantics: list[Semantics] | None = None) -> HbCost:
    """The cost of ``hb.check(schedule, worlds)`` from the W it will analyse (the world
    bounds and representatives the checker itself uses; ``semantics``: the schedule's
    table, asked when not given)."""
    # here, not at the top: dcpc.check.hb's package face imports the checker, whose hints
    # import this module
    from dcpc.check.hb.bound import bound_for, mesh_representatives, representatives
    from dcpc.ops.common import ring_hops

    sems = table(schedule, semantics)
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
    if any(getattr(s.op, "when", None) is not None for s in schedule.step_list()):
        # a when: reads the rank: the checker analyses every W asked (dcpc.check.hb.checker)
        analysed, upto = list(worlds), "every W asked (a step's when: reads the rank)"
    calls = hb_calls(schedule.slots, schedule.streams == Streams.per_slot)
    events = len(schedule.step_list()) * calls
    teams = sorted({sem.sync.axes for sem in sems if sem.sync.axes is not None})
    entries = 0
    for w in analysed:
        joins = 1  # a plain W's clock is rotated by list slices
        if isinstance(w, MeshWorld):
            joins = MESH_COST * max([1] + [math.prod(w.shape[a] for a in axes)
                                           for axes in teams])
        entries += int(w) * joins * events
    pairs, buffer = race_pairs(schedule, sems, calls)
    return HbCost(analysed, entries, pairs * len(analysed), buffer, upto, ring)


def _hb_work(schedule: Schedule, steps: list, worlds: list[int],
             sems: list[Semantics]) -> list[Diagnostic]:
    cost = hb_cost(schedule, worlds, sems)
    if cost.work <= MAX_HB_WORK:
        return []
    raised = f", raised by {cost.ring} next/prev waits per call" if cost.ring > 0 else ""
    return [Diagnostic(schedule.mark("steps"), "schedule-too-large",
                       f"the happens-before checker would analyse {len(cost.analysed)} "
                       f"group sizes ({cost.upto}{raised}) of {len(steps)} steps: "
                       f"{cost.work} units of work ({cost.entries} clock entries, "
                       f"{cost.pairs} race-search pairs, most on buffer '{cost.buffer}'), "
                       f"above the limit of {MAX_HB_WORK}",
                       hint="check a narrower --world range, or use fewer ring hops (a "
                       "'from: all' wait orders every rank at once), steps, slots, or "
                       "steps that touch one symmetric buffer")]


def race_pairs(schedule: Schedule, sems: list, calls: int) -> tuple[int, str]:
    """The pairs of accesses the race search visits per W (an upper bound: accesses
    are counted per step, not per event), and the buffer with the most of them. An
    instance of a symmetric buffer holds its accesses of every computed call when it is
    ``shared`` (or ``persist``, a local one too), else of the calls of slot 0
    (dcpc.check.hb.races._instances)."""
    per_call: dict[str, int] = {}
    for sem in sems:
        for effect in sem.effects:
            per_call[effect.buffer] = per_call.get(effect.buffer, 0) + 1
    slot0 = len([c for c in range(calls) if c % schedule.slots == 0])
    total, worst, most = 0, "", -1
    for name, count in per_call.items():
        buffer = schedule.buffers.get(name)
        if buffer is not None and not buffer.is_symmetric and not buffer.persist:
            continue  # only symmetric buffers are searched (an implicit one is), and
            # persistent ones (one instance for all slots, as a shared one)
        one = buffer is not None and (buffer.shared or buffer.persist)
        groups = count * (calls if one else slot0)
        pairs = groups * (groups - 1) // 2
        total += pairs
        if pairs > most:
            worst, most = name, pairs
    return total, worst


def check_shapes(ctx: Context) -> None:
    """Every dimension of every buffer is a whole, positive number for every W."""
    for name, shape in ctx.table.shapes.items():
        if shape is None:
            continue
        buffer = ctx.schedule.buffers[name]
        for i, dim in enumerate(shape):
            mark = buffer.mark(f"shape[{i}]")
            # each question asked once: the exact search spends one budget for the whole
            # check, so asking again may find it spent (and an undecided answer read as a
            # decided one named a positive dimension nonpositive)
            inexact = ctx.samples.inexact(dim)
            example = inexact if inexact is not None else ctx.samples.nonpositive(dim)
            if ctx.undecided(mark, f"dimension {i} of buffer '{name}' {show([dim])}", example):
                continue
            if inexact is not None:
                ctx.error(mark, "inexact-division",
                          f"{example.detail} is not a whole number for W={example.world}"
                          + (f" ({example.names([dim])})" if example.names([dim]) else "")
                          + f" in dimension {i} of buffer '{name}'",
                          hint="declare the size with 'multiple_of', e.g. "
                          "'H: {multiple_of: W}', or narrow the W range")
                continue
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
    if ctx.undecided(op.mark("interleave"), f"whether interleave {op.interleave} of step "
                     f"'{step.name}' divides the rows of src '{src_name}' "
                     f"({ex.unparse(rows)})", example):
        return
    if example is not None:
        where = example.names([rows])
        ctx.error(op.mark("interleave"), "bad-interleave",
                  f"interleave {op.interleave} of step '{step.name}' must divide the "
                  f"rows of src '{src_name}' ({ex.unparse(rows)}), but does not"
                  + f" for W={example.world}" + (f" ({where})" if where else ""),
                  hint=f"use 'interleave: 1', or declare the rows' size as a multiple "
                  f"of it, e.g. '{{multiple_of: {min(op.interleave, 64)}}}'")
