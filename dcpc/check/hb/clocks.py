"""Liveness and vector clocks of the unrolled calls, for ONE rank (rotation symmetry).

Every peer pattern is invariant under rotating the ranks (``all``, ``next`` and
``prev`` only depend on ``r - s mod W``), and every rank runs the same program,
so the vector clock of rank r's event is rank 0's clock of the same event rotated
by r. We therefore compute clocks for rank 0's events only:

    VC[(r, e)][(q, s)] = VC0[e][((q - r) mod W, s)]

A clock has one entry per stream (rank q, stream s): how many events of that
stream happen before or equal the event. A wait joins the clocks of the signals
it matched (none for a non-cyclic "line" peer, which the edge ranks do not wait for:
symmetry keeps only the orderings every rank has; its dependency still blocks),
each rotated by its source's offset; a wait from ``all`` peers joins W-1 rotations,
which is "the maximum over every other rank" and costs O(W) with the two largest
entries per stream.

Liveness: the constraint graph of a call (program order, plus each matched signal
before its wait) is solved with Kahn's algorithm; a wait some peer never signals,
or a cycle (by rotation symmetry a cycle in rank 0's quotient graph lifts to a
cycle of the full graph and back), blocks it and everything after it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcpc.check.hb.events import Program, match_waits
from dcpc.lang import when as wh
from dcpc.lang.mesh import MeshWorld, torus
from dcpc.lang.model import Schedule
from dcpc.ops.common import chain, wraps


@dataclass
class World:
    """The unrolled calls of a program for one group size W, seen from rank 0."""

    program: Program
    world: int
    calls: int
    match: dict[int, list[tuple[int, int | None]]]
    live: list[bool]  # per flat position c*n + j
    clock: list[list[int] | None]  # per flat position: rank 0's clock, entry q*S + s
    unmatched: list[tuple[int, int]] = field(default_factory=list)  # (event j, delta d)
    cycles: list[set[int]] = field(default_factory=list)  # events j of a call on a cycle
    # per flat position of a per-slot copy (clock None): (stream 0's position, its
    # stream); its clock is stream 0's column moved to that stream, zero elsewhere,
    # and is never built whole (64 slots at W=1024: 65536 entries per event)
    copies: dict[int, tuple[int, int]] = field(default_factory=dict)
    # caches of derived facts (dcpc.check.hb.timeline, races): never part of equality
    stream_positions: dict[int, list[int]] = field(default_factory=dict, compare=False,
                                                   repr=False)
    lows: dict[tuple[int, int], int] = field(default_factory=dict, compare=False,
                                             repr=False)
    # (event j, id of its access, rank) -> the translations that make it (races.made)
    made_at: dict[tuple[int, int, int], int] = field(default_factory=dict, compare=False,
                                                     repr=False)
    # (rank, step index) of the guarded steps (when:) that do not run on that rank: a
    # counterexample shows them skipped, not done (dcpc.check.hb.checker sets it)
    skipped: frozenset[tuple[int, int]] = field(default=frozenset(), compare=False,
                                                repr=False)
    # where some rank skips a guarded step: the real per-rank execution, whose cuts the
    # counterexample shows (dcpc.check.hb.legal.Execution); None: the clocks' cuts are it
    execution: Any = field(default=None, compare=False, repr=False)

    @property
    def n(self) -> int:
        return len(self.program.events)

    @property
    def streams(self) -> int:
        return self.program.streams_per_rank

    def pos(self, call: int, j: int) -> int:
        return call * self.n + j

    def count(self, pos: int, rank_from: int, rank_of: int, stream: int) -> int:
        """How many events of stream (rank_from, stream) happen before-or-equal
        the event at ``pos`` on rank ``rank_of``."""
        row = _sub(self.world, rank_from, rank_of) * self.streams
        copy = self.copies.get(pos)
        if copy is not None:
            source, own = copy
            return self.clock[source][row] if stream == own else 0  # type: ignore[index]
        clock = self.clock[pos]
        assert clock is not None
        return clock[row + stream]

    def low(self, pos: int, stream: int) -> int:
        """The smallest entry for ``stream`` over every rank of the clock at ``pos``
        (cached: the race search asks it once per pair of access groups)."""
        value = self.lows.get((pos, stream))
        if value is None:
            value = self.lows[(pos, stream)] = self._low(pos, stream)
        return value

    def _low(self, pos: int, stream: int) -> int:
        copy = self.copies.get(pos)
        if copy is not None:
            source, own = copy
            return self.low(source, 0) if stream == own else 0
        clock = self.clock[pos]
        assert clock is not None
        return min(clock[stream::self.streams])

    def clock_at(self, pos: int) -> list[int]:
        """Rank 0's whole clock of the event at ``pos`` (built for a per-slot copy)."""
        copy = self.copies.get(pos)
        if copy is not None:
            source, own = copy
            src = self.clock[source]
            assert src is not None
            vc = [0] * (self.world * self.streams)
            vc[own::self.streams] = src[::self.streams]
            return vc
        clock = self.clock[pos]
        assert clock is not None
        return clock

    def hb(self, rank_a: int, pos_a: int, rank_b: int, pos_b: int) -> bool:
        """Whether (rank_a, pos_a) happens before or equals (rank_b, pos_b)."""
        call, j = divmod(pos_a, self.n)
        stream, index = self.program.stream_of(call, j), self.program.stream_index(call, j)
        return self.count(pos_b, rank_a, rank_b, stream) >= index + 1

    def rotated(self, pos: int, rank: int) -> list[int]:
        """The full clock of the event at ``pos`` on ``rank``."""
        return _translate(self.clock_at(pos), rank % self.world, self.world, self.streams)


def _call_graph(program: Program, match: dict[int, list[tuple[int, int | None]]]
                ) -> dict[int, set[int]]:
    """Predecessors of each event j within a call (program order + matched signals).
    A wait before the signal it polls on a chain (a shift's wait written before its put,
    ``wrap: false`` or an acyclic perm) is no predecessor here: every rank alike would
    wait on the rank before it around the ring, a cycle the line does not have. It is
    proved live instead by running its span rank by rank (dcpc.ops.shift ``span_run``,
    docs/hb-checker.md, "A wait before its put"): between it and its put only local
    steps and other such waits with their puts (dcpc.ops.shift's verifier). On a cycle
    (a ring) it stays, and the cycle is reported as a deadlock."""
    n = len(program.events)
    preds: dict[int, set[int]] = {j: ({j - 1} if j else set()) for j in range(n)}
    if program.roles:  # program order is each role's own (docs/proposals/roles.md prototype)
        preds = {j: {i} if (i := program.role_previous(j)) is not None else set()
                 for j in range(n)}
    for j, sources in match.items():
        wait = program.events[j].wait
        first = chain(wait[1]) if wait else False
        preds[j] |= {js for _, js in sources if js is not None and not (first and js > j)}
    return preds


def _kahn(n: int, preds: dict[int, set[int]], blocked: set[int]) -> list[int]:
    """Events of a call that can run, in an order that respects every constraint."""
    succs: dict[int, list[int]] = {j: [] for j in range(n)}
    missing = {j: len(p) for j, p in preds.items()}
    for j, p in preds.items():
        for i in p:
            succs[i].append(j)
    ready = [j for j in range(n) if missing[j] == 0 and j not in blocked]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        j = heapq.heappop(ready)
        order.append(j)
        for k in succs[j]:
            missing[k] -= 1
            if missing[k] == 0 and k not in blocked:
                heapq.heappush(ready, k)
    return order


def _sub(world: int, a: int, b: int) -> int:
    """a - b: mod W, or in the torus of a mesh (dcpc.lang.mesh)."""
    if isinstance(world, MeshWorld):
        return torus(world.shape).sub(a, b)
    return (a - b) % world


def _translate(clock: list[int], d: int, world: int, streams: int) -> list[int]:
    """The clock translated by ``d``: row q takes row q - d (a rotation for one axis)."""
    if not isinstance(world, MeshWorld):
        shift = (d % world) * streams
        return clock[-shift:] + clock[:-shift] if shift else list(clock)
    perm = torus(world.shape).shift(d)
    out = [0] * len(clock)
    for q, p in enumerate(perm):
        out[q * streams:(q + 1) * streams] = clock[p * streams:(p + 1) * streams]
    return out


def _join(clock: list[int], other: list[int], deltas: list[int], world: int, streams: int,
          only: int | None = None) -> None:
    """clock = max(clock, max over d in deltas of ``other`` rotated by d), in place.

    ``only``: the one stream whose entries ``other`` can have (per-slot streams never
    order each other: every signal is waited for in its own call, so on its stream)."""
    columns = range(streams) if only is None else (only,)
    if len(deltas) == world - 1 and world > 2 and 0 not in deltas:
        # every other rank: per stream, the largest entry not at the row itself
        for s in columns:
            column = other[s::streams]
            best = max(range(world), key=column.__getitem__)
            top = column[best]
            second = max((v for q, v in enumerate(column) if q != best), default=0)
            joined = [top] * world
            joined[best] = second
            clock[s::streams] = list(map(max, clock[s::streams], joined))
        return
    for d in deltas:
        # row q takes the other clock's row q - d: a rotation (translation) of the rows
        rotated = _translate(other, d, world, streams)
        if only is None:
            clock[:] = list(map(max, clock, rotated))
        else:
            clock[only::streams] = list(map(max, clock[only::streams], rotated[only::streams]))


def analyze(program: Program, world: int, calls: int | None = None,
            gates: Gates | None = None) -> World:
    """Liveness, deadlock roots and rank 0's vector clocks for calls 0..calls-1.
    ``gates``: the waits of guarded communication steps (``Gates``), None: none."""
    calls = program.default_calls() if calls is None else calls
    n, streams = len(program.events), program.streams_per_rank
    if program.roles and (program.per_slot or gates is not None):
        raise ValueError("roles (prototype): one stream of slots and no guarded "
                         "communication step")
    if program.roles:
        chained = sorted({program.steps[e.step].name for e in program.events
                          if e.wait is not None and not wraps(e.wait[1])})
        if chained:
            # a wait that orders nothing in the model (its ranks wait on different peers,
            # some on none): its span is proved rank by rank in one program order only
            raise ValueError("roles (prototype): no wait on a line or a perm (a `wrap: "
                             "false` shift, a perm): " + ", ".join(chained))
    match = match_waits(program, world)
    unmatched = [(j, d) for j, sources in sorted(match.items()) for d, js in sources if js is None]
    preds = _call_graph(program, match)
    order = _kahn(n, preds, {j for j, _ in unmatched})
    cycles: list[set[int]] = []
    if len(order) < n:
        import networkx as nx  # a deadlock only: not on every check's start-up

        stuck = nx.DiGraph()
        stuck.add_nodes_from(j for j in range(n) if j not in set(order))
        stuck.add_edges_from((i, j) for j in stuck for i in preds[j] if i in stuck)
        cycles = sorted((c for c in nx.strongly_connected_components(stuck) if len(c) > 1),
                        key=min)
    live = [False] * (calls * n)
    clock: list[list[int] | None] = [None] * (calls * n)
    # per set of guarded steps a rank is assumed to run: every event's clock so
    guarded: dict[frozenset[int], list[list[int] | None]] = (
        {} if gates is None else {v: [None] * (calls * n) for v in set(gates.valid)})
    copies: dict[int, tuple[int, int]] = {}
    for call in range(calls):
        before = program.previous_call(call)
        if before >= 0 and not all(live[before * n: before * n + n]):
            continue
        stream = program.stream(call)
        if program.per_slot and stream:
            # a copy of stream 0's call; its clocks are only needed when a shared
            # buffer lets other slots' accesses meet slot 0's (dcpc.check.hb.races)
            _copy_slot0(program, clock, live, copies, call, stream, order,
                        clocks=any(program.shared.values()))
            continue
        for j in order:
            pos = call * n + j
            live[pos] = True
            if j:
                base = clock[pos - 1]
            else:
                base = clock[before * n + n - 1] if before >= 0 else None
            if program.roles:  # the role's previous event, or the previous call's join
                base = _role_base(program, clock, call, j, before)
            vc = list(base) if base is not None else [0] * (world * streams)
            by_signal: dict[int, list[int]] = {}
            wait = program.events[j].wait
            # a wait on a non-cyclic ("line") peer orders nothing: the edge ranks skip it,
            # and every rank is modelled alike (its dependency still counts for liveness)
            for d, js in match.get(j, ()) if wraps(wait[1] if wait else None) else ():
                by_signal.setdefault(js, []).append(d)  # type: ignore[arg-type]
            for assumed, column in guarded.items():  # the clocks assuming guarded steps run
                if j == 0 and before < 0:
                    last = None
                else:
                    last = column[pos - 1] if j else column[before * n + n - 1]
                # a list of its own per column: _clock sets its entries in place
                column[pos] = _clock(list(vc if last is None else last), world, streams,
                                     by_signal if gates.joins(j, assumed) else {},
                                     lambda js, at=call * n: guarded[gates.valid[js]][at + js],
                                     stream if program.per_slot else None,
                                     stream, program.stream_index(call, j) + 1)
            if guarded:
                clock[pos] = guarded[gates.valid[j]][pos]
                continue
            clock[pos] = _clock(vc, world, streams, by_signal,
                                lambda js, at=call * n: clock[at + js],
                                stream if program.per_slot else None,
                                program.stream_of(call, j), program.stream_index(call, j) + 1)
    return World(program, world, calls, match, live, clock, unmatched, cycles, copies)


def _role_base(program: Program, clock: list[list[int] | None], call: int, j: int,
               before: int) -> list[int] | None:
    """With roles: the clock event j of ``call`` starts from, its role's previous event
    in the call, or for a role's first event the join of every role's last event of the
    call before (a call forks its roles at its start and joins them at its end)."""
    n = len(program.events)
    previous = program.role_previous(j)
    if previous is not None:
        return clock[call * n + previous]
    if before < 0:
        return None
    ends = [clock[before * n + last] for last in program.role_last()]
    return [max(column) for column in zip(*ends, strict=True)]  # type: ignore[arg-type]


def _clock(vc: list[int], world: int, streams: int, by_signal: dict[int, list[int]],
           signal: Callable[[int], list[int] | None], only: int | None, stream: int,
           index: int) -> list[int]:
    """An event's clock: its base ``vc`` (its predecessor's, in place) joined with the
    signals it matched (``signal``: the clock of signal event js), its own entry set."""
    for js, deltas in by_signal.items():
        other = signal(js)
        assert other is not None
        _join(vc, other, deltas, world, streams, only)
    vc[stream] = index
    return vc


@dataclass(frozen=True)
class Gates:
    """The waits of guarded communication steps (``when:``, dcpc.check.when) at one W.

    Every rank is modelled alike, but such a wait is made only on the ranks where its
    step runs (there its senders run too: dcpc.check.when proved every edge). So its
    ordering holds only for what a rank does once it has run the step: the clock of
    an event counts the joins of exactly the guarded steps that run wherever its own
    step runs (``valid``), and a signal passes on the clock of its own event so
    (docs/hb-checker.md, "Guarded communication steps").

    ``guard``: recv event j -> its guarded step; ``valid``: per event j, the guarded
    steps that run on every rank where j's step runs at this W."""

    guard: dict[int, int]
    valid: tuple[frozenset[int], ...]

    def joins(self, j: int, assumed: frozenset[int]) -> bool:
        """Whether event j's wait orders, on a rank assumed to run ``assumed``."""
        step = self.guard.get(j)
        return step is None or step in assumed


def _copy_slot0(program: Program, clock: list[list[int] | None], live: list[bool],
                copies: dict[int, tuple[int, int]], call: int, stream: int, order: list[int],
                clocks: bool) -> None:
    """Call ``call`` of per-slot stream ``stream`` as a copy of the same round's call on
    stream 0: per-slot streams are identical and never order each other, so it is live
    where that call is, and its clock is stream 0's column moved to its own stream
    (recorded in ``copies``, read through World.count / low / clock_at)."""
    n = len(program.events)
    source = call - stream
    for j in order:
        if clock[source * n + j] is None:
            return
        live[call * n + j] = True
        if clocks:
            copies[call * n + j] = (source * n + j, stream)


def gates(schedule: Schedule, program: Program, w: int) -> Gates | None:
    """The waits of the guarded communication steps at W (``Gates``), None: none."""
    running = wh.running(schedule, w)
    comm = {e.step for e in program.events if e.phase == "recv" and e.step in running}
    if not comm:
        return None
    every = frozenset(range(int(w)))
    return Gates({j: e.step for j, e in enumerate(program.events)
                  if e.phase == "recv" and e.step in comm},
                 tuple(frozenset(s for s in comm if running.get(e.step, every) <= running[s])
                       for e in program.events))
