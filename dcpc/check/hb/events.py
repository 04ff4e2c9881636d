"""The events of one call on one rank, read off the lowered plan, and wait matching.

The checker analyses the plan the code generator emits (dcpc.codegen.plan), not the
schedule: each step's effects and its signal slots come from ``StepPlan.effects`` and
``StepPlan.sync`` (both from dcpc.lang.semantics, the one definition of every op).
Every step becomes up to two *coarse events*:

- a step that signals is a ``send`` event (its effects ``before`` the signal: local
  reads, payload stores into every rank's instance of a receive buffer) carrying one
  signal per peer on the step's own slots;
- a step that waits is a ``recv`` event polling the slots of step ``sync.polls`` from
  every peer it names, followed by its effects ``after`` the wait (e.g. the merge of
  an ``all_to_all_combine``);
- every other step is one ``local`` event with its effects.

Merging the per-peer stores with the signals (and the wait with what follows it)
loses nothing: anything ordered after one store of a send is ordered after its
signals too (a peer only learns of a store through the signal), and the accesses
after a wait are ordered exactly like the wait. The brute-force oracle
(tests/support/hb_oracle.py) keeps every per-peer store, signal and wait apart and agrees
with this model; the execution oracle (dcpc.check.oracle) runs the plan's slots and
epochs themselves.

Only symmetric buffers are tracked: engine-owned buffers are passed in per call and
never written by peers. A symmetric buffer has one instance per (rank, slot), or one
per rank when ``shared: true`` (or ``persist: true``; a persistent local buffer is
tracked too, as one instance per rank that only its rank touches).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import TYPE_CHECKING, Any

from dcpc.codegen.plan import chunks as plan_chunks
from dcpc.codegen.plan import tracked as tracked_buffers
from dcpc.codegen.plan import views as plan_views
from dcpc.diagnostics import Mark
from dcpc.lang.mesh import MeshWorld, mesh_of, shape_of, torus
from dcpc.lang.model import Peers, Schedule, Streams
from dcpc.lang.semantics import AFTER, BEFORE, Effect, Region
from dcpc.ops.common import peer_offset, perm_deltas, perm_table

if TYPE_CHECKING:
    from dcpc.codegen.plan import Plan

PHASE_ORDER = {"send": 0, "local": 0, "recv": 1}


@dataclass(frozen=True)
class Access:
    """One access of an event to a symmetric buffer.

    ``region is None``: this rank reads or writes its own whole instance.
    Otherwise a store into EVERY rank's instance (its own included) of the part
    ``region`` assigns to the writing rank, or (scheme ``peer``) into the whole
    instance of rank ``writer + region.offset`` only. ``lands``: a store in flight
    from the push until the owner's wait of that step (``Effect.lands``), an interval
    (dcpc.check.hb.races), placed there by the data flow. An effect on the root only
    (``Effect.root``) is taken on every rank: the symmetry needs every rank's accesses
    alike, and more accesses only add races.
    """

    buffer: str
    kind: str  # "read" | "write"
    region: Region | None = None
    lands: int | None = None
    returned: bool = field(default=False, compare=False)  # the engine's read of what the
    # method returns, at its return (for the message only: equal to a plain read)
    # a local access of a chunk of the buffer (``b[s][e]``, ``b[s][:, e]``: a view of the
    # slot, ``BufferPlan.view_axis`` / ``view_index``): (axis, index); None: the whole.
    # It meets a store of scheme ``index`` along that axis only where the writer's part
    # is that index (dcpc.check.hb.races ``_apart``)
    chunk: tuple[int, int] | None = None
    chunk_text: str = field(default="", compare=False)  # the chunk as the file writes it

    @property
    def remote(self) -> bool:
        return self.region is not None


@dataclass(frozen=True)
class Event:
    """A coarse event of one call on one rank: one phase of a step."""

    step: int  # index into Program.steps
    phase: str  # "send" | "recv" | "local"
    accesses: tuple[Access, ...] = ()
    signal: tuple[str, Peers | str] | None = None  # (channel: the step's own slots, to)
    wait: tuple[str, Peers | str] | None = None  # (channel: the polled step's slots, from)
    axes: tuple[int, ...] | None = None  # its team's mesh axes (dcpc.lang.mesh); None: all


@dataclass(frozen=True)
class StepInfo:
    name: str
    index: int
    kind: str
    mark: Mark


@dataclass(frozen=True)
class Program:
    """What one rank does in one call, as coarse events, plus slots and streams."""

    name: str
    file: str
    slots: int
    per_slot: bool
    steps: tuple[StepInfo, ...]
    events: tuple[Event, ...]
    shared: dict[str, bool]  # every tracked (symmetric) buffer -> shared: true?
    channel_names: dict[str, str]  # channel -> what the schedule calls it
    axis_names: tuple[str, ...] = ("world",)  # the mesh's axes (dcpc.lang.mesh)
    persistent: frozenset[str] = frozenset()  # the tracked buffers with persist: true
    # PROTOTYPE (docs/proposals/roles.md): per event j, the role (program order) of the rank that
    # runs it; () = one role, the plain program order. Roles of one rank run at once,
    # ordered by their signals/waits only (a ``to: self`` signal of one role polled by a
    # ``from: self`` wait of another), and a call forks them at its start and joins them
    # at its end. Only one stream of slots (``per_slot`` False) takes roles here.
    roles: tuple[int, ...] = ()
    role_names: tuple[str, ...] = ()  # role k's name (the counterexample's lines)

    @cached_property
    def recv_of(self) -> dict[int, int]:
        """Step index -> its recv event (where a store in flight into it lands)."""
        return {e.step: j for j, e in enumerate(self.events) if e.phase == "recv"}

    @property
    def role_count(self) -> int:
        return max(self.roles, default=0) + 1

    def role(self, j: int) -> int:
        """The role of event j (0 with one role)."""
        return self.roles[j] if self.roles else 0

    @cached_property
    def role_positions(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(per event j its position among its role's events, per role its event count)."""
        seen = [0] * self.role_count
        positions = []
        for j in range(len(self.events)):
            positions.append(seen[self.role(j)])
            seen[self.role(j)] += 1
        return tuple(positions), tuple(seen)

    def role_previous(self, j: int) -> int | None:
        """The event of j's role just before j in the same call (program order), or None."""
        for i in range(j - 1, -1, -1):
            if self.role(i) == self.role(j):
                return i
        return None

    def role_last(self) -> tuple[int, ...]:
        """Per role that has events, its last event of a call (what the call's join waits for)."""
        last: dict[int, int] = {}
        for j in range(len(self.events)):
            last[self.role(j)] = j
        return tuple(last.values())

    @property
    def streams_per_rank(self) -> int:
        if self.roles:
            return self.role_count
        return self.slots if self.per_slot else 1

    def stream_of(self, call: int, j: int) -> int:
        """The stream of a rank that runs event j of ``call``: its slot's, or with roles
        its role's."""
        return self.role(j) if self.roles else self.stream(call)

    def default_calls(self) -> int:
        """Calls 0 .. 2*slots-1: enough to prove every call (see dcpc.check.hb)."""
        return 2 * self.slots

    def stream(self, call: int) -> int:
        """The stream of a rank that runs ``call`` (0 .. streams_per_rank-1)."""
        return call % self.slots if self.per_slot else 0

    def stream_index(self, call: int, j: int) -> int:
        """Position of event ``j`` of ``call`` in its stream (0-based)."""
        if self.roles:
            positions, counts = self.role_positions
            return call * counts[self.role(j)] + positions[j]
        rounds = call // self.slots if self.per_slot else call
        return rounds * len(self.events) + j

    def previous_call(self, call: int) -> int:
        """The call before ``call`` on the same stream, or -1."""
        return call - (self.slots if self.per_slot else 1)

    def channel_text(self, channel: str) -> str:
        return self.channel_names.get(channel, channel)


def peer_deltas(peers: Peers | str, world: int, axes: tuple[int, ...] | None = None
                ) -> frozenset[int]:
    """The translations of the peers ``all``/``next``/``prev`` name along ``axes`` (rank
    offsets mod W for one axis; torus translations of a mesh, dcpc.lang.mesh), or of a
    shift's one offset "+k" / "-k" (or "line+k"); never 0 but for ``self`` (the rank's
    own flag: {0}, the rank itself, so a wait before the self signal it polls is a cycle
    of program order, the deadlock it is; after it, the join adds nothing). Cached:
    match_waits asks it once per wait and peer (O(W^2) sets at W=1024). The cache is keyed
    by the shape: a mesh shape equals its W as an int (``MeshWorld``), and a perm's deltas
    differ between the two."""
    return _peer_deltas(peers, shape_of(world), isinstance(world, MeshWorld), axes)


@cache
def _peer_deltas(peers: Peers | str, shape: tuple[int, ...], mesh: bool,
                 axes: tuple[int, ...] | None) -> frozenset[int]:
    world = MeshWorld(shape) if mesh else shape[0]
    if peers == Peers.self:
        return frozenset({0})
    found = perm_table(peers) if isinstance(peers, str) else None
    if found is not None:  # a perm: every delta on every rank (its waits join no clock)
        return perm_deltas(found, world)
    if isinstance(world, MeshWorld):
        if isinstance(peers, Peers):
            return torus(world.shape).deltas(peers.value, axes)
        # a shift along one axis (the structural check: a team of one axis), "line+k"
        # taken cyclically as below
        return torus(world.shape).deltas(f"{peer_offset(peers)[0]:+d}", axes)
    if world < 2:
        return frozenset()
    if peers == Peers.all:
        return frozenset(range(1, world))
    if peers in (Peers.next, Peers.prev):
        return frozenset({1 % world if peers == Peers.next else (world - 1) % world})
    # "line+k" (no wrap) is taken as "+k" on every rank: the edge ranks' missing signal
    # and wait only remove orderings, and waits on it join no clock (clocks.analyze)
    return frozenset({peer_offset(peers)[0] % world}) - {0}


def _peers(spec: str) -> Peers | str:
    """A sync's peers as the events keep them: a Peers, or a shift's offset "+k"."""
    return Peers(spec) if spec in Peers.__members__ else spec


def negate(world: int, d: int) -> int:
    """The inverse translation of ``d``."""
    return torus(shape_of(world)).neg(d)


def match_waits(program: Program, world: int) -> dict[int, list[tuple[int, int | None]]]:
    """For every event with a wait: [(source delta d, event j of the matching signal)].

    The wait of rank r polls, for each rank ``r + d`` its ``from`` names, the slot that
    rank's step ``polls`` stores into; the epoch it waits for counts the calls of its
    slot, as the signal's does, so call c's wait is satisfied by call c's signal of
    that step. ``None``: that step's signal never goes to r (a hang).
    """
    sender = {e.signal[0]: j for j, e in enumerate(program.events) if e.signal is not None}
    out: dict[int, list[tuple[int, int | None]]] = {}
    # (source delta, whether the signal reaches) depends on the two events' peers and
    # axes only: computed once per such pattern (O(W) each), not once per wait
    patterns: dict[tuple[Any, ...], list[tuple[int, bool]]] = {}
    for j, e in enumerate(program.events):
        if e.wait is None:
            continue
        channel, peers = e.wait
        js = sender.get(channel)
        signal = program.events[js] if js is not None else None
        sent = (signal.signal[1], signal.axes) if signal is not None else None  # type: ignore[index]
        pattern = (peers, e.axes, sent)
        if pattern not in patterns:
            patterns[pattern] = [
                (d, sent is not None and negate(world, d) in peer_deltas(sent[0], world, sent[1]))
                for d in sorted(peer_deltas(peers, world, e.axes))]
        for d, reaches in patterns[pattern]:
            out.setdefault(j, []).append((d, js if reaches else None))
        if js is not None and own_tail(program, js, j, world):
            out.setdefault(j, []).append((0, js))
    return out


def own_tail(program: Program, js: int, j: int, world: int) -> bool:
    """PROTOTYPE (docs/proposals/roles.md): whether the wait of event j also polls the
    rank's own flag of the put js (its own lane, as DeepEP's own-rank lanes bump their
    own tails): a split step whose put and wait are in different roles, whose put stores
    a part into the rank's OWN instance that lands at that wait (an all_gather's or an
    all_to_all's own block, an offset-0 shift; not a shift to another rank, whose store
    no wait of the rank itself lands). In one role program order orders it. The
    lowering must emit this flag (a signal to itself) for every such step."""
    if not program.roles or program.role(js) == program.role(j):
        return False
    step = program.events[j].step
    topo = torus(shape_of(world))
    return any(a.lands == step and _stores_own(a.region, topo)
               for a in program.events[js].accesses)


def _stores_own(region: Region | None, topo: Any) -> bool:
    """Whether a store of ``region`` reaches the writing rank's own instance (the model
    is rotation-symmetric: rank 0's)."""
    if region is None or region.owners_all:
        return True
    if region.scheme == "peer":
        return topo.peer(0, region.axes, region.offset) == 0
    if region.peer is not None:
        return topo.peer(0, region.axes, region.peer) == 0
    return False  # a line or a perm: refused with roles (clocks.analyze)


def slot_channel(index: int) -> str:
    """The channel of the signal slots step ``index`` owns."""
    return f"slots:{index}"


def lower(schedule: Schedule, plan: Plan | None = None) -> Program:
    """The coarse events of one call of ``schedule`` on one rank (SPMD: every rank),
    read off its lowered ``plan`` (lowered here when not given)."""
    if plan is None:
        from dcpc.codegen.lower import lower as lower_plan

        plan = lower_plan(schedule, [2])
    tracked = tracked_buffers(plan.buffers)
    views = plan_views(plan.buffers)  # a chunk of a slot: an access of the slot
    chunks = plan_chunks(plan.buffers)  # ... of its chunk along one axis of the slot
    steps = schedule.step_list()
    events: list[Event] = []
    names: dict[str, str] = {}
    for i, step in enumerate(plan.steps):
        op = steps[i].op
        sync = step.sync
        effects = [(replace(e, buffer=views.get(e.buffer, e.buffer)), e.buffer)
                   for e in step.effects]
        before = tuple(_access(e, chunks.get(n), schedule.slice_text(n) or "")
                       for e, n in effects if e.when == BEFORE and e.buffer in tracked)
        after = tuple(_access(e, chunks.get(n), schedule.slice_text(n) or "")
                      for e, n in effects if e.when == AFTER and e.buffer in tracked)
        # the engine reads what the method returns, at its return (issue 33 flaky22: an
        # all_gather's output a peer's next call pushes into before this rank's wait
        # returns was proved "ok" while the run returned the next call's data)
        returned = tuple(Access(b, "read", returned=True) for b in step.returns if b in tracked)
        if sync.wait is None and sync.signal is None and not after:
            before += returned  # a local step: its one event
        else:
            after += returned  # after the wait (or a local event after the signal)
        if sync.signal is not None:
            channel = slot_channel(i)
            names[channel] = getattr(op, "channel", step.name)
            events.append(Event(i, "send", before, signal=(channel, _peers(sync.signal)),
                                axes=sync.axes))
        elif before or sync.wait is None:
            events.append(Event(i, "local", before))
        if sync.wait is not None:
            if sync.polls is None:  # no signal step to poll: the checker reports a hang
                channel = "unpolled:" + op.channel  # type: ignore[attr-defined]
                names[channel] = op.channel  # type: ignore[attr-defined]
            else:
                channel = slot_channel(sync.polls)
            events.append(Event(i, "recv", after, wait=(channel, _peers(sync.wait)),
                                axes=sync.axes))
        elif after:
            events.append(Event(i, "local", after))
    return Program(
        name=schedule.schedule,
        file=schedule.source_file,
        slots=schedule.slots,
        per_slot=schedule.streams == Streams.per_slot and schedule.slots > 1,
        steps=tuple(StepInfo(s.name, s.index, s.kind, s.mark()) for s in steps),
        events=tuple(events),
        shared=tracked,
        channel_names=names,
        axis_names=mesh_of(schedule).axes,
        persistent=frozenset(b.name for b in plan.buffers if b.persist),
    )


def _access(effect: Effect, chunk: tuple[int, int] | None = None, text: str = "") -> Access:
    local = effect.region is None and chunk is not None
    return Access(effect.buffer, effect.kind, effect.region, effect.lands,
                  chunk=chunk if local else None, chunk_text=text if local else "")


def with_roles(program: Program, roles: dict[str, str]) -> Program:
    """PROTOTYPE (docs/proposals/roles.md): ``program`` with each step in a role, ``roles`` mapping
    every step name to a role name (numbered in order of first appearance). The roles of
    one rank run at once, each in its own program order (``Program.roles``). No language
    key sets this yet: the checker's part only, called by hand (tests/check/test_roles.py)."""
    missing = [s.name for s in program.steps if s.name not in roles]
    if missing:
        raise ValueError(f"no role for step(s) {', '.join(missing)}")
    number: dict[str, int] = {}
    for s in program.steps:
        number.setdefault(roles[s.name], len(number))
    return replace(program, roles=tuple(number[roles[program.steps[e.step].name]]
                                        for e in program.events),
                   role_names=tuple(number))
