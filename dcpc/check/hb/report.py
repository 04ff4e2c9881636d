"""Findings of the happens-before checker: records, messages, diagnostics, JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcpc.check.hb.clocks import World
from dcpc.check.hb.deadlock import CYCLE, NO_SIGNAL, RawDeadlock
from dcpc.check.hb.races import RAW, WAR, WAW, RawRace, Touch
from dcpc.check.hb.timeline import (
    involved_ranks,
    left_out,
    render,
    stream_positions,
    strict_predecessors,
)
from dcpc.diagnostics import Diagnostic, Mark
from dcpc.lang.mesh import MeshWorld, rank_text, shape_of, torus


@dataclass(frozen=True)
class Location:
    """One side of a finding: an access (read/write) or a wait/signal of one rank."""

    rank: int
    call: int
    slot: int
    step: str
    step_index: int
    access: str  # "read" | "write" | "wait" | "signal"
    region: str  # e.g. "q_full[rank 0, slot 0] H block 1 (dim 1)", or a channel
    mark: Mark
    rank_name: str = field(default="", compare=False)  # a mesh's "rank (node=1, gpu=0)"
    lands: str = field(default="", compare=False)  # a store in flight: the wait landing it
    owner: int = field(default=-1, compare=False)  # an access: the rank whose instance it is
    returned: bool = field(default=False, compare=False)  # the engine's read of what it returns

    def text(self) -> str:
        who = self.rank_name or f"rank {self.rank}"
        if self.returned:  # the engine's read of what the step returned: the one wording
            return (access_text(self, who, "reads", self.region)
                    + f" at {self.mark}")
        return (f"{self.step} on {who}, call {self.call} (slot {self.slot}) "
                f"{self.access}s {self.region}, at {self.mark}")

    def as_dict(self) -> dict[str, Any]:
        """As JSON; a store in flight also names the wait that lands it ("lands")."""
        return {"rank": self.rank, "call": self.call, "slot": self.slot, "step": self.step,
                "step_index": self.step_index, "access": self.access, "region": self.region,
                "mark": str(self.mark), **({"lands": self.lands} if self.lands else {}),
                **({"owner": self.owner} if self.owner >= 0 else {}),
                **({"returned": True} if self.returned else {})}


@dataclass
class Finding:
    """A race or a deadlock, with the smallest W at which it was found.

    ``cls``: for a race "write-after-read", "read-after-write" or
    "write-after-write"; for a deadlock "no-signal" or "cycle". ``buffer`` is the
    raced buffer, or for a deadlock the channel (a step's name for the implicit
    channel of a communication op). ``first`` happens first in the order the
    schedule intends (for a deadlock: the wait); ``second`` is the other access
    (for a deadlock: the awaited signal, None when no step sends it).
    """

    kind: str  # "race" | "deadlock"
    cls: str
    buffer: str
    first: Location
    second: Location | None
    world: int
    message: str
    timeline: list[str]
    hint: str | None = None
    # a race of the model kept where its real steps were not searched at that W (past
    # races.MAX_REAL_WORK, or a rank deadlocks there): why, and where they are searched
    unsearched: str = ""

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """(kind, class, buffer, step, step): findings are deduplicated on it."""
        return (self.kind, self.cls, self.buffer, self.first.step,
                self.second.step if self.second is not None else "")

    @property
    def steps(self) -> tuple[str, str]:
        return self.key[3], self.key[4]

    @property
    def marks(self) -> tuple[Mark, Mark | None]:
        return self.first.mark, self.second.mark if self.second is not None else None

    @property
    def mark(self) -> Mark:
        """Where the diagnostic points: the later step of a race, the wait of a deadlock."""
        if self.kind == "race" and self.second is not None:
            return self.second.mark
        return self.first.mark

    def diagnostic(self) -> Diagnostic:
        other = self.first if self.kind == "race" else self.second
        notes = []
        if other is not None:
            notes.append(("the other access: " if self.kind == "race" else "the signal: ")
                         + other.text())
        if self.timeline:
            notes.append("a legal execution (of that W):" if not self.unsearched else
                         "the model's order (of that W; not replayed on the real steps):")
            notes += ["  " + line for line in self.timeline]
        hint = "; ".join(h for h in (self.unsearched, self.hint) if h) or None
        return Diagnostic(self.mark, self.kind, self.message, hint=hint, notes=tuple(notes))

    def as_dict(self) -> dict[str, Any]:
        world = str(self.world) if isinstance(self.world, MeshWorld) else self.world  # 2x2
        return {"kind": self.kind, "class": self.cls, "buffer": self.buffer,
                "steps": list(self.steps), "world": world, "message": self.message,
                "first": self.first.as_dict(),
                "second": self.second.as_dict() if self.second is not None else None,
                "timeline": list(self.timeline), "hint": self.hint,
                **({"unsearched": self.unsearched} if self.unsearched else {})}


@dataclass
class HbReport:
    """What ``dcpc.check.hb.check`` found for one schedule over the worlds asked."""

    schedule: str
    file: str
    worlds: list[int]
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    # a W refused before its real-steps search (schedule-too-large): no W after it checked
    refused: list[Diagnostic] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings and not self.refused

    def diagnostics(self) -> list[Diagnostic]:
        """One diagnostic per finding (code "race" or "deadlock"), then the refusal."""
        return [f.diagnostic() for f in self.findings] + list(self.refused)

    def as_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "file": self.file,
                "worlds": [min(self.worlds), max(self.worlds)] if self.worlds else [],
                "ok": self.ok, "findings": [f.as_dict() for f in self.findings],
                "stats": dict(self.stats)}


# --- building findings from what a World found -------------------------------------

def _rk(world: World, rank: int) -> str:
    """``rank 3``, or for a mesh ``rank (node=1, gpu=0)``."""
    return rank_text(world.world, rank, world.program.axis_names)


def _instance(world: World, buffer: str, owner: int, slot: int | None) -> str:
    tail = (f", slot {slot}]" if slot is not None else
            "] (persists)" if buffer in world.program.persistent else "] (shared)")
    return f"{buffer}[{_rk(world, owner)}" + tail


def _member(world: World, rank: int, axes: tuple[int, ...] | None) -> int:
    """``rank``'s index in its team along ``axes`` (a team store's part is the writer's
    member index); the rank itself without a team."""
    if axes is None:
        return rank
    return torus(shape_of(world.world)).team(rank, axes).index(rank)


def _touch_location(world: World, t: Touch, slot: int | None) -> Location:
    program = world.program
    step = program.steps[program.events[t.j].step]
    region = _instance(world, t.access.buffer, t.owner, slot)
    if t.access.chunk_text:  # a chunk of it (b[s][e]), as the file writes it
        region += f" (its chunk {t.access.chunk_text})"
    if t.access.region is not None:
        into = None if t.owner == t.rank else _rk(world, t.owner)  # a one-peer store's
        region += " " + t.access.region.text(_member(world, t.rank, t.access.region.axes), into)
    lands = ""
    if t.access.lands is not None and t.access.lands != step.index:
        wait = program.steps[t.access.lands]
        region += f", in flight until its wait {wait.name} ({wait.mark})"
        lands = wait.name
    return Location(t.rank, t.call, t.call % program.slots, step.name, step.index,
                    t.access.kind, region, step.mark, _rk(world, t.rank), lands, t.owner,
                    t.access.returned)


def race_cut(world: World, race: RawRace) -> list[int]:
    """Per (rank q, stream s) how many events ran: the union of both accesses'
    strict HB-predecessors, a consistent cut from which both run next."""
    a, b = race.first, race.second
    before_a = strict_predecessors(world, a.rank, world.pos(a.call, a.j))
    before_b = strict_predecessors(world, b.rank, world.pos(b.call, b.j))
    return [max(x, y) for x, y in zip(before_a, before_b, strict=True)]


def race_finding(world: World, race: RawRace, unsearched: tuple[str, str] | None = None
                 ) -> Finding:
    """A race with its counterexample: the cut of both accesses' predecessors.
    ``unsearched``: (why, where) the ranks' real steps were not searched for it at this W
    (the checker's _where_both_run): the race is the model's, kept (sound) and said so."""
    a, b = race.first, race.second
    la, lb = _touch_location(world, a, race.slot), _touch_location(world, b, race.slot)
    pa, pb = world.pos(a.call, a.j), world.pos(b.call, b.j)
    cut = race_cut(world, race)
    verb = {"read": "reading", "write": "writing"}
    pending = {(a.rank, pa): f"→ {verb[la.access]} {la.region}",
               (b.rank, pb): f"→ {verb[lb.access]} {lb.region}"}
    if (a.rank, pa) == (b.rank, pb):
        pending[(a.rank, pa)] = f"→ {verb[la.access]} and {verb[lb.access]} {la.region}"
    ranks = involved_ranks(world, [a.rank, b.rank], [
        strict_predecessors(world, a.rank, pa),
        strict_predecessors(world, b.rank, pb)])
    timeline = render(world, cut, pending, ranks) + left_out(world, ranks)
    where = f"(W={world.world})"
    na, nb = _rk(world, la.rank), _rk(world, lb.rank)
    if la.lands or lb.lands:  # a split-phase shift's store, in flight from put to wait
        message = _flight_message(world, race, la, lb, where)
    elif race.cls == WAR:
        message = (f"write-after-read race on {race.buffer}: {lb.step} on {nb} "
                   f"(call {lb.call}) can write {lb.region} while "
                   f"{access_text(la, na, 'still reads', 'it')} {where}")
    elif race.cls == RAW:
        message = (f"read-after-write race on {race.buffer}: "
                   f"{access_text(lb, nb, 'can read', lb.region)} before {la.step} on {na} "
                   f"(call {la.call}) finished writing it {where}")
    else:
        assert race.cls == WAW
        message = (f"write-after-write race on {race.buffer}: {la.step} on {na} "
                   f"(call {la.call}) and {lb.step} on {nb} (call {lb.call}) can "
                   f"write {lb.region} in either order {where}")
    if unsearched is None:
        return Finding("race", race.cls, race.buffer, la, lb, world.world, message, timeline)
    why, searched = unsearched
    return Finding("race", race.cls, race.buffer, la, lb, world.world,
                   f"{message}: the model's race, its real steps not searched at that W "
                   f"({why}), so maybe one no execution makes", timeline,
                   unsearched=f"the real-steps search, which drops a race of the model no "
                   f"execution makes, runs {searched}")


def access_text(loc: Location, who: str, verb: str, what: str) -> str:
    """A read of a race in words, the one wording: "attention on rank 0 (call 0) still
    reads it"; the engine's read of what a step returned (``Location.returned``): "the
    engine still reads what gather on rank 0 (call 0) returned" (``what`` then named
    only when it is a region: "... returned, g[rank 0]")."""
    if not loc.returned:
        return f"{loc.step} on {who} (call {loc.call}) {verb} {what}"
    return (f"the engine {verb} what {loc.step} on {who} (call {loc.call}) returned"
            + ("" if what == "it" else f", {what},"))


def _flight_message(world: World, race: RawRace, la: Location, lb: Location,
                    where: str) -> str:
    """A race with a store in flight: what touches the instance between the push and the
    wait that lands it (another push, when both are in flight)."""
    instance = _instance(world, race.buffer, race.first.owner, race.slot)
    fly, other = (la, lb) if la.lands else (lb, la)
    if la.lands and lb.lands:  # the later-landing push meets the earlier one in flight
        fly, other = la, lb
        does = f"push (landing at its wait {lb.lands}) into"
    else:
        does = {"read": "read", "write": "write"}[other.access]
    return (f"{race.cls} race on {race.buffer}: "
            f"{access_text(other, _rk(world, other.rank), f'can {does}', instance)} "
            f"while the store of {fly.step} on "
            f"{_rk(world, fly.rank)} (call {fly.call}) into it is in flight, until its wait "
            f"{fly.lands} {where}")


def _sides(world: World, dead: RawDeadlock, me: int, peer: int,
           unsent: bool = False) -> tuple[Location, Location | None]:
    """A deadlock's wait on ``me`` and the signal of ``peer`` it waits for (None: no step
    sends it, or ``unsent``: the step that would is skipped there)."""
    program = world.program
    channel = program.channel_text(dead.channel)
    wait_step = program.steps[program.events[dead.wait_j].step]
    first = Location(me, 0, 0, wait_step.name, wait_step.index, "wait",
                     f"channel {channel} from {_rk(world, peer)}", wait_step.mark)
    if dead.signal_j is None or unsent:
        return first, None
    sig = program.steps[program.events[dead.signal_j].step]
    return first, Location(peer, 0, 0, sig.name, sig.index, "signal",
                           f"channel {channel} to {_rk(world, me)}", sig.mark)


def _cycle(wait: str, who: str, signal: str, of: str, channel: str) -> str:
    """The one wording of a cycle of waits (a deadlock's)."""
    return (f"{wait} on {who} waits for {signal} of {of} (channel {channel}), which can "
            f"only run after a wait that depends on {wait} itself: a cycle of waits")


def _wait_text(world: World, j: int, rank: int, sources: list[int] | None | tuple = ()) -> str:
    """Why rank's event j (a wait) never ends: the model's peers, or (``sources``, a
    list: legal.Execution.deadlocked's) the ranks whose signal it still waits for, None
    where one is never sent there."""
    program, w = world.program, world.world
    parts = []
    if sources is None:
        parts.append("a signal that no rank sends it (the step that would is skipped)")
    elif sources != ():
        js = next((js for _, js in world.match.get(j, ()) if js is not None), None)
        name = program.steps[program.events[js].step].name if js is not None else "signal"
        parts += [f"{_rk(world, src)}'s {name}, which never runs" for src in sources]
    for d, js in world.match.get(j, ()) if sources == () else ():
        peer = torus(shape_of(w)).add(rank, d)
        if js is None:
            channel = program.channel_text(program.events[j].wait[0])  # type: ignore[index]
            parts.append(f"a signal from {_rk(world, peer)} on channel {channel} that no "
                         "step sends")
        elif not world.live[js]:
            parts.append(f"{_rk(world, peer)}'s {program.steps[program.events[js].step].name}, "
                         "which never runs")
    return "⏳ waits for " + "; ".join(parts[:3]) + (" ..." if len(parts) > 3 else "")


def _offset(delta: int, world: int) -> str:
    if isinstance(world, MeshWorld):
        return "r + " + str(torus(world.shape).coords(delta))
    return "r-1" if delta == world - 1 and world > 2 else f"r+{delta}"


Blocked = dict[int, tuple[int, list[int] | None]]  # legal.Execution.blocked's


def deadlock_finding(world: World, dead: RawDeadlock, stuck: list[int] | None = None,
                     blocked: Blocked | None = None, real: Blocked | None = None) -> Finding:
    """A deadlock with the execution that gets stuck: every event that can run (the
    model's, the same on every rank; ``stuck``: where the ranks' real steps stop under
    their when: guards, legal.Execution.stuck), shown from a rank stuck at its wait;
    ``blocked`` (legal.Execution.blocked): the signals each stuck rank still waits for;
    ``real`` (its deadlocked rows), which name the rank shown stuck at the wait and its
    peer."""
    program, w, streams = world.program, world.world, world.streams
    _, _, channel, wait_name, signal_name = dead.key(world)
    if stuck is None:
        live_count = [0] * streams
        for pos, alive in enumerate(world.live):
            if alive:
                live_count[program.stream_of(*divmod(pos, world.n))] += 1
        stuck = live_count * w
    at = [(q, positions[stuck[q * streams + s]]) for q in range(int(w)) for s in range(streams)
          if stuck[q * streams + s] < len(positions := stream_positions(world, s))]
    me = next((q for q, p in at if p % world.n == dead.wait_j), 0)
    topo = torus(shape_of(w))
    peer = topo.add(me, dead.delta)
    waiting = {(row // streams, p): srcs for row, (p, srcs) in (blocked or {}).items()}
    unsent = False  # the real wait's signal is never sent (its step skipped there)
    if real:  # a rank really stuck at the wait, the peer one it still waits for
        me, srcs = next(((row // streams, srcs) for row, (p, srcs) in real.items()
                         if p % world.n == dead.wait_j), (me, []))
        unsent = srcs is None
        peer = next(iter(srcs or []), peer)
    first, second = _sides(world, dead, me, peer, unsent)
    ranks = involved_ranks(world, [me, peer])
    pending = {(q, p): _wait_text(world, p % world.n, q, waiting.get((q, p), ()))
               for q, p in at if q in ranks}
    cut = stuck
    timeline = render(world, cut, pending, ranks) + left_out(world, ranks)
    if unsent:
        message = (f"deadlock: {wait_name} on {_rk(world, me)} (call 0) waits for a signal "
                   f"on channel {channel} that {_rk(world, peer)} never sends it: the step "
                   f"that would is skipped there (its when: does not hold) (W={w})")
    elif real:
        cycle = _cycle(wait_name, _rk(world, me), signal_name, _rk(world, peer), channel)
        message = f"deadlock: {cycle} (W={w})"
    elif dead.cls == CYCLE:
        # a wait for the rank itself (its own flag, `from: self`): delta 0
        of = f"rank {_offset(dead.delta % w, w)}" if dead.delta % w else "rank r itself"
        message = (f"deadlock: {_cycle(wait_name, 'every rank r', signal_name, of, channel)} "
                   f"(W={w})")
    else:
        message = (f"deadlock: {wait_name} on {_rk(world, me)} (call 0) waits for a signal "
                   f"from {_rk(world, peer)} on channel {channel}, but no step of "
                   f"{_rk(world, peer)} sends one to {_rk(world, me)} (W={w})")
    cls = NO_SIGNAL if unsent else dead.cls  # the model's cycle, a signal skipped really
    return Finding("deadlock", cls, channel, first, second, w, message, timeline)

