"""The execution a counterexample shows, rank by rank, under the ``when:`` guards.

The clocks (dcpc.check.hb.clocks) model every rank alike: a guarded wait orders only
what runs after it where it runs (``Gates``), which keeps the verdict sound, but the
cut those clocks give one rank's event is not what a guarded schedule lets happen on
each rank (issue 33, cex23: a rank shown past a wait whose signal its peer, which
skips nothing, had not sent yet). ``Execution`` redoes the cut from the real per-rank
steps: on rank r a step whose ``when:`` fails neither waits, nor signals, nor touches
anything; a wait of rank r needs, from each rank its peers name on r (all, next,
prev, an offset, "line" without wrap, a perm's table; on a mesh along the sync's team:
dcpc.topology), that rank's signal of the polled step in the same call, which must run
there and reach r. An access happens where its step runs, but for the engine's read of
what a method returns, which happens on every rank (``happens``). A deadlock of the
model is one of the real steps only where they get stuck too (``stuck``): a cycle of
waits that some ranks skip may be a chain that ends.

    Execution(world, running).before(rank, pos) -> cut | None
    Execution(world, running).unordered(race) -> (cut_a, cut_b) | None
    Execution(world, running).happens(touch, rank) -> bool
    Execution(world, running).stuck() -> cut | None (where a deadlock really stops)
    Execution(world, running).blocked(cut) -> {row: (pos, missing sources)}
    Execution(world, running).deadlocked(blocked) -> those of a deadlock themselves
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpc.check.hb.events import own_tail
from dcpc.check.hb.races import RawRace, Touch
from dcpc.ops.common import peers_of

if TYPE_CHECKING:
    from dcpc.check.hb.clocks import World


class Execution:
    """The real per-rank steps of one W: ``running`` is step index -> the ranks it runs
    on, for every guarded step (dcpc.lang.when.running)."""

    def __init__(self, world: World, running: dict[int, frozenset[int]]):
        self.world, self.running = world, running
        program = world.program
        self.signal_of = {e.signal[0]: j for j, e in enumerate(program.events)
                          if e.signal is not None}
        self.cuts: dict[tuple[int, int], list[int] | None] = {}
        self._sources: dict[tuple[int, int], list[int] | None] = {}

    def runs(self, rank: int, j: int) -> bool:
        """Whether event j's step runs on ``rank``."""
        ranks = self.running.get(self.world.program.events[j].step)
        return ranks is None or rank in ranks

    def happens(self, t: Touch, rank: int) -> bool:
        """Whether access ``t`` happens on ``rank``: where its step runs; the engine's read
        of what a method returns (``Access.returned``) on every rank, as the engine calls
        a guarded method where it does not run too and reads what it returns there
        (dcpc.harness.worker ``held``; issue 33 flaky23)."""
        return t.access.returned or self.runs(rank, t.j)

    def before(self, rank: int, pos: int) -> list[int] | None:
        """The events strictly before event ``pos`` (call*n + j) of ``rank``, closed under
        what the ranks really do: a count per (rank q, stream s), as
        timeline.strict_predecessors gives; None when a wait in it is never signalled.
        Where event j waits (and runs on ``rank``), the cut also holds the signals that
        wait needs: every access of such an event comes after its wait (events.py: a
        ``recv`` event's effects are the step's ``after`` ones, the engine's read of
        what it returns included), as the clocks join the wait into the event's own
        clock (review M1 of session 24: the returned read; session 25: an all_reduce's
        landing read after its wait)."""
        if (rank, pos) in self.cuts:
            return self.cuts[(rank, pos)]
        from dcpc.check.hb.timeline import stream_positions

        # each cut from the one before it on its stream (cached, a closed cut under this
        # one: the walk from it adds what the events between add, the same least cut as
        # a walk from nothing), the earliest not cached first
        program = self.world.program
        call, j = divmod(pos, self.world.n)
        order = stream_positions(self.world, program.stream_of(call, j))
        k = program.stream_index(call, j)
        while k > 0 and (rank, order[k - 1]) not in self.cuts:
            k -= 1
        base = self.cuts[(rank, order[k - 1])] if k > 0 else [0] * (
            int(self.world.world) * self.world.streams)
        for p in order[k:program.stream_index(call, j) + 1]:
            base = self.cuts[(rank, p)] = None if base is None else self._before(
                rank, p, list(base))
        return base

    def _before(self, rank: int, pos: int, cut: list[int]) -> list[int] | None:
        """The cut of (rank, pos) walked on from ``cut``, a closed cut under it."""
        from dcpc.check.hb.timeline import stream_positions

        world, program = self.world, self.world.program
        n, streams = world.n, world.streams
        call, j = divmod(pos, n)
        work = [(rank, program.stream_of(call, j), program.stream_index(call, j))]
        sources = self.sources(rank, j)  # its own wait's: its accesses come after it
        if sources is None:
            return None
        js = self.signal_of.get(program.events[j].wait[0]) if sources else None  # type: ignore[index]
        work += [(src, program.stream_of(call, js), program.stream_index(call, js) + 1)  # type: ignore[arg-type]
                 for src in sources]
        work += self._joined(rank, call, j)
        while work:
            q, s, upto = work.pop()
            row = q * streams + s
            start = cut[row]
            if upto <= start:
                continue
            cut[row] = upto
            for p in stream_positions(world, s)[start:upto]:
                c, i = divmod(p, n)
                sources = self.sources(q, i)
                if sources is None:
                    return None
                js = self.signal_of.get(program.events[i].wait[0]) if sources else None
                work += [(src, program.stream_of(c, js), program.stream_index(c, js) + 1)  # type: ignore[arg-type]
                         for src in sources]
                work += self._joined(q, c, i)
        return cut

    def _joined(self, rank: int, call: int, j: int) -> list[tuple[int, int, int]]:
        """With roles (docs/proposals/roles.md prototype): a role's first event of ``call`` comes
        after the join of the call before, every role's last event there; else none."""
        program = self.world.program
        if not program.roles or call == 0 or program.role_previous(j) is not None:
            return []
        return [(rank, program.stream_of(call - 1, last), program.stream_index(call - 1, last) + 1)
                for last in program.role_last()]

    def sources(self, rank: int, i: int) -> list[int] | None:
        """The ranks whose signal (of the polled step, in the same call) event i's wait
        needs on ``rank``: [] where it makes no wait; None when one is never sent there
        (the polled step does not run on that rank, or does not signal ``rank``)."""
        if (rank, i) not in self._sources:
            self._sources[(rank, i)] = self._sources_of(rank, i)
        return self._sources[(rank, i)]

    def _sources_of(self, rank: int, i: int) -> list[int] | None:
        events, w = self.world.program.events, self.world.world
        wait = events[i].wait
        if wait is None or not self.runs(rank, i):
            return []
        js = self.signal_of.get(wait[0])
        # by rank (not the kernel's loop order): the order a counterexample names them in
        out = sorted(peers_of(wait[1], rank, w, events[i].axes))
        for src in out:
            sent = events[js].signal if js is not None else None
            if sent is None or not self.runs(src, js) or rank not in peers_of(
                    sent[1], src, w, events[js].axes):  # type: ignore[arg-type,index]
                return None
        if js is not None and own_tail(self.world.program, js, i, w):
            # (roles) the own lane: the rank's own put's flag, as events.match_waits
            if not self.runs(rank, js):
                return None
            out = sorted({*out, rank})
        return out

    def stuck(self) -> list[int] | None:
        """Where the ranks' real steps stop, every call run as far as its waits let it: a
        count per (rank q, stream s), as ``before`` gives; None when every rank finishes
        every call (the model's deadlock is one of waits some rank does not make)."""
        from dcpc.check.hb.timeline import stream_positions

        world, program = self.world, self.world.program
        n, streams, w = world.n, world.streams, world.world
        events = program.events
        cut = [0] * (int(w) * streams)
        work = list(range(len(cut)))  # rows that may go on: each, then those it signals
        while work:
            row = work.pop()
            q, s = divmod(row, streams)
            positions = stream_positions(world, s)
            while cut[row] < len(positions):
                c, i = divmod(positions[cut[row]], n)
                sources = self.sources(q, i)
                js = self.signal_of.get(events[i].wait[0]) if sources else None  # type: ignore[index]
                if sources is None or any(cut[src * streams + program.stream_of(c, js)]  # type: ignore[arg-type]
                                          <= program.stream_index(c, js) for src in sources):  # type: ignore[arg-type]
                    break
                if any(cut[t * streams + u] < upto for t, u, upto in self._joined(q, c, i)):
                    break  # (roles) the call before has not joined yet
                cut[row] += 1
                sent = events[i].signal
                if sent is not None and self.runs(q, i):
                    work += [t * streams + s for t in peers_of(sent[1], q, w, events[i].axes)]
                if program.roles:  # (roles) any role of this rank or of those it signals
                    work += [t * streams + u for t in {q, *(peers_of(sent[1], q, w, events[i].axes)
                                                          if sent is not None else ())}
                             for u in range(streams)]
        done = all(cut[row] == len(stream_positions(world, row % streams))
                   for row in range(len(cut)))
        return None if done else cut

    def blocked(self, cut: list[int]) -> dict[int, tuple[int, list[int] | None]]:
        """Per row (rank q, stream s) that ``cut`` (``stuck``'s) leaves short of its end:
        the position of the wait it stops at and the ranks whose signal of it has not
        come (None: one is never sent there; ``sources`` is the one definition)."""
        from dcpc.check.hb.timeline import stream_positions

        world, program = self.world, self.world.program
        out: dict[int, tuple[int, list[int] | None]] = {}
        for row, done in enumerate(cut):
            q, s = divmod(row, world.streams)
            positions = stream_positions(world, s)
            if done >= len(positions):
                continue
            c, i = divmod(positions[done], world.n)
            sources = self.sources(q, i)
            if sources:
                js = self.signal_of[program.events[i].wait[0]]  # type: ignore[index]
                sources = [src for src in sources
                           if cut[src * world.streams + program.stream_of(c, js)]
                           <= program.stream_index(c, js)]
            out[row] = (positions[done], sources)
        return out

    def deadlocked(self, blocked: dict[int, tuple[int, list[int] | None]]
                   ) -> dict[int, tuple[int, list[int] | None]]:
        """The rows of ``blocked`` that are a deadlock themselves: waiting for a signal
        never sent, or on a cycle of waits (a row that waits only for a deadlocked one
        stops as a consequence: review M2, a second cycle the guards cut)."""
        streams = self.world.streams

        def on_cycle(start: int) -> bool:
            seen: set[int] = set()
            work = [start]
            while work:
                row = work.pop()
                pos, sources = blocked.get(row, (0, []))
                for src in sources or []:
                    nxt = src * streams + self._signal_stream(pos, row % streams)
                    if nxt == start:
                        return True
                    if nxt not in seen:
                        seen.add(nxt)
                        work.append(nxt)
            return False

        return {row: b for row, b in blocked.items() if b[1] is None or on_cycle(row)}

    def _signal_stream(self, pos: int, stream: int) -> int:
        """The stream of the signal the wait at ``pos`` polls: the wait's own (a slot's
        stream), or with roles the signalling event's role."""
        program = self.world.program
        if not program.roles:
            return stream
        call, i = divmod(pos, self.world.n)
        return program.stream_of(call, self.signal_of[program.events[i].wait[0]])  # type: ignore[index]

    def unordered(self, race: RawRace) -> tuple[list[int], list[int]] | None:
        """Both accesses' cuts (``before``) when the race happens on its ranks as named:
        both accesses happen there (``happens``), every wait before them is signalled,
        and neither access ends (a store in flight: at its owner's wait that lands it)
        before the other starts; else None."""
        world, program = self.world, self.world.program
        a, b = race.first, race.second
        if not (self.happens(a, a.rank) and self.happens(b, b.rank)):
            return None
        pa, pb = world.pos(a.call, a.j), world.pos(b.call, b.j)
        cut_a, cut_b = self.before(a.rank, pa), self.before(b.rank, pb)
        if cut_a is None or cut_b is None:
            return None

        def end(t: Touch) -> tuple[int, int]:
            if t.access.lands is None:
                return t.rank, world.pos(t.call, t.j)
            return t.owner, world.pos(t.call, program.recv_of[t.access.lands])

        def ordered(x: tuple[int, int], rank: int, pos: int, cut: list[int]) -> bool:
            if x == (rank, pos):
                return True
            c, i = divmod(x[1], world.n)
            return cut[x[0] * world.streams + program.stream_of(c, i)] > program.stream_index(c, i)

        def ended(t: Touch, rank: int, pos: int, cut: list[int]) -> bool:
            # (roles) a store in flight has ended only once its put has happened too
            return ordered(end(t), rank, pos, cut) and (
                t.access.lands is None or not program.roles
                or ordered((t.rank, world.pos(t.call, t.j)), rank, pos, cut))

        if ended(a, b.rank, pb, cut_b) or ended(b, a.rank, pa, cut_a):
            return None
        return cut_a, cut_b
