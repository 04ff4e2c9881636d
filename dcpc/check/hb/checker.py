"""The driver of the happens-before checker: every W, deduplicated findings, hints."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dcpc.check.hb.clocks import analyze
from dcpc.check.hb.deadlock import find_deadlocks
from dcpc.check.hb.events import Program, lower
from dcpc.check.hb.hints import HintBudget, suggest
from dcpc.check.hb.races import PairKeys, find_races
from dcpc.check.hb.report import Finding, HbReport, deadlock_finding, race_finding
from dcpc.lang.mesh import MeshWorld, fit_worlds, mesh_of, shape_of
from dcpc.lang.model import Schedule
from dcpc.ops.common import ring_hops

if TYPE_CHECKING:
    from dcpc.codegen.plan import Plan


def check(
    schedule: Schedule,
    worlds: Iterable[int],
    *,
    calls: int | None = None,
    hints: bool = True,
    plan: Plan | None = None,
    every_world: bool = False,
) -> HbReport:
    """Prove the buffer/epoch ordering of ``schedule`` for every W in ``worlds``.

    Returns every race and deadlock, one per (kind, class, buffer, step pair), each
    with the smallest W it occurs at, a concrete counterexample and (``hints``) a
    fix proved by re-checking. ``calls`` overrides the unroll bound (default
    2*slots calls per rank, which is enough: see dcpc.check.hb). ``plan`` is the
    schedule's lowered plan (dcpc.codegen.lower), whose signal slots and effects are
    what is analysed; it is lowered here when not given. Past the world bound
    (``world_bound``) one W stands for every larger one; ``every_world`` analyses each
    W asked anyway (tests compare the two). Assumes a structurally clean schedule
    (dcpc.check.structural runs first).
    """
    start = time.perf_counter()
    worlds = sorted({w for w in fit_worlds(mesh_of(schedule), worlds) if w >= 1})
    program = lower(schedule, plan)
    bound: int | list[int] = world_bound(program, calls)
    if schedule.mesh is not None:
        bound = axis_bounds(program, calls)
        analysed = worlds if every_world else mesh_representatives(worlds, bound)
    else:
        analysed = worlds if every_world else representatives(worlds, bound)
    findings: dict[tuple[str, str, str, str, str], Finding] = {}
    events = 0
    pair_keys: PairKeys = {}  # the race keys of group pairs: the same for every W
    for w in analysed:
        world = analyze(program, w, calls)
        events += w * len(world.live)
        for dead in find_deadlocks(world):
            if dead.key(world) not in findings:
                findings[dead.key(world)] = deadlock_finding(world, dead)
        for race in find_races(world, pair_keys):
            if race.key(world) not in findings:
                findings[race.key(world)] = race_finding(world, race)
    checked = time.perf_counter()
    ordered = sorted(findings.values(), key=lambda f: (f.kind != "deadlock", f.mark, f.key))
    if hints and ordered:
        budget = HintBudget(schedule, calls, plan)
        for finding in ordered:
            finding.hint = suggest(schedule, finding, calls, worlds, budget=budget)
    stats = {
        "events": events,
        "events_per_rank": len(program.events) * (calls or program.default_calls()),
        "calls": calls or program.default_calls(),
        "worlds": len(worlds),
        "world_range": [_json(worlds[0]), _json(worlds[-1])] if worlds else [],
        "world_bound": bound,
        "worlds_analysed": len(analysed),
        "seconds": round(checked - start, 4),
        "hint_seconds": round(time.perf_counter() - checked, 4),
    }
    return HbReport(schedule.schedule, schedule.source_file, worlds, ordered, stats)


def world_bound(program: Program, calls: int | None = None) -> int:
    """Every W above this bound has exactly the findings of the bound plus one.

    Why: every peer pattern is a rank offset (``all``, ``next``, ``prev``), so by
    rotation symmetry a finding is a relation between ranks at some offset d. A
    happens-before chain moves by one rank per ``next``/``prev`` wait it passes (k
    ranks per wait of a shift by offset k, counted k times) and to
    every rank at once through an ``all`` one; in the unroll window there are at most
    K = (next/prev waits per call) x calls such hops. For W > 2K + 2 no chain wraps
    around the ring, offsets |d| <= K relate ranks exactly as at any other such W,
    and all larger offsets are alike (only ``all`` waits reach them), and exist; the
    regions' overlap rules do not depend on W, and neither does wait matching once
    ``next`` and ``prev`` differ (W >= 3). Below the bound every W is analysed.
    tests/test_hb_unroll.py compares this with analysing every W.
    """
    per_call = sum(ring_hops(e.wait[1]) for e in program.events if e.wait is not None)
    return bound_for(per_call, calls or program.default_calls())


def axis_bounds(program: Program, calls: int | None = None) -> list[int]:
    """The world bound of each mesh axis (docs/hb-checker.md, "Meshes"): the bound of
    ``world_bound`` for the next/prev waits along that axis. An axis longer than its
    bound stands for every longer one, whatever the other axes are."""
    count = calls or program.default_calls()
    out = []
    for a in range(len(program.axis_names)):
        along = sum(ring_hops(e.wait[1]) for e in program.events if e.wait is not None
                    and (e.axes if e.axes is not None else tuple(range(len(program.axis_names))))
                    == (a,))
        out.append(bound_for(along, count))
    return out


def mesh_representatives(worlds: list[int], bounds: list[int]) -> list[int]:
    """The mesh shapes to analyse: each axis size above its bound replaced by the
    smallest size asked above it on that axis (one stands for all), deduplicated."""
    shapes = [shape_of(w) for w in worlds]
    above = [min((s[a] for s in shapes if s[a] > b), default=0) for a, b in enumerate(bounds)]
    picked = {MeshWorld(tuple(above[a] if x > bounds[a] else x for a, x in enumerate(s)))
              for s in shapes}
    return sorted(picked)


def _json(world: int) -> int | str:
    return str(world) if isinstance(world, MeshWorld) else world


def bound_for(ring_waits: int, calls: int) -> int:
    """The world bound of ``world_bound`` for ``ring_waits`` next/prev waits per call
    and ``calls`` unrolled calls per rank."""
    return max(8, 2 * ring_waits * calls + 3)


def representatives(worlds: list[int], bound: int) -> list[int]:
    """The group sizes to analyse: every one up to ``bound``, then the first and the
    last above it (any one would do; the last keeps the largest W's stats)."""
    above = [w for w in worlds if w > bound]
    return [w for w in worlds if w <= bound] + sorted({above[0], above[-1]} if above else set())
