"""Deadlocks: waits that no signal satisfies, and cycles of waits.

A call can finish only if its constraint graph (program order, matched signal
before wait) is acyclic and every wait has a matching signal. Calls never wait
for a later call and the signal of call c only satisfies call c's waits, so every
deadlock shows in the first call of a stream; by rotation symmetry it shows on
rank 0 (see dcpc.check.hb.clocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcpc.check.hb.clocks import World

NO_SIGNAL, CYCLE = "no-signal", "cycle"


@dataclass(frozen=True)
class RawDeadlock:
    """Rank 0's wait (event ``wait_j`` of call 0) on rank ``delta``'s ``signal_j``."""

    cls: str
    channel: str
    wait_j: int
    delta: int
    signal_j: int | None

    def key(self, world: World) -> tuple[str, str, str, str, str]:
        program = world.program
        wait = program.steps[program.events[self.wait_j].step].name
        signal = (program.steps[program.events[self.signal_j].step].name
                  if self.signal_j is not None else "")
        return ("deadlock", self.cls, program.channel_text(self.channel), wait, signal)


def find_deadlocks(world: World) -> list[RawDeadlock]:
    """One deadlock per (class, channel, waiting step, awaited step), for this W."""
    events = world.program.events
    found: dict[tuple[str, str, str, str, str], RawDeadlock] = {}
    for j, d in world.unmatched:
        channel = events[j].wait[0]  # type: ignore[index]
        dead = RawDeadlock(NO_SIGNAL, channel, j, d, None)
        found.setdefault(dead.key(world), dead)
    for cycle in world.cycles:  # once per cycle, at its first wait in program order
        dead = next(RawDeadlock(CYCLE, events[j].wait[0], j, d, js)  # type: ignore[index]
                    for j in sorted(cycle) for d, js in world.match.get(j, ())
                    if js is not None and js in cycle)
        found.setdefault(dead.key(world), dead)
    return list(found.values())

