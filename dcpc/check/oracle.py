"""An execution oracle: run the lowered plan's per-rank programs and watch what happens.

    explore(plan, world, ...) -> OracleReport      (.findings, .keys(), .pairs())

Independent of the happens-before checker (dcpc.check.hb): it reads only the plan the
kernels are emitted from (dcpc.codegen.plan: per step its ``effects`` and ``sync``; the
ranks a sync's peers name: dcpc.ops.common ``peers_of``, shared with the checker's
real-steps cut, dcpc.check.hb.legal) and
executes it the way templates/sync.j2 does, one rank after another in an interleaving
chosen by a scheduler:

- streams: one per (rank, slot) with ``streams: per_slot`` and more than one slot, else
  one per rank; call ``i`` uses slot ``i % slots``; a stream runs its calls in order and
  every call runs the plan's steps in order;
- a signalling step advances its own epoch of channel ``index * slots + slot`` once per
  call (per rank: epoch = number of calls of that slot so far, the first is 1), runs its
  ``before`` effects (the push), stores the epoch into ``sig[channel, RANK]`` of each
  peer its ``signal`` names (a release), then, for each peer its ``wait`` names in the
  kernel's order, spins on its own ``sig[polls channel, peer]`` until the wrap-safe
  ``(int32)(got - epoch) >= 0`` (acquire loads of the latest value: the polls are
  atomic read-modify-writes), then runs its ``after`` effects. The kernels release to
  every peer at once and poll every peer at once (templates/sync.j2); nothing happens
  between the polls and the sync is monotone, so polling one peer after another passes
  exactly when all have arrived, with the same stores readable: the same runs;
- symmetric instances: one per (rank, slot), one per rank for ``shared`` buffers; a
  store with a region writes part ``writer`` of EVERY rank's instance (parts of one
  partition overlap only for equal writers, different partitions always overlap), a
  ``peer`` region (shift) the whole instance of rank ``writer + offset`` only, a
  ``line`` region (shift, ``wrap: false``) that one when it is a rank (none past
  either end, whose "line+k" signals and waits are skipped too), a ``perm`` region
  (shift's ``perm:``) the whole instance of rank ``table[writer]`` only (none for -1;
  its "perm:<table>" signals and waits go to each rank's own peer in the table, none
  where it is -1 or the rank itself); region None is the
  own instance, whole. Engine and output buffers are not tracked, but a persistent
  output (one instance per rank: dcpc.codegen.plan.tracked).

Happens-before of the ACTUAL run is tracked with vector clocks (one entry per stream):
program order within a stream, and a wait that reads value v synchronises with the
release store that wrote v. A race is two accesses to one instance, at least one a
write, overlapping, neither of which ends before the other starts in this run. An
access starts and ends at itself; a store with ``lands`` (a split-phase shift's) starts
at its push and ends when the owner of the instance has passed the wait of step
``lands``, where the data flow writes it: anything that touches the instance between
the two is a race, whether the run orders it after the push or not. A hang is a state
where every unfinished stream spins on a wait that cannot pass.

Which runs. The sync is monotone (a signal slot only grows, so a wait that can pass
stays passable) and there is no other control flow, so every maximal run executes the
same accesses and ends in the same hang or in none: hangs do not depend on the
interleaving. Races do only through which store each wait reads: reading a later store
of the same writer only adds happens-before (that store follows the earlier one in
the writer's program order), so the fewest orderings, and the most races, come from
runs where every wait passes on the FIRST store that satisfies it. The schedulers aim
at that: ``lockstep`` runs the lowest call first (a writer's next store to a slot
belongs to a later call, so it waits until the readers of the previous one polled),
``hold`` delays every signal until nothing else can move (each store is then read at
once), ``random`` picks any runnable stream, ``delay`` starves one rank. ``exhaustive``
(tiny cases) explores every interleaving of the sync actions, memoised on the state;
tests/check/test_exec_oracle_agreement.py checks that one lockstep run reaches what every
interleaving reaches.

Not modelled: a kernel's programs (one program per kernel: each program of a real
kernel has its own epoch and signal slot and waits for the same program of its peers,
and the whole kernel ends before the next one on the stream starts), the fingerprint
and failure words of the run-time guard (contract violations are not races), tiles
(regions are whole parts of a partition) and epoch wrap-around (runs are short).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dcpc.codegen.plan import chunks as plan_chunks
from dcpc.codegen.plan import tracked as tracked_buffers
from dcpc.codegen.plan import views as plan_views
from dcpc.exprs import holds
from dcpc.ops.common import peers_of
from dcpc.topology import shape_of, torus

WAR, RAW, WAW = "write-after-read", "read-after-write", "write-after-write"
POLICIES = ("lockstep", "hold", "random", "delay")
_MASK, _HALF = 0xFFFFFFFF, 0x80000000


@dataclass(frozen=True)
class OStep:
    """One step as the oracle executes it (from a StepPlan; only tracked buffers)."""

    name: str
    index: int
    # (buffer, write, partition, the step whose wait lands a store in flight or None)
    before: tuple[tuple[str, bool, tuple | None, int | None], ...]
    after: tuple[tuple[str, bool, tuple | None, int | None], ...]
    signal: str | None
    wait: str | None
    polls: int | None
    channel: str  # how findings name its channel
    axes: tuple[int, ...] | None = None  # the team's mesh axes; None: every axis
    when: tuple | None = None  # its when: condition (a dcpc.exprs AST): runs where it holds
    # the engine's reads of what the method returns (the last of ``after``): made where
    # the when: fails too (the method is called on every rank and returns what it holds)
    returned: tuple[tuple[str, bool, tuple | None, int | None], ...] = ()


@dataclass(frozen=True)
class OProgram:
    slots: int
    per_slot: bool
    steps: tuple[OStep, ...]
    shared: dict[str, bool]  # tracked buffer -> one instance for all slots
    # what a when: condition reads besides rank and W: the integer sizes, and the mesh
    # (axis, its size name or int) outermost first
    sizes: dict[str, int] = field(default_factory=dict)
    mesh: tuple[tuple[str, Any], ...] = ()
    # PROTOTYPE (docs/proposals/roles.md): per step, its role; () = one role. The roles of a rank
    # are streams of their own (with one stream of slots), each running its role's steps
    # of every call; a call's roles join at its end (a spin of each role's first action
    # of call c on every other role's end of call c - 1: release stores into cells of
    # their own, after the signal pads)
    roles: tuple[int, ...] = ()


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def program(plan: Any, channels: dict[str, str] | None = None) -> OProgram:
    """The oracle's view of a plan (duck-typed: a dcpc.codegen.plan.Plan or the same
    fields as attributes or dict keys). ``channels``: step name -> channel name for
    findings (default: the plan step's ``attrs["channel"]``, else the polled step)."""
    tracked = tracked_buffers(_attr(plan, "buffers"))
    views = plan_views(_attr(plan, "buffers"))  # a chunk of a slot: an access of the slot
    # ... of its chunk along one axis of the slot: apart from a store of scheme index
    # along that axis whose part is another chunk (dcpc.check.hb.races ``_meets``)
    chunks = plan_chunks(_attr(plan, "buffers"))
    plan_steps = list(_attr(plan, "steps"))
    steps = []
    for s in plan_steps:
        before, after = [], []
        for e in _attr(s, "effects") or ():
            buffer = _attr(e, "buffer")
            chunk = chunks.get(buffer)
            buffer = views.get(buffer, buffer)
            if buffer not in tracked:
                continue
            region = _attr(e, "region")
            part = None if region is None else (
                _attr(region, "scheme"), _attr(region, "dim"), _attr(region, "interleave", 0),
                _attr(region, "offset", 0), _attr(region, "axes"),
                tuple(_attr(region, "table", ()) or ()))
            # a store into one peer's instance (Region.peer): its partition is the
            # scheme's, the peer says whose instance it reaches
            item = (buffer, _attr(e, "kind") == "write", part, _attr(e, "lands"),
                    None if region is None else _attr(region, "peer"),
                    chunk if region is None else None)
            (after if _attr(e, "when") == "after" else before).append(item)
        # the engine reads what the method returns, at its return (dcpc.check.hb.events)
        returned = tuple((b, False, None, None, None, None) for b in _attr(s, "returns") or ()
                         if b in tracked)
        after.extend(returned)
        sync = _attr(s, "sync")
        signal, wait, polls = (_attr(sync, "signal"), _attr(sync, "wait"),
                               _attr(sync, "polls")) if sync is not None else (None, None, None)
        axes = _attr(sync, "axes") if sync is not None else None
        name = _attr(s, "name")
        channel = (channels or {}).get(name) or (_attr(s, "attrs") or {}).get("channel")
        if channel is None:
            channel = name if polls is None or polls == _attr(s, "index") else \
                _attr(plan_steps[polls], "name")
        when = (_attr(s, "attrs") or {}).get("when")
        steps.append(OStep(name, _attr(s, "index"), tuple(before), tuple(after), signal,
                           wait, polls, channel, axes, _tuple(when), returned))
    slots = _attr(plan, "slots")
    sizes = {_attr(z, "name"): _attr(z, "value") for z in _attr(plan, "sizes") or ()
             if _attr(z, "kind") == "const"}
    return OProgram(slots, _attr(plan, "streams") == "per_slot" and slots > 1, tuple(steps),
                    tracked, sizes, tuple(tuple(a) for a in _attr(plan, "mesh") or ()))


def _tuple(tree: Any) -> Any:
    """A condition AST as tuples (a plan read back from JSON holds lists)."""
    return tuple(_tuple(t) for t in tree) if isinstance(tree, list | tuple) else tree


def runs(prog: OProgram, st: OStep, rank: int, world: int) -> bool:
    """Whether ``st`` runs on ``rank`` (its ``when:``; a condition that cannot be
    evaluated counts as holding: more accesses only add races)."""
    if st.when is None:
        return True
    env = {**prog.sizes, "rank": rank, "W": int(world)}
    shape = getattr(world, "shape", None)
    if prog.mesh and shape is not None and len(shape) == len(prog.mesh):
        for (axis, size), coord, n in zip(prog.mesh, _coords(rank, shape), shape, strict=True):
            env[axis] = coord
            if isinstance(size, str):
                env[size] = n
    try:
        return holds(st.when, env)
    except (ArithmeticError, ValueError, KeyError):
        return True


def _coords(rank: int, shape: Sequence[int]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def _rank(coords: Sequence[int], shape: Sequence[int]) -> int:
    rank = 0
    for c, size in zip(coords, shape, strict=True):
        rank = rank * size + c
    return rank


def team_of(rank: int, shape: Sequence[int], axes: tuple[int, ...] | None) -> list[int]:
    """The ranks sharing ``rank``'s coordinates off ``axes`` (all of them: None), by
    linear index (which is member order: row-major over the team's axes)."""
    if axes is None:
        return list(range(_rank([s - 1 for s in shape], shape) + 1))
    mine = _coords(rank, shape)
    total = 1
    for size in shape:
        total *= size
    return [r for r in range(total)
            if all(c == m for a, (c, m) in enumerate(zip(_coords(r, shape), mine, strict=True))
                   if a not in axes)]


@dataclass(frozen=True)
class Finding:
    """A race or a hang the oracle reached.

    Race: ``first``/``second`` are (rank, call, step, access) in the order the schedule
    intends (call, step index, before/after, rank); ``cls`` as the checker names it.
    Hang: ``cls`` "no-signal" (the awaited store never comes: the stream it would come
    from finished or never signals this rank) or "cycle" (waits waiting on each other);
    ``first`` is the wait, ``second`` the step whose signal it polls; ``buffer`` the
    channel. Waits only blocked behind one of those are not findings.
    """

    kind: str  # "race" | "deadlock"
    cls: str
    buffer: str
    first: tuple
    second: tuple | None
    world: int
    run: str

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.kind, self.cls, self.buffer, self.first[2],
                self.second[2] if self.second is not None else "")

    def text(self) -> str:
        def side(s: tuple | None) -> str:
            return "-" if s is None else f"rank {s[0]} call {s[1]} {s[2]} ({s[3]})"
        return (f"{self.kind} {self.cls} on {self.buffer} at W={self.world} ({self.run} run):"
                f" {side(self.first)} / {side(self.second)}")


@dataclass
class OracleReport:
    world: int
    findings: list[Finding] = field(default_factory=list)
    runs: int = 0
    states: int = 0  # exhaustive: distinct states explored
    hung: bool = False
    blocked: list[tuple] = field(default_factory=list)  # (rank, call, step) of every spinning wait
    passed: set[tuple[int, str]] = field(default_factory=set)  # (call, step): a spin passed

    first_calls: int = 1  # calls 0 .. first_calls-1 are the first call of a stream

    def passed_first_call(self, step: str) -> bool:
        """Whether some rank got past one of ``step``'s spins in a stream's first call."""
        return any(s == step and c < self.first_calls for c, s in self.passed)

    def keys(self) -> set[tuple[str, str, str, str, str]]:
        return {f.key for f in self.findings}

    def pairs(self) -> set[tuple[str, str, frozenset[str]]]:
        """(kind, buffer or channel, {steps}): what agreement with the checker compares."""
        return {(f.kind, f.buffer, frozenset(filter(None, f.key[3:]))) for f in self.findings}


# --- compiling a program for one W and a number of calls --------------------------

class _Compiled:
    """Per stream, a flat list of actions; instances, signal slots and streams numbered.

    Actions: (0, accesses, call) local effects, each (instance, write, partition,
    writer, (step index, phase, effect index, data-flow step, data-flow phase), (owner,
    landing step) of a store in flight or None); (1, cells, value) the release stores
    of a signal; (2, cell, epoch, (rank, call, step index, peer)) one peer's spin; (3,
    step index, call) this rank has passed the wait a store in flight lands at.
    """

    def __init__(self, prog: OProgram, world: int, calls: int):
        self.prog, self.world, self.calls = prog, world, calls
        slots, n = prog.slots, len(prog.steps)
        self.nchan = n * slots
        self.ncells = world * self.nchan * world + 1
        self.nowhere = self.ncells - 1  # the slot a wait that polls no step spins on
        self.instances: dict[tuple, int] = {}
        self.inst_buffer: list[str] = []
        per_slot = prog.per_slot
        roles = max(prog.roles, default=0) + 1 if prog.roles else 0
        if roles and per_slot:
            raise ValueError("roles (prototype): one stream of slots")
        self.join_cell = self.ncells  # (rank, role) -> its join cell, after the pads
        self.ncells += world * roles
        self.streams: list[tuple[int, int]] = []  # (rank, slot or -1; with roles: role)
        self.actions: list[list[tuple]] = []
        self.action_call: list[list[int]] = []
        self.signal_pos: dict[tuple[int, int, int], int] = {}  # (rank, call, step) -> pos
        # (rank, call) -> its stream (with roles, the first role's); (rank, call, lane)
        # -> the stream of that lane (a slot, -1, or with roles a role)
        self.stream_of: dict[tuple[int, ...], int] = {}
        templates: dict[tuple[int, int], list[tuple]] = {}
        for rank in range(world):
            for lane in (range(roles) if roles else range(slots) if per_slot else [-1]):
                sid = len(self.streams)
                self.streams.append((rank, lane))
                acts: list[tuple] = []
                acall: list[int] = []
                for call in range(calls):
                    if per_slot and call % slots != lane:
                        continue
                    if not roles or lane == 0:
                        self.stream_of[(rank, call)] = sid
                    self.stream_of[(rank, call, lane)] = sid
                    slot = call % slots
                    epoch = call // slots + 1
                    template = templates.get((rank, slot))
                    if template is None:
                        template = templates[(rank, slot)] = self.template(rank, slot)
                    if roles:  # its role's steps only, after the join of the call before
                        template = [e for e in template if self._role(e) == lane]
                        if call:
                            for other in range(roles):
                                if other != lane:
                                    acts.append((2, self.join_cell + rank * roles + other,
                                                 call, (rank, call, -1, rank)))
                                    acall.append(call)
                    for entry in template:
                        kind = entry[0]
                        if kind in (0, 3):
                            acts.append((kind, entry[1], call))
                        elif kind == 1:
                            self.signal_pos[(rank, call, entry[2])] = len(acts)
                            acts.append((1, entry[1], epoch))
                        else:
                            acts.append((2, entry[1], epoch, (rank, call, entry[2], entry[3])))
                        acall.append(call)
                    if roles:  # this role ended the call: its join
                        acts.append((1, (self.join_cell + rank * roles + lane,), call + 1))
                        acall.append(call)
                self.actions.append(acts)
                self.action_call.append(acall)

    def _own_tail(self, put: int, wait: int, rank: int) -> bool:
        """(roles) whether step ``wait`` of ``rank`` also polls the rank's own flag of step
        ``put``: their roles differ and the put stores into ``rank``'s own instance a part
        landing at that wait (as the checker's events.own_tail)."""
        roles = self.prog.roles
        if not roles or roles[put] == roles[wait]:
            return False
        return any(e[3] == wait and rank in self._owners(e[2], e[4], rank)
                   for e in self.prog.steps[put].before + self.prog.steps[put].after)

    def _role(self, entry: tuple) -> int:
        """The role of a template entry's step (docs/proposals/roles.md prototype)."""
        if entry[0] == 0:
            return self.prog.roles[entry[1][0][4][0]] if entry[1] else 0
        return self.prog.roles[entry[2] if entry[0] in (1, 2) else entry[1]]

    def template(self, rank: int, slot: int) -> list[tuple]:
        """One call of ``rank`` in ``slot``, without its call number and epoch: (0,
        accesses), (1, cells, step index) a signal, (2, cell, step index, peer) a spin,
        (3, step index) a landing."""
        out: list[tuple] = []
        slots, world = self.prog.slots, self.world
        lands = {e[3] for st in self.prog.steps for e in st.before + st.after
                 if e[3] is not None}
        lands_at = {st.index: {e[3] for e in st.before + st.after if e[3] is not None}
                    for st in self.prog.steps}
        for st in self.prog.steps:
            if not runs(self.prog, st, rank, world):
                # its when: fails here: no signal, no wait, no access but the engine's
                # read of what the method returns (issue 33 flaky23)
                accs = self.accesses(st.returned, rank, slot, (st.index, 1))
                if accs:
                    out.append((0, accs))
                continue
            for phase, effects in ((0, st.before), (1, st.after)):
                if phase == 1 and st.wait is not None:
                    for p in peers_of(st.wait, rank, world, st.axes):
                        cell = self.nowhere if st.polls is None else \
                            self.cell(rank, st.polls * slots + slot, p)
                        out.append((2, cell, st.index, p))
                    if st.polls is not None and self._own_tail(st.polls, st.index, rank):
                        out.append((2, self.cell(rank, st.polls * slots + slot, rank),
                                    st.index, rank))
                    if st.index in lands:
                        out.append((3, st.index))
                accs = self.accesses(effects, rank, slot, (st.index, phase))
                if accs:
                    out.append((0, accs))
                if phase == 0 and st.signal is not None:
                    cells = tuple(self.cell(p, st.index * slots + slot, rank)
                                  for p in peers_of(st.signal, rank, world, st.axes))
                    if any(self._own_tail(st.index, w, rank) for w in lands_at.get(st.index, ())):
                        cells += (self.cell(rank, st.index * slots + slot, rank),)
                    out.append((1, cells, st.index))
        return out

    def cell(self, owner: int, channel: int, peer: int) -> int:
        """sig[channel, peer] in ``owner``'s signal pad."""
        return (owner * self.nchan + channel) * self.world + peer

    def instance(self, buffer: str, owner: int, slot: int) -> int:
        key = (buffer, owner, None if self.prog.shared[buffer] else slot)
        found = self.instances.get(key)
        if found is None:
            found = self.instances[key] = len(self.inst_buffer)
            self.inst_buffer.append(buffer)
        return found

    def accesses(self, effects: Iterable[tuple], rank: int, slot: int, where: tuple) -> tuple:
        """(instance, write, partition, writer, (step index, phase, effect index, and
        where the data flow places it: a store in flight at the wait that lands it),
        (owner, landing step) of a store in flight or None)."""
        out = []
        # a line's or perm's push whose store lands nowhere from ``rank`` (past the line's
        # end, -1 in the table) is no push: it reads none of its src either (the brute
        # force, races.made and flow._silent_pushes: Region.target)
        silent = any(write and part is not None and part[0] in ("perm", "line")
                     and not self._owners(part, peer, rank) for _, write, part, _, peer, _
                     in effects)
        for k, (buffer, write, part, lands, peer, chunk) in enumerate(effects):
            place = where if lands is None else (lands, 1)
            if silent and part is None and not write:
                continue
            for owner in self._owners(part, peer, rank):
                # what part of the instance it touches: a chunk (axis, index) of a local
                # access of one, a store's part of an index partition (dim, the writer's
                # member index in the owner's team), else None (the whole)
                cell = (chunk if chunk is not None else
                        (part[1], rank if part[4] is None else
                         team_of(owner, shape_of(self.world), part[4]).index(rank))
                        if part is not None and part[0] == "index" and write else None)
                out.append((self.instance(buffer, owner, slot), write, part, rank,
                            where + (k,) + place, None if lands is None else (owner, lands),
                            cell))
        return tuple(out)

    def _owners(self, part: tuple | None, peer: int | None, rank: int) -> Sequence[int]:
        """The ranks whose instance ``rank``'s access of region ``part`` touches."""
        if part is None:
            return (rank,)
        if peer is not None:  # one peer's instance (a ragged_all_to_all by offset)
            return (torus(shape_of(self.world)).peer(rank, part[4], peer, True),)
        if part[0] == "perm":  # a perm: rank table[r]'s instance only (-1: none)
            return (part[5][rank],) if part[5][rank] >= 0 else ()
        if part[0] in ("peer", "line"):  # a shift: one rank's instance (line: none
            end = torus(shape_of(self.world)).peer(rank, part[4], part[3],
                                                   part[0] == "peer")
            return () if end is None else (end,)  # past either end of its team)
        if part[4] is not None:  # a team's store: its members' instances only
            return team_of(rank, self.world.shape, part[4])  # type: ignore[attr-defined]
        return range(self.world)


# --- one run ------------------------------------------------------------------------

class _Run:
    """The state of one execution: positions, vector clocks, signal slots, accesses."""

    def __init__(self, c: _Compiled):
        n = len(c.streams)
        self.c = c
        self.pos = [0] * n
        self.clock = [[1 if i == t else 0 for i in range(n)] for t in range(n)]
        self.val = [0] * c.ncells
        self.cclk: list[tuple | None] = [None] * c.ncells
        # per instance: {(stream, which access) -> (stamp, write, part, writer, info)}
        self.seen: list[dict] = [dict() for _ in c.inst_buffer]
        self.races: set[tuple] = set()  # (instance, info_a, write_a, info_b, write_b)
        self.passed: set[tuple[int, int]] = set()  # (call, step index) of passed spins
        # (rank, call, step index) -> (stream, stamp) of a wait a store in flight lands at
        self.landed: dict[tuple[int, int, int], tuple[int, int]] = {}

    def clone(self) -> _Run:
        other = object.__new__(_Run)
        other.c = self.c
        other.pos = list(self.pos)
        other.clock = [list(x) for x in self.clock]
        other.val = list(self.val)
        other.cclk = list(self.cclk)
        other.seen = [dict(d) for d in self.seen]
        other.races = set()
        other.passed = set(self.passed)
        other.landed = dict(self.landed)
        return other

    def state(self) -> tuple:
        return (tuple(self.pos), tuple(self.val), tuple(map(tuple, self.clock)))

    def runnable(self, t: int) -> bool:
        acts = self.c.actions[t]
        p = self.pos[t]
        if p >= len(acts):
            return False
        a = acts[p]
        return a[0] != 2 or ((self.val[a[1]] - a[2]) & _MASK) < _HALF

    def step(self, t: int) -> None:
        """Run stream ``t``'s next sync action if it can (a signal's stores, or one
        peer's spin), then the local effects up to its next sync action."""
        acts = self.c.actions[t]
        n = len(acts)
        p = self.pos[t]
        clock = self.clock[t]
        if p < n and acts[p][0] in (1, 2):
            a = acts[p]
            if a[0] == 1:
                snap = tuple(clock)
                for cell in a[1]:
                    self.val[cell] = a[2]
                    self.cclk[cell] = snap
                clock[t] += 1
            else:
                if ((self.val[a[1]] - a[2]) & _MASK) >= _HALF:
                    return  # spinning
                self.passed.add(a[3][1:3])
                src = self.cclk[a[1]]
                if src is not None:
                    for i, v in enumerate(src):
                        if v > clock[i]:
                            clock[i] = v
            p += 1
        while p < n and acts[p][0] in (0, 3):
            if acts[p][0] == 0:
                self._access(t, clock, acts[p][1], acts[p][2])
            else:  # later accesses that see this stamp happen after the landing
                self.landed[(self.c.streams[t][0], acts[p][2], acts[p][1])] = (t, clock[t])
            p += 1
        self.pos[t] = p

    def _access(self, t: int, clock: list[int], accs: tuple, call: int) -> None:
        stamp = clock[t]
        seen = self.seen
        for inst, write, part, writer, where, land, cell in accs:
            prior = seen[inst]
            for (u, *_), (ustamp, uwrite, upart, uwriter, ucall, uwhere, uland, ucell) in \
                    prior.items():
                if not (write or uwrite):
                    continue
                # the earlier access ended before this one: itself, or the landing of a
                # store in flight (not passed yet: it has not ended)
                if uland is None:
                    if u == t or clock[u] >= ustamp:
                        continue
                else:
                    end = self.landed.get((uland[0], ucall, uland[1]))
                    if end is not None and (end[0] == t or clock[end[0]] >= end[1]):
                        continue
                if part is not None and upart is not None and part == upart \
                        and writer != uwriter:
                    continue
                # a local access of chunk j beside a store of index m != j along its axis
                if (cell is not None and ucell is not None and (part is None) != (
                        upart is None) and cell[0] == ucell[0] and cell[1] != ucell[1]):
                    continue
                self.races.add((inst, (uwriter, ucall) + uwhere, uwrite,
                                (writer, call) + where, write))
            # the latest call's access per stream and access is enough, but a store in
            # flight is kept per call: an older call's may not have landed yet
            prior[(t, where) if land is None else (t, where, call)] = (
                stamp, write, part, writer, call, where, land, cell)

    def done(self) -> bool:
        return all(p >= len(a) for p, a in zip(self.pos, self.c.actions, strict=True))


def _run(c: _Compiled, policy: str, rng: random.Random) -> _Run:
    """One maximal run under ``policy`` (a priority over the streams that can move)."""
    run = _Run(c)
    n = len(c.streams)
    acts, calls, pos, val = c.actions, c.action_call, run.pos, run.val
    rank_of = [r for r, _ in c.streams]
    victim = rng.randrange(c.world)
    tiebreak = list(range(n))
    rng.shuffle(tiebreak)
    rand = rng.random

    def key(t: int) -> tuple:
        p = pos[t]
        signal = acts[t][p][0] == 1
        if policy == "lockstep":  # lowest call first; a signal after anything else
            return (calls[t][p], signal, tiebreak[t])
        if policy == "hold":  # a signal only when nothing else can move
            return (signal, calls[t][p] if signal else 0, tiebreak[t])
        if policy == "delay":  # one rank only when nothing else can move
            return (rank_of[t] == victim, rand())
        return (rand(),)

    heap: list[tuple] = []
    waiting: dict[int, list[int]] = {}  # cell -> streams spinning on it

    def arrive(t: int) -> None:
        """Stream ``t`` is at a sync action: schedule it, or park it on its cell."""
        p = pos[t]
        if p >= len(acts[t]):
            return
        a = acts[t][p]
        if a[0] == 2 and ((val[a[1]] - a[2]) & _MASK) >= _HALF:
            waiting.setdefault(a[1], []).append(t)
        else:
            heapq.heappush(heap, (key(t), t))

    for t in range(n):
        if acts[t] and acts[t][0][0] in (0, 3):
            run.step(t)  # the local effects before the first sync action
        arrive(t)
    while heap:
        _, t = heapq.heappop(heap)
        a = acts[t][pos[t]]
        run.step(t)
        arrive(t)
        if a[0] == 1:
            for cell in a[1]:
                parked = waiting.pop(cell, None)
                if parked:
                    for u in parked:
                        arrive(u)
    return run


def _exhaustive(c: _Compiled, limit: int) -> tuple[set[tuple], list[_Run], int]:
    """Every interleaving of the sync actions (depth first, memoised on the state)."""
    races: set[tuple] = set()
    ends: list[_Run] = []
    seen: set[tuple] = set()
    stack = [_Run(c)]
    while stack:
        run = stack.pop()
        races |= run.races
        key = run.state()
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > limit:
            raise RuntimeError(f"more than {limit} states: not a tiny case")
        ready = [t for t in range(len(c.streams)) if run.runnable(t)]
        if not ready:
            ends.append(run)
            continue
        for t in ready:
            nxt = run.clone()
            nxt.step(t)
            stack.append(nxt)
    return races, ends, len(seen)


# --- findings -----------------------------------------------------------------------

def _race_findings(c: _Compiled, races: set[tuple], run: str) -> list[Finding]:
    steps = c.prog.steps
    out = []
    for inst, ainfo, awrite, binfo, bwrite in races:
        # info = (rank, call, step index, phase, effect, data-flow step, data-flow phase);
        # intended order: call, then where the data flow places the access
        a = (ainfo[1], ainfo[5], ainfo[6], ainfo[0], awrite, ainfo[2])
        b = (binfo[1], binfo[5], binfo[6], binfo[0], bwrite, binfo[2])
        first, second = sorted((a, b))
        if first[4] and second[4]:
            cls = WAW
        else:
            w, r = (first, second) if first[4] else (second, first)
            cls = WAR if w[:3] > r[:3] else RAW

        def side(s: tuple) -> tuple:
            return (s[3], s[0], steps[s[5]].name, "write" if s[4] else "read")

        out.append(Finding("race", cls, c.inst_buffer[inst], side(first), side(second),
                           c.world, run))
    return out


def _hang_findings(c: _Compiled, run: _Run, name: str) -> list[Finding]:
    """The waits a hang is made of: those nothing will ever satisfy, and cycles."""
    steps = c.prog.steps
    blocked: dict[int, tuple] = {}
    for t, acts in enumerate(c.actions):
        p = run.pos[t]
        if p < len(acts):
            blocked[t] = acts[p]
    behind: dict[int, int | None] = {}  # stream -> stream it waits on (None: never)
    for t, (_, _, _, (rank, call, index, peer)) in blocked.items():
        if index < 0:  # (roles) a role waiting for the call before to join: not a wait
            behind[t] = None  # of the schedule; it follows whatever blocks that call
            continue
        polled = steps[index].polls
        pos = None if polled is None else c.signal_pos.get((peer, call, polled))
        if pos is None or rank not in peers_of(steps[polled].signal, peer, c.world,
                                            steps[polled].axes):
            behind[t] = None
            continue
        u = c.stream_of[(peer, call, c.prog.roles[polled]) if c.prog.roles
                        else (peer, call)]
        behind[t] = u if u in blocked and run.pos[u] <= pos else None
    on_cycle: set[int] = set()
    for t in blocked:
        path, u = [], t
        while u is not None and u not in path:
            path.append(u)
            u = behind[u]
        if u is not None:
            on_cycle.update(path[path.index(u):])
    out = []
    for t, (_, _, _, (rank, call, index, peer)) in blocked.items():
        if index < 0:
            continue
        st = steps[index]
        wait = (rank, call, st.name, "wait")
        if behind[t] is None:
            out.append(Finding("deadlock", "no-signal", st.channel, wait, None, c.world, name))
        elif t in on_cycle and st.polls is not None:
            signal = (peer, call, steps[st.polls].name, "signal")
            out.append(Finding("deadlock", "cycle", st.channel, wait, signal, c.world, name))
    return out


def explore(plan: Any, world: int, *, calls: int | None = None,
            policies: Sequence[str] = ("lockstep", "hold"), randoms: int = 0,
            seed: int = 0, exhaustive: bool = False, limit: int = 200_000,
            channels: dict[str, str] | None = None,
            roles: dict[str, str] | None = None) -> OracleReport:
    """Execute ``plan`` at group size ``world`` under the runs asked; their findings.

    ``calls`` per rank (default 3 * slots, more than the checker's 2 * slots bound);
    ``policies`` run once each, then ``randoms`` runs alternating ``random`` and
    ``delay``; ``exhaustive`` explores every interleaving instead (tiny cases).
    One finding per (kind, class, buffer, step pair), from the first run reaching it.
    ``roles`` (PROTOTYPE, docs/proposals/roles.md): step name -> role, the roles of a rank running
    at once (``OProgram.roles``).
    """
    prog = plan if isinstance(plan, OProgram) else program(plan, channels)
    if roles is not None:
        number: dict[str, int] = {}
        for st in prog.steps:
            number.setdefault(roles[st.name], len(number))
        prog = replace(prog, roles=tuple(number[roles[st.name]] for st in prog.steps))
    calls = 3 * prog.slots if calls is None else calls
    c = _Compiled(prog, world, calls)
    report = OracleReport(world, first_calls=prog.slots if prog.per_slot else 1)
    found: dict[tuple, Finding] = {}

    def add(items: Iterable[Finding]) -> None:
        for f in items:
            found.setdefault(f.key, f)

    def finish(run: _Run, name: str) -> None:
        report.passed |= {(call, prog.steps[i].name) for call, i in run.passed if i >= 0}
        add(_race_findings(c, run.races, name))
        if not run.done():
            report.hung = True
            add(_hang_findings(c, run, name))
            for t, acts in enumerate(c.actions):
                if run.pos[t] < len(acts):
                    rank, call, index, _ = acts[run.pos[t]][3]
                    if index < 0:  # (roles) waiting for a join
                        continue
                    item = (rank, call, prog.steps[index].name)
                    if item not in report.blocked:
                        report.blocked.append(item)

    if exhaustive:
        races, ends, report.states = _exhaustive(c, limit)
        add(_race_findings(c, races, "exhaustive"))
        for end in ends:
            finish(end, "exhaustive")
        report.runs = len(ends)
    else:
        rng = random.Random(seed)
        names = list(policies) + [("random", "delay")[k % 2] for k in range(randoms)]
        for name in names:
            finish(_run(c, name, rng), name)
        report.runs = len(names)
    report.findings = sorted(found.values(), key=lambda f: f.key)
    return report
