"""Fixes for findings: candidate edits of the schedule, each proved by re-checking.

A hint is only given when the edited schedule passes the whole pipeline (structure,
read-before-write, lowering), every read still sees the write it saw, and it no longer
has the finding, at the W it was found, and has no finding the original did not have. Candidates, in
order of preference: move a step (a reader after its writer, a split-phase
signal after the read it releases), drop ``shared: true``, one more slot on a
single stream (double buffering: no new sync), a barrier after one of the two
steps, ``streams: single`` (last: it gives up overlapping the slots).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dcpc.check import structural
from dcpc.check.hb.clocks import analyze, gates
from dcpc.check.hb.deadlock import NO_SIGNAL, find_deadlocks
from dcpc.check.hb.events import lower
from dcpc.check.hb.races import find_races
from dcpc.check.hb.report import Finding
from dcpc.codegen.lower import lower as lower_plan
from dcpc.codegen.plan import Plan
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.mesh import grown
from dcpc.lang.model import Peers, Schedule, Streams
from dcpc.lang.semantics import REACHES, WRITE, Semantics, table
from dcpc.ops.common import data_flow
from dcpc.ops.sync import Barrier, Signal

Key = tuple[str, str, str, str, str]
Edit = tuple[str, Callable[[], Schedule]]


def finding_keys(schedule: Schedule, worlds: list[int], calls: int | None = None,
                 plan: Plan | None = None) -> set[Key]:
    """The keys of every finding of ``schedule`` for these worlds (no timelines)."""
    program = lower(schedule, plan)
    keys: set[Key] = set()
    for w in worlds:
        world = analyze(program, w, calls, gates(schedule, program, w))
        keys |= {d.key(world) for d in find_deadlocks(world)}
        keys |= {r.key(world) for r in find_races(world)}
    return keys


def reaching_writes(schedule: Schedule,
                    semantics: list[Semantics]) -> dict[tuple[str, str], str]:
    """For every (step, buffer) read, the step of the same call whose write it sees
    (reads of what nothing before wrote in the call are left out); ``semantics``: the
    schedule's table."""
    last: dict[str, str] = {}
    seen: dict[tuple[str, str], str] = {}
    steps = schedule.step_list()
    for i, effect in data_flow(semantics):  # a store in flight where it lands
        if effect.kind == WRITE:
            last[effect.buffer] = steps[i].name
        elif effect.buffer in last:
            seen.setdefault((steps[i].name, effect.buffer), last[effect.buffer])
    return seen


def proved_keys(edited: Schedule, original: Schedule, worlds: list[int],
                calls: int | None, semantics: list[Semantics] | None = None,
                writes: dict[tuple[str, str], str] | None = None) -> set[Key] | None:
    """The findings of an edited schedule through the whole pipeline (structure,
    read-before-write, lowering, happens-before), or None when the edit breaks the
    schedule: a structural error, a lowering error, or a read that no longer sees the
    write it saw (an edit that wipes the data it was meant to protect). ``semantics``:
    the original's table, asked when not given; the edited one's is asked once here.
    ``writes``: the original's ``reaching_writes``, asked when not given."""
    edited_sems = table(edited)
    if any(d.severity == "error" for d in structural.check(edited, worlds, edited_sems)):
        return None
    try:
        plan = lower_plan(edited, worlds, edited_sems)
    except DiagnosticError:
        return None
    before = writes if writes is not None else reaching_writes(
        original, table(original, semantics))
    after = reaching_writes(edited, edited_sems)
    if any(after.get(read) != writer for read, writer in before.items()):
        return None
    return finding_keys(edited, worlds, calls, plan)


class Proofs:
    """What the hint search of one check has proved, kept for every finding of it: the
    original's table, the writes its reads see, its findings per list of W, and each
    edited schedule's ``proved_keys`` (the findings of one check propose the same edits
    again and again: a barrier after the same step, ``slots: 2``, the same move).

    An edit is known by what it holds (``_edit_key``): its schedule's fields, each step's
    name and op, each buffer, with the W and calls it was proved at; every edit of one
    check is made from the same original, whose private attributes (source, loop_world,
    slices) ``model_copy`` keeps. ``proved_keys`` is a function of these alone, so a kept
    answer is the one a re-check would give."""

    def __init__(self, schedule: Schedule, semantics: list[Semantics] | None = None):
        self.schedule = schedule
        self.semantics = table(schedule, semantics)
        self.writes = reaching_writes(schedule, self.semantics)
        self._before: dict[tuple[tuple[int, ...], int | None], set[Key]] = {}
        self._proved: dict[tuple[object, tuple[int, ...], int | None], set[Key] | None] = {}
        # the original's ops and buffers, alive while it is: their ids name them
        self._kept = {id(op) for item in schedule.steps for op in item.values()} | {
            id(b) for b in schedule.buffers.values()}

    def _edit_key(self, edited: Schedule) -> object:
        """Equal for two edits only when every field of theirs is: an op or buffer of
        the original by its identity (an edit keeps it), a new or copied one by its
        ``repr`` (every field, those the YAML dump leaves out included: no field of a
        node is ``repr=False``). Two equal edits may still get two keys (a copy equal to
        an original op): a proof made twice, never a wrong one."""
        def known(node: object) -> object:
            return id(node) if id(node) in self._kept else repr(node)
        rest = tuple(repr(getattr(edited, f)) for f in type(edited).model_fields
                     if f not in ("steps", "buffers"))
        steps = tuple((name, known(op)) for item in edited.steps for name, op in item.items())
        buffers = tuple((name, known(b)) for name, b in edited.buffers.items())
        return rest, steps, buffers

    def before(self, worlds: list[int], calls: int | None) -> set[Key]:
        """The original's finding keys at these W."""
        key = (tuple(worlds), calls)
        if key not in self._before:
            # the plan events.lower would lower when given none (dcpc.check.hb.events)
            self._before[key] = finding_keys(self.schedule, worlds, calls, lower_plan(
                self.schedule, [2], self.semantics))
        return self._before[key]

    def proved(self, edited: Schedule, worlds: list[int], calls: int | None) -> set[Key] | None:
        """``proved_keys`` of an edit of the original, once per edit."""
        key = (self._edit_key(edited), tuple(worlds), calls)
        if key not in self._proved:
            self._proved[key] = proved_keys(edited, self.schedule, worlds, calls,
                                            self.semantics, self.writes)
        return self._proved[key]


def _items(schedule: Schedule) -> list[tuple[str, object]]:
    return [(name, op) for item in schedule.steps for name, op in item.items()]


def _with_steps(schedule: Schedule, items: list[tuple[str, object]]) -> Schedule:
    return schedule.model_copy(update={"steps": [{name: op} for name, op in items]})


def _move_after(schedule: Schedule, step: str, after: str) -> Schedule:
    items = _items(schedule)
    moving = next(i for i in items if i[0] == step)
    rest = [i for i in items if i[0] != step]
    at = next(k for k, i in enumerate(rest) if i[0] == after)
    return _with_steps(schedule, rest[: at + 1] + [moving] + rest[at + 1:])


def _move_before(schedule: Schedule, step: str, before: str) -> Schedule:
    items = _items(schedule)
    moving = next(i for i in items if i[0] == step)
    rest = [i for i in items if i[0] != step]
    at = next(k for k, i in enumerate(rest) if i[0] == before)
    return _with_steps(schedule, rest[:at] + [moving] + rest[at:])


def _barrier_after(schedule: Schedule, step: str) -> Schedule:
    items = _items(schedule)
    names = {n for n, _ in items}
    name = next(f"release{k or ''}" for k in range(len(names) + 1)
                if f"release{k or ''}" not in names)
    at = next(k for k, i in enumerate(items) if i[0] == step)
    barrier = Barrier(op="barrier")
    return _with_steps(schedule, items[: at + 1] + [(name, barrier)] + items[at + 1:])


def _unshared(schedule: Schedule, buffer: str) -> Schedule:
    buffers = dict(schedule.buffers)
    buffers[buffer] = buffers[buffer].model_copy(update={"shared": False, "symmetric": True})
    return schedule.model_copy(update={"buffers": buffers})


def _with_op(schedule: Schedule, step: str, **update: object) -> Schedule:
    items = [(n, op.model_copy(update=update) if n == step else op)  # type: ignore[attr-defined]
             for n, op in _items(schedule)]
    return _with_steps(schedule, items)


def _touching(schedule: Schedule, semantics: list[Semantics], buffer: str) -> list[str]:
    """Steps that read or write ``buffer`` (an implicit receive buffer included), in order."""
    return [step.name for step, sem in zip(schedule.step_list(), semantics, strict=True)
            if any(e.buffer == buffer for e in sem.effects)]


def _race_edits(schedule: Schedule, f: Finding, semantics: list[Semantics]) -> Iterator[Edit]:
    a, b = f.first, f.second
    assert b is not None
    index = {n: i for i, (n, _) in enumerate(_items(schedule))}
    if a.call == b.call and index[a.step] < index[b.step]:
        yield f"move {a.step} after {b.step}", lambda: _move_after(schedule, a.step, b.step)
    if f.buffer in schedule.buffers and schedule.buffers[f.buffer].shared:
        yield (f"remove `shared: true` from {f.buffer}", lambda: _unshared(schedule, f.buffer))
    for name, op in _items(schedule):
        # a sync placed before the read it should release
        if getattr(op, "op", "") in ("signal", "barrier") and index[name] < index[a.step]:
            yield (f"move {name} after {a.step}",
                   lambda name=name: _move_after(schedule, name, a.step))  # type: ignore[misc]
    if schedule.slots == 1 or schedule.streams == Streams.single:
        # double buffering on one stream: the next call's sync orders the reuse, no new sync
        n = schedule.slots + 1
        also = "" if schedule.streams == Streams.single else " with `streams: single`"
        yield (f"add `slots: {n}`{also}", lambda: schedule.model_copy(
            update={"slots": n, "streams": Streams.single}))
    last = _touching(schedule, semantics, f.buffer)[-1:]
    for step in dict.fromkeys(last + [a.step, b.step]):
        yield f"add a barrier after {step}", lambda step=step: _barrier_after(schedule, step)
    if schedule.slots > 1 and schedule.streams == Streams.per_slot:
        yield "`streams: single`", lambda: schedule.model_copy(update={"streams": Streams.single})
    if a.lands or b.lands:
        yield from _flight_edits(schedule, f, index)


def _flight_edits(schedule: Schedule, f: Finding, index: dict[str, int]) -> Iterator[Edit]:
    """A race with a store in flight (a split-phase shift's, from its put to its wait):
    the other access before a sync that precedes the push; or, for two pushes in flight
    at once, the later one after the earlier one's wait, with a barrier between (the
    barrier orders the landing before the push on every rank)."""
    a, b = f.first, f.second
    assert b is not None
    if a.lands and a.call == b.call and index[b.step] < index[a.lands]:
        def serial() -> Schedule:
            return _barrier_after(_move_after(schedule, b.step, a.lands), a.lands)
        yield f"move {b.step} after {a.lands} with a barrier between them", serial
    for name, op in _items(schedule):
        if getattr(op, "op", "") in ("signal", "barrier") \
                and index[name] < min(index[a.step], index[b.step]):
            yield (f"move {a.step} before {name}",
                   lambda name=name: _move_before(schedule, a.step, name))  # type: ignore[misc]


def _deadlock_edits(schedule: Schedule, f: Finding) -> Iterator[Edit]:
    items = _items(schedule)
    index = {n: i for i, (n, _) in enumerate(items)}
    wait, sig = f.first.step, f.second.step if f.second is not None else None
    if sig is not None and index[wait] < index[sig]:
        yield f"move {wait} after {sig}", lambda: _move_after(schedule, wait, sig)
    if f.cls != NO_SIGNAL:
        return
    wait_op = dict(items)[wait]
    need = REACHES[getattr(wait_op, "from_", Peers.all)][0]  # the exact partner
    signals = [(n, op) for n, op in items if getattr(op, "op", "") == "signal"]
    for name, op in signals:
        if op.channel == f.buffer and op.to != need:  # type: ignore[attr-defined]
            yield (f"use `to: {need.value}` on {name}",
                   lambda name=name: _with_op(schedule, name, to=need))
    for channel in dict.fromkeys(op.channel for _, op in signals):  # type: ignore[attr-defined]
        if channel != f.buffer:
            yield (f"wait on channel {channel}",
                   lambda channel=channel: _with_op(schedule, wait, channel=channel))
    if getattr(wait_op, "op", "") == "wait":
        fresh = next(f"{wait}_signal{k or ''}" for k in range(len(items) + 1)
                     if f"{wait}_signal{k or ''}" not in index)
        signal = Signal(op="signal", to=need, channel=f.buffer)
        at = index[wait]
        yield (f"add `{{op: signal, to: {need.value}, channel: {f.buffer}}}` before {wait}",
               lambda: _with_steps(schedule, items[:at] + [(fresh, signal)] + items[at:]))


# Work the hints of one `dcpc check` may spend re-checking edited schedules, in pairs
# of access groups the race search visits: far above any schedule of the corpus or the
# gallery (a few thousand per re-check), reached only by schedules whose every
# re-check takes seconds (16 shared buffers over 64 slots: ~3 million).
HINT_WORK = 4_000_000


class HintBudget:
    """What is left of HINT_WORK for one check; ``cost`` is one re-check's estimate."""

    def __init__(self, schedule: Schedule, calls: int | None, plan: Plan | None = None):
        program = lower(schedule, plan)
        calls = calls or program.default_calls()
        touching: dict[str, int] = {}
        for event in program.events:
            for access in set(event.accesses):
                touching[access.buffer] = touching.get(access.buffer, 0) + 1
        per_call = {b: n * (calls if program.shared[b] else 2) for b, n in touching.items()
                    if b in program.shared}
        self.cost = 3 * sum(g * g // 2 for g in per_call.values())  # 3 worlds a re-check
        self.left = HINT_WORK
        self.exhausted = False

    def spend(self, reserve: int = 1) -> bool:
        """Take one re-check's cost if ``reserve`` re-checks' are left (a finding's fix
        search starts only with the original's re-check and one candidate's: 2)."""
        if self.left < reserve * self.cost:
            self.exhausted = True
            return False
        self.left -= self.cost
        return True


NOT_SEARCHED = ("no fix searched: re-checking candidate edits of a schedule this large "
                "would take too long (dcpc.check.hb.hints.HINT_WORK)")


def proving_worlds(schedule: Schedule, finding: Finding,
                   worlds: list[int] | None = None) -> list[int]:
    """The W a fix of ``finding`` is proved at: the W it was found at, the next W and the
    largest of ``worlds`` (that W alone where the schedule was unrolled for it)."""
    w = finding.world
    # a schedule unrolled for one W (its perm, loop or offset names W) is that W's alone
    return [w] if schedule.loop_world is not None else sorted(
        {w, grown(w), max(worlds or [w])})


def suggest(
    schedule: Schedule,
    finding: Finding,
    calls: int | None = None,
    worlds: list[int] | None = None,
    most: int = 2,
    budget: HintBudget | None = None,
    semantics: list[Semantics] | None = None,
    proofs: Proofs | None = None,
) -> str | None:
    """Up to ``most`` candidate fixes, joined with "; or ", or None.

    ``budget`` (shared by the findings of one check) bounds the re-checking: a finding
    whose budget does not cover the original's re-check and one candidate's gets
    NOT_SEARCHED; one that runs out among its candidates, the fixes proved before.
    ``semantics``: the schedule's table (dcpc.lang.semantics), asked when not given.
    ``proofs``: what the findings of this check proved before (``Proofs`` of
    ``schedule``), made here when not given.

    Each is proved through the whole pipeline (``proved_keys``): the edited schedule
    passes the structural checks and lowers, every read still sees the write it saw,
    it no longer has ``finding`` and has no finding the original lacks, at the W it
    was found, the next W and the largest of ``worlds`` (at that W alone where the
    schedule was unrolled for it: ``loop_world``). Among proved fixes, those
    leaving fewer findings come first.
    """
    check_at = proving_worlds(schedule, finding, worlds)
    # the original's re-check (``Proofs.before``) is worth its cost only with one
    # candidate's after it: without, the finding would get no fix for a fix unsearched
    if budget is not None and not budget.spend(reserve=2):
        return NOT_SEARCHED
    if proofs is None:
        proofs = Proofs(schedule, semantics)
    if proofs.schedule is not schedule:
        raise ValueError("suggest: proofs were kept for another schedule (Proofs(schedule))")
    sems = proofs.semantics
    before = proofs.before(check_at, calls)
    edits = (_race_edits(schedule, finding, sems) if finding.kind == "race"
             else _deadlock_edits(schedule, finding))
    proved: list[tuple[int, int, str]] = []
    for rank, (text, make) in enumerate(edits):
        if budget is not None and not budget.spend():
            break  # what is proved so far is still true
        try:
            after = proofs.proved(make(), check_at, calls)
        except (KeyError, StopIteration, ValueError):
            continue
        if after is None:
            continue
        if finding.key not in after and after <= before and text not in {p[2] for p in proved}:
            proved.append((len(after), rank, text))
    if proved:
        return "; or ".join(text for _, _, text in sorted(proved)[:most])
    return None
