"""The driver of the happens-before checker: every W, deduplicated findings, hints."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from dcpc.check.hb.bound import axis_bounds, mesh_representatives, representatives, world_bound
from dcpc.check.hb.clocks import World, analyze, gates
from dcpc.check.hb.deadlock import CYCLE, RawDeadlock, find_deadlocks
from dcpc.check.hb.events import lower, with_roles
from dcpc.check.hb.hints import HintBudget, Proofs, suggest
from dcpc.check.hb.legal import Execution
from dcpc.check.hb.races import (
    MAX_REAL_WORK,
    PairKeys,
    RawRace,
    both_made,
    find_races,
    find_real_races,
    modelled,
    real_work,
    rotated,
)
from dcpc.check.hb.report import (
    Finding,
    HbReport,
    deadlock_finding,
    race_finding,
)
from dcpc.diagnostics import Diagnostic
from dcpc.lang import when as wh
from dcpc.lang.mesh import MeshWorld, fit_worlds, mesh_of, shape_of, torus
from dcpc.lang.model import Schedule
from dcpc.lang.semantics import Semantics
from dcpc.ops.common import peers_of, wraps

if TYPE_CHECKING:
    from dcpc.check.hb.events import Program
    from dcpc.codegen.plan import Plan


def check(
    schedule: Schedule,
    worlds: Iterable[int],
    *,
    calls: int | None = None,
    hints: bool = True,
    plan: Plan | None = None,
    every_world: bool = False,
    semantics: list[Semantics] | None = None,
    roles: dict[str, str] | None = None,
) -> HbReport:
    """Prove the buffer/epoch ordering of ``schedule`` for every W in ``worlds``.

    Returns every race and deadlock, one per (kind, class, buffer, step pair), each
    with the smallest W it occurs at, a concrete counterexample and (``hints``) a
    fix proved by re-checking. ``calls`` overrides the unroll bound (default
    2*slots calls per rank, which is enough: see dcpc.check.hb). ``plan`` is the
    schedule's lowered plan (dcpc.codegen.lower), whose signal slots and effects are
    what is analysed; it is lowered here when not given. Past the world bound
    (dcpc.check.hb.bound) one W stands for every larger one; ``every_world`` analyses each
    W asked anyway (tests compare the two). Assumes a structurally clean schedule
    (dcpc.check.structural runs first). ``semantics``: the schedule's table
    (dcpc.lang.semantics), which the hints read; asked there when not given.
    ``roles`` (PROTOTYPE, docs/proposals/roles.md): step name -> role; the roles of a
    rank run at once, each its own program order (events.with_roles); every W asked is
    analysed. Refused (ValueError): per-slot streams, a guarded communication step, a
    wait on a line or a perm. Only symmetric and persistent buffers are tracked: a race
    between two roles of one rank on an engine-owned buffer is invisible here (and to
    the execution oracle); until the language gives such buffers one role or tracks
    them, keep each engine buffer inside one role (unchecked). Assumed, not emitted or
    checked: the own lanes (events.own_tail) and ``role-order`` (the file's order is one
    execution of the roles: docs/proposals/roles.md 2.3).
    """
    start = time.perf_counter()
    worlds = sorted({w for w in fit_worlds(mesh_of(schedule), worlds) if w >= 1})
    program = lower(schedule, plan)
    if roles is not None:
        program = with_roles(program, roles)
        every_world = True  # the world bound was argued for one program order
        hints = False  # a hint is proved by re-checks that know no roles
    # a when: reads the rank and W: which ranks run a step differs from W to W, so no W
    # stands for another (races of a step that runs nowhere are dropped per W, but for
    # the engine's read of what its method returns: legal.Execution.happens)
    every_world = every_world or any(
        getattr(s.op, "when", None) is not None for s in schedule.step_list())
    bound: int | list[int] = world_bound(program, calls)
    if schedule.mesh is not None:
        bound = axis_bounds(program, calls)
        analysed = worlds if every_world else mesh_representatives(worlds, bound)
    else:
        analysed = worlds if every_world else representatives(worlds, bound)
    findings: dict[tuple[str, str, str, str, str], Finding] = {}
    events = 0
    pair_keys: PairKeys = {}  # the race keys of group pairs: the same for every W
    budget = _RealSteps(schedule, program, calls, worlds, analysed)
    refused: list[Diagnostic] = []  # a W past the real-steps bound: none after it checked
    for w in analysed:
        world = analyze(program, w, calls, gates(schedule, program, w))
        world.skipped = _skipped(schedule, w)
        if world.skipped:  # the counterexample's cuts: what the ranks really do
            world.execution = Execution(world, wh.running(schedule, w))
        events += w * len(world.live)
        deadlocks, stuck, guarded = find_deadlocks(world), None, None
        if deadlocks and world.execution is not None:  # where the ranks really stop
            stuck = world.execution.stuck()
            if stuck is None:  # the guards cut the model's cycle: the real steps decide
                deadlocks = []  # (the model searched no race past its cycle: World.live)
                if not budget.fits(world):  # the W before it keep their findings
                    refused.append(budget.refusal(world))
                    break
                budget.charge(world)
                guarded = find_real_races(world, world.execution)
        blocked = real = None
        if stuck is not None:  # only the model's deadlocks where a real rank stops
            blocked = world.execution.blocked(stuck)  # type: ignore[union-attr]
            real = world.execution.deadlocked(blocked)  # type: ignore[union-attr]
            kept = [d for d in deadlocks if any(
                pos % world.n == d.wait_j for pos, _ in real.values())]
            kept += _unmodelled(world, kept, real)
            deadlocks = kept or deadlocks  # none named where a rank stops: the model's
        for dead in deadlocks:
            if dead.key(world) not in findings:
                findings[dead.key(world)] = deadlock_finding(world, dead, stuck, blocked, real)
        races = find_races(world, pair_keys) if guarded is None else guarded
        if races and world.execution is None and not deadlocks and _unjoined(world):
            # a line's or perm's wait joins no clock: the model's cut may show a rank past
            # a wait its peer has not signalled; the counterexample is cut from the real
            # steps (legal.Execution, every step running) instead, as under a when:
            world.execution = Execution(world, {})
        # where no translation of a race's pair is unordered on the real steps, the
        # real-steps search of its key places it (none deadlocked, within its bound;
        # else the model's race is kept, said so: unsearched)
        unsearched = None
        if races and world.execution is not None and guarded is None:
            unsearched = (DEADLOCKED if deadlocks else  # no real step runs past it
                          None if budget.fits(world) else budget.unsearched())
        search: set[tuple[str, str, str, str, str]] = set()  # the keys left to search
        for race in races:
            if race.key(world) in findings:  # (a real-steps race is placed already)
                continue
            placed, model = (race, False) if guarded is not None else _where_both_run(
                schedule, world, race)
            if model and unsearched is None:
                search.add(race.key(world))
            elif placed is not None:
                findings[race.key(world)] = race_finding(
                    world, placed, unsearched if model else None)
        if search:  # one search for every key left: another pair of it, or none (dropped)
            budget.charge(world)
            for real in find_real_races(world, world.execution, search):  # type: ignore[arg-type]
                findings[real.key(world)] = race_finding(world, real)
    checked = time.perf_counter()
    ordered = sorted(findings.values(), key=lambda f: (f.kind != "deadlock", f.mark, f.key))
    if hints and ordered:
        budget = HintBudget(schedule, calls, plan)
        proofs = Proofs(schedule, semantics)  # shared: the findings propose the same edits
        for finding in ordered:
            finding.hint = suggest(schedule, finding, calls, worlds, budget=budget,
                                   semantics=semantics, proofs=proofs)
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
    return HbReport(schedule.schedule, schedule.source_file, worlds, ordered, stats, refused)


# why a model's race is kept unsearched at a W where a rank deadlocks, and where it is not
DEADLOCKED = ("a rank deadlocks there", "where no rank deadlocks")


class _RealSteps:
    """The real-steps searches of one check (races.find_real_races) and ONE bound on
    them, races.MAX_REAL_WORK: the sum of their work (``real_work``: cut entries, plus
    the pairs it may compare; none where there is no pair) over the W of the check,
    whichever asks, the guards that cut the model's cycle (past it: schedule-too-large)
    or a model's race past a line's or a perm's wait (past it: the race kept, labelled).
    A sum, not a bound per W: the bound is there so that a check is not minutes of
    search, and a check's time is the sum of its searches; a check with a ``when:``
    analyses every W it is asked, where a bound per W let ``--world 2..199`` run 198
    searches each just under it (the review of sym26, M2). Work grows with W, so the
    searches that fit are those of the first W analysed: once one does not, none after
    it runs."""

    def __init__(self, schedule: Schedule, program: Program, calls: int | None,
                 worlds: list[int], analysed: list[int]) -> None:
        self.schedule, self.program, self.calls = schedule, program, calls
        self.worlds, self.analysed = worlds, analysed
        self.searched: list[tuple[int, int]] = []  # (W, work) of each search run so far
        self.over: int | None = None  # the index in analysed of the first W past it
        self._work: dict[int, tuple[int, int]] = {}

    def work(self, world: World) -> tuple[int, int]:
        """(cut entries, pair units) of the search at this W (races.real_work)."""
        if world.world not in self._work:
            self._work[world.world] = real_work(world)
        return self._work[world.world]

    def units(self, world: World) -> int:
        """Its work in units: a search with no pair to compare makes no cut: none."""
        cuts, pairs = self.work(world)
        return cuts + pairs if pairs else 0

    def fits(self, world: World) -> bool:
        """Whether the search at this W fits beside those run before it."""
        if self.over is None and (sum(w for _, w in self.searched) + self.units(world)
                                  > MAX_REAL_WORK):
            self.over = self.analysed.index(world.world)
        return self.over is None

    def charge(self, world: World) -> None:
        """The search at this W runs (after ``fits``)."""
        self.searched.append((int(world.world), self.units(world)))

    def fitting(self) -> str | None:
        """Exactly the --world range of this check's W that fits (None: none does): the
        W analysed before the first past the bound (a check of them runs the same
        searches), and the W asked between the last of them and that one, which no W of
        this check stood for: past the world bound, one analysed W stands for each of
        them, so a check up to W runs the searches before plus W's. Those are found by
        bisection, which assumes a search's work grows with W (``real_work``: cut entries
        W x events x W x streams, pairs W x W or W); where it did not, the range named
        could stop short of, or pass, a W in between that fits alone. Mesh shapes are
        not bisected (the range stops at the last shape analysed), and the range is cut
        by position in the W asked: shapes compare by their product (3x4 == 4x3)."""
        here = self.over
        assert here is not None  # asked past the bound only
        if not here:
            return None
        # positions in the W asked (sorted as analysed: a shape's W, then its sizes)
        last = bisect.bisect_right(self.worlds, self.analysed[here - 1]) - 1
        between = self.worlds[last + 1:bisect.bisect_left(self.worlds, self.analysed[here])]
        if between and not isinstance(between[0], MeshWorld):
            before = sum(w for _, w in self.searched)
            lo, hi = 0, len(between)  # between[:lo] fit; between[hi:] do not
            while lo < hi:  # the largest that fits, by bisection (work grows with W)
                mid = (lo + hi) // 2
                w = between[mid]
                world = analyze(self.program, w, self.calls,
                                gates(self.schedule, self.program, w))
                if before + self.units(world) <= MAX_REAL_WORK:
                    lo = mid + 1
                else:
                    hi = mid
            last += lo
        return f"--world {_span(self.worlds[:last + 1])}"

    def refusal(self, world: World) -> Diagnostic:
        """The located refusal at this W (the guards cut the model's cycle, and its
        search does not fit): which range fits (its findings are reported) and whether
        this W alone would."""
        cuts, pairs = self.work(world)
        work = self.units(world)
        total = sum(w for _, w in self.searched) + work
        before = (f"; with the {len(self.searched)} W searched before it, {total} in all"
                  if self.searched else "")
        fits = self.fitting()
        fits = f"{fits} fits (its findings are reported); " if fits else ""
        alone = "fits" if work <= MAX_REAL_WORK else "does not fit either"
        return Diagnostic(
            self.schedule.mark("steps"), "schedule-too-large",
            f"at W={world.world} the when: guards cut the model's cycle of waits, so the "
            f"races after it are decided on each rank's real steps: {work} units of work "
            f"({cuts} cut entries, {pairs} for the pairs of accesses it may compare)"
            f"{before}, above the limit of {MAX_REAL_WORK}: {fits}W={world.world} alone "
            f"{alone}",
            hint="check a narrower --world range (the real-steps search grows as W^2 at "
            "each W, summed over the W of one check), or fewer steps or slots")

    def unsearched(self) -> tuple[str, str]:
        """Why a model's race at a W past the bound is kept (report.race_finding), and
        at which W of this check the search runs, with the range that fits."""
        first_over = self.analysed[self.over]  # type: ignore[index]
        fits = self.fitting()
        where = (f"at --world {_span(self.analysed[:self.over])} of this check ({fits} fits its "
                 f"bound)" if fits else
                 f"at no W of this check (W={first_over} alone is past its bound)")
        return f"over the work bound of {MAX_REAL_WORK} units", where


def _span(worlds: list[int]) -> str:
    """``2..30`` for the W of a check, as --world takes them: runs of consecutive group
    sizes as A..B, joined by commas (``2..4,8``); mesh shapes listed (``2x2,2x4``)."""
    if any(isinstance(w, MeshWorld) for w in worlds):
        return ",".join(map(str, worlds))
    runs: list[list[int]] = []
    for w in worlds:
        if runs and w == runs[-1][1] + 1:
            runs[-1][1] = w
        else:
            runs.append([w, w])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def _unmodelled(world: World, deadlocks: list[RawDeadlock],
                real: dict[int, tuple[int, list[int] | None]]) -> list[RawDeadlock]:
    """A deadlock at each wait where a rank really stops on a cycle of waits (or for a
    signal never sent: legal.Execution.deadlocked) that no deadlock of the model names: a
    cycle the guards make through waits of several channels (rank 0 at a shift's wait
    for rank 2, stuck at a guarded wait for rank 0's later signal), which the model,
    every rank alike, does not have; named from the first rank stuck there."""
    events, topo = world.program.events, torus(shape_of(world.world))
    named = {d.wait_j for d in deadlocks}
    out: dict[int, RawDeadlock] = {}
    for row, (pos, sources) in sorted(real.items()):
        q, i = row // world.streams, pos % world.n
        wait = events[i].wait
        if i in named or i in out or wait is None:
            continue
        peers = sources or sorted(peers_of(wait[1], q, world.world, events[i].axes))
        delta = topo.sub(peers[0], q) if peers else 0  # q + delta is the awaited peer
        out[i] = RawDeadlock(CYCLE, wait[0], i, delta,
                             world.execution.signal_of.get(wait[0]))  # type: ignore[union-attr]
    return list(out.values())


def _unjoined(world: World) -> bool:
    """Whether a wait of the program joins no clock (a ``wrap: false`` line's or a
    perm's: clocks.analyze), so the model orders less than the ranks' real steps do."""
    return any(e.wait is not None and not wraps(e.wait[1])  # type: ignore[arg-type]
               for e in world.program.events)


def _where_both_run(schedule: Schedule, world: World,
                    race: RawRace) -> tuple[RawRace | None, bool]:
    """The race translated to ranks where both its accesses happen (``when:``,
    dcpc.lang.when; legal.Execution.happens) and where an access the model gives every
    rank is one the program makes (races.made): a perm's store from writer p into
    table[p]'s instance, a broadcast's from its root, a shift's src read on a rank that
    sends (the analysis takes every rank's store at every delta of a table, every rank
    as a broadcast's root and every rank's src read, so the race it finds may name an
    access no rank makes; races._rank_pairs keeps only pairs some translation makes), so
    that its counterexample happens as written and ``dcpc run --replay`` can show it.
    The analysis takes a guarded step's accesses on every rank (sound: a guarded local
    step changes no ordering, and a guarded communication step's wait orders only what
    runs after it where it runs: clocks.Gates), and every translation of a race of that
    model is one (a rotation; on a mesh, of its torus); a race no translation fits is
    kept as found (another pair of the same groups may fit). None: an access of it
    happens on no rank at this W, so no execution makes it. With it, whether the race
    is the model's only: no translation of it is unordered on the ranks' real steps
    (``world.execution``; the model orders less where a wait joins no clock: a line's, a
    perm's, a guarded one). The checker then asks the real-steps search for its key
    (races.find_real_races, every pair of its groups on every owner, one search for
    every such key of a W), so its counterexample is an execution that happens, and
    drops it where that search finds none (no execution makes it, cex27); where the
    search does not run (``_RealSteps``, DEADLOCKED) the model's race is kept, said so."""
    a, b = race.first, race.second
    execution = world.execution  # some rank skips a guarded step (its sync, maybe)
    # a chunk's access (``b[s][e]``) meets a store of an index region of one part only
    # (races._meets): the pair as found may be one no translation makes, so it is moved
    # to one that does, as a modelled access is
    if execution is None and not any(modelled(world, t) or t.access.chunk is not None
                                     for t in (a, b)):
        return race, False
    n = int(world.world)
    if execution is not None and not all(  # a step that runs on no rank at this W
            any(execution.happens(t, r) for r in range(n)) for t in (a, b)):  # races nothing
        return None, False
    topo = torus(shape_of(world.world))  # (the model's races are on rank 0's instance)
    fits = [replace(race, first=rotated(a, d, topo), second=rotated(b, d, topo))
            for d in both_made(world, a, b)]
    if execution is not None:  # the first translation the ranks' real steps allow
        legal = next((f for f in fits if execution.unordered(f) is not None), None)
        if legal is not None:
            return legal, False
    return (fits[0] if fits else race), execution is not None


def _skipped(schedule: Schedule, w: int) -> frozenset[tuple[int, int]]:
    """(rank, step index) of every guarded step that does not run on that rank at W."""
    return frozenset((r, index) for index, ranks in wh.running(schedule, w).items()
                     for r in range(int(w)) if r not in ranks)


def _json(world: int) -> int | str:
    return str(world) if isinstance(world, MeshWorld) else world
