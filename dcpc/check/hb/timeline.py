"""Counterexample timelines: per rank (and stream), what ran and what runs next.

A race is shown from a consistent cut: the union of the strict happens-before
predecessors of both accesses. Every event in it can have run (it is closed
under happens-before), neither access is in it, and both are enabled next: a
legal execution in which the two accesses overlap. A deadlock is shown from the
cut of every event that can run: each stream stops at the wait that never ends.
"""

from __future__ import annotations

from collections.abc import Iterable

from dcpc.check.hb.clocks import World
from dcpc.lang.mesh import rank_text

MAX_RANKS = 4


def stream_positions(world: World, stream: int) -> list[int]:
    """Flat positions (call*n + j) of one rank's stream, in stream order (read-only:
    kept per World, as every timeline line of every finding asks for them)."""
    cache = world.stream_positions
    if stream not in cache:
        program, n = world.program, world.n
        cache[stream] = [c * n + j for c in range(world.calls) if program.stream(c) == stream
                         for j in range(n)] if not program.roles else [
            c * n + j for c in range(world.calls) for j in range(n)
            if program.stream_of(c, j) == stream]  # a role's events (docs/proposals/roles.md)
    return cache[stream]


def strict_predecessors(world: World, rank: int, pos: int) -> list[int]:
    """The cut of events strictly before (rank, pos): a count per (rank q, stream s),
    the event's own wait joined (its accesses come after it, as in its clock); where
    ranks skip guarded steps, the one their real steps allow (``World.execution``)."""
    real = world.execution.before(rank, pos) if world.execution is not None else None
    if real is not None:
        return list(real)
    cut = world.rotated(pos, rank)
    call, j = divmod(pos, world.n)
    cut[rank * world.streams + world.program.stream_of(call, j)] -= 1
    return cut


def render(
    world: World,
    cut: list[int],
    pending: dict[tuple[int, int], str],
    ranks: Iterable[int],
) -> list[str]:
    """One line per (rank, stream): calls with their finished steps, then what is next.

    ``pending[(rank, pos)]`` describes the event that runs next at ``pos`` on
    ``rank`` (an access of the race, or the wait a deadlock is stuck in).
    """
    program, streams = world.program, world.streams
    lines = []
    for rank in ranks:
        for stream in range(streams):
            done = cut[rank * streams + stream]
            positions = stream_positions(world, stream)
            nxt = positions[done] if done < len(positions) else -1
            note = pending.get((rank, nxt))
            if stream and not done and note is None:
                continue  # an idle extra stream says nothing
            who = rank_text(world.world, rank, program.axis_names) + (
                f", slot {stream}" if program.per_slot else
                f", role {program.role_names[stream]}" if program.roles else "")
            lines.append(f"{who}: {_stream_text(world, positions, done, note, rank)}")
    return lines


def _stream_text(world: World, positions: list[int], count: int, note: str | None,
                 rank: int = 0) -> str:
    program = world.program
    done = set(positions[:count])
    nxt = positions[count] if count < len(positions) else -1
    events_of: dict[int, list[int]] = {}
    mine = {p % world.n for p in positions}  # (roles: a role's events only)
    for j, event in enumerate(program.events):
        if j in mine:
            events_of.setdefault(event.step, []).append(j)
    calls = sorted({divmod(p, world.n)[0] for p in positions})
    chunks = []
    for call in calls:
        items, stop = [], False
        for step, js in sorted(events_of.items()):
            own = [world.pos(call, j) for j in js]
            name = program.steps[step].name
            if all(p in done for p in own):
                # a guarded step whose when: fails on this rank: passed over, not run
                skip = (rank, step) in world.skipped and not (nxt in own and note)
                items.append(f"{name} (skipped)" if skip else f"{name} ✓")
                continue
            started = any(p in done for p in own)
            # a started step has sent; it waits unless what runs next is past its wait
            # a skipped step's method still returns what it holds: the engine reads it
            label = name + ((" (skipped)" if (rank, step) in world.skipped else " (sent)"
                             if nxt in own and note else " (sent, waiting)") if started else "")
            if nxt in own and (note or not started):
                label += " " + (note or "(next)")
            items.append(label)
            stop = True
            break
        if items:
            chunks.append(f"call {call} " + " ".join(items))
        if stop:
            break
    return " | ".join(chunks) or "(nothing run yet)"


def involved_ranks(world: World, ranks: Iterable[int],
                   cuts: Iterable[list[int]] = ()) -> list[int]:
    """The ranks to show: all of them for a small W; else the given ones (at least
    two) and every rank on the chains that order, or fail to order, them: a rank whose
    progress the given events' predecessor cuts ``cuts`` disagree on (one of them
    learnt of it through a wait, the other did not)."""
    if world.world <= MAX_RANKS:
        return list(range(world.world))
    chosen = set(ranks)
    cuts = list(cuts)
    streams = world.streams
    for q in range(world.world):
        counts = {tuple(cut[q * streams:(q + 1) * streams]) for cut in cuts}
        if len(counts) > 1:
            chosen.add(q)
    picked = sorted(chosen)
    return picked + [r for r in range(world.world) if r not in chosen][: max(0, 2 - len(picked))]


def left_out(world: World, shown: list[int]) -> list[str]:
    """A line naming the ranks a timeline leaves out, if any."""
    hidden = [r for r in range(world.world) if r not in shown]
    if not hidden:
        return []
    listed = ", ".join(map(str, hidden))
    return [f"(ranks {listed} not shown: no event of theirs orders, or fails to order, "
            "the two shown)"]
