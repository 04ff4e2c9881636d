"""PROTOTYPE (ROLES_STUDY.md): the happens-before checker with two roles of one rank.

Roles of one rank run at once (DeepEP's sender, forwarder and receiver warps), each in
its own program order, ordered only by their signals and waits (a ``to: self`` signal
of one role polled by a ``from: self`` wait of another) and by the call's fork and
join. No language key assigns a role yet: ``events.with_roles`` does it by step name,
so these tests run the checker's part alone (clocks, races, deadlocks), not `dcpc check`.
"""

from __future__ import annotations

import pytest

from dcpc.check.hb import clocks, deadlock, events, races
from dcpc.lang.parse import parse_text

HEAD = """\
schedule: roles_toy
slots: 1
sizes: {D: 8}
buffers:
  x:     {shape: [D], dtype: f32}
  stage: {shape: [D], dtype: f32, symmetric: true}  # the producer fills, the consumer reads
  y:     {shape: [D], dtype: f32}
steps:
"""
FILL = "  - fill:  {op: copy, src: x, dst: stage}\n"
READY = "  - ready: {op: signal, to: self, channel: full}\n"
GOT = "  - got:   {op: wait, from: self, channel: full}\n"
USE = "  - use:   {op: copy, src: stage, dst: y}\n"
ROLES = {"fill": "producer", "ready": "producer", "got": "consumer", "use": "consumer"}


def _world(text: str, roles: dict[str, str] | None, world: int = 2) -> clocks.World:
    program = events.lower(parse_text(HEAD + text))
    if roles is not None:
        program = events.with_roles(program, roles)
    return clocks.analyze(program, world)


def _races(world: clocks.World) -> set[tuple[str, str, str, str]]:
    return {(r.cls, r.buffer, world.program.steps[world.program.events[r.first.j].step].name,
             world.program.steps[world.program.events[r.second.j].step].name)
            for r in races.find_races(world)}


def _deadlocks(world: clocks.World) -> set[str]:
    return {d.cls for d in deadlock.find_deadlocks(world)}


@pytest.mark.parametrize("w", [2, 3])
def test_a_signal_between_roles_orders_the_consumer_after_the_producer(w: int) -> None:
    world = _world(FILL + READY + GOT + USE, ROLES, w)
    assert _races(world) == set() and _deadlocks(world) == set()
    # the consumer's read is after the producer's write on every rank (its own stream)
    assert world.program.streams_per_rank == 2


def test_without_the_signal_the_roles_race_on_the_staging_buffer() -> None:
    roles = {"fill": "producer", "use": "consumer"}
    one_order = _world(FILL + USE, None)
    assert _races(one_order) == set()  # one program order: fill before use
    two_roles = _world(FILL + USE, roles)
    assert _races(two_roles) == {(races.RAW, "stage", "fill", "use")}


def test_the_next_call_is_ordered_by_the_join_of_the_call_before() -> None:
    # the producer's fill of call 1 cannot overtake the consumer's use of call 0: the
    # call ends when every role has (the fork/join a call makes); no credit needed
    world = _world(FILL + READY + GOT + USE, ROLES)
    assert world.calls == 2 and all(world.live)
    fill = next(j for j, e in enumerate(world.program.events) if e.step == 0)
    use = next(j for j, e in enumerate(world.program.events) if e.step == 3)
    assert world.hb(0, world.pos(0, use), 0, world.pos(1, fill))
    assert not world.hb(0, world.pos(0, use), 0, world.pos(0, fill))


def test_a_wait_written_before_its_signal_is_a_deadlock_in_one_order_only() -> None:
    # the consumer written first: in one program order it waits for a signal that comes
    # after it (a cycle of one rank); as two roles the producer runs at once and frees it
    text = GOT + USE + FILL + READY
    assert _deadlocks(_world(text, None)) == {deadlock.CYCLE}
    world = _world(text, ROLES)
    assert _deadlocks(world) == set() and _races(world) == set() and all(world.live)


def test_two_roles_that_wait_for_each_other_first_deadlock() -> None:
    ack = "  - ack:   {op: signal, to: self, channel: empty}\n"
    want = "  - want:  {op: wait, from: self, channel: empty}\n"
    # producer: want, fill, ready; consumer: got, use, ack: each waits for the other first
    roles = {**ROLES, "ack": "consumer", "want": "producer"}
    hang = _world(want + FILL + READY + GOT + USE + ack, roles)
    assert _deadlocks(hang) == {deadlock.CYCLE}
    assert not any(hang.live)


def test_a_role_of_a_peer_orders_through_a_cross_rank_signal() -> None:
    # rank r's producer fills its stage and signals rank r + 1's consumer, which then
    # reads ITS OWN stage: that is rank r + 1's producer's, not ordered by r's signal
    text = (FILL + "  - ready: {op: signal, to: next, channel: full}\n"
            + "  - got:   {op: wait, from: prev, channel: full}\n" + USE)
    found = _races(_world(text, ROLES, 3))
    assert found == {(races.RAW, "stage", "fill", "use")}
    # with one program order per rank the same file is race-free (fill before use)
    assert _races(_world(text, None, 3)) == set()


def test_every_step_needs_a_role() -> None:
    program = events.lower(parse_text(HEAD + FILL + USE))
    with pytest.raises(ValueError, match="no role for step"):
        events.with_roles(program, {"fill": "producer"})
