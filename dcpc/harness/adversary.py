"""The adversarial parts of a run: delays, slot orders, injected faults, and a replay's
hold (``dcpc run --replay``, planned by dcpc.harness.replay).

In the spirit of JAX Pallas interpret mode: ranks are delayed at random (seeded per
rank) before and after every step, so that a missing wait shows up as a wrong
value; slots are used in every order the schedule allows; a fault makes one rank
die or stall at a chosen (call, step) so the others must time out, not hang.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dcpc.lang import model as m


class Jitter:
    """Seeded random sleeps; the same seed gives the same delays on a rank."""

    def __init__(self, seed: int, rank: int, max_s: float, probability: float):
        self.rng = random.Random(f"jitter/{seed}/{rank}")
        self.max_s, self.probability = max_s, probability

    def delay(self) -> None:
        if self.max_s > 0 and self.rng.random() < self.probability:
            time.sleep(self.rng.random() * self.max_s)


@dataclass(frozen=True)
class Event:
    """Run step ``step`` (an index into the step list) of call ``call`` on ``slot``."""

    call: int
    slot: int
    step: int


def slot_of(call: int, slots: int) -> int:
    """Calls alternate slots, slot 1 first (a slot used before slot 0 must work)."""
    return (call + 1) % slots


def plan_events(
    schedule: m.Schedule, calls: int, order: str, seed: int,
    lead: tuple[tuple[int, int], tuple[int, int]] | None = None,
) -> list[Event]:
    """Every (call, slot, step) of a run, in the order every rank executes them.

    ``sequential``: call after call, slots alternating. ``interleaved``: two calls on
    different slots in flight at once (dual-batch overlap), their steps merged in a
    seeded random order that keeps each call's program order; every rank uses the
    same merge, so the collectives still match across ranks. ``lead``: ((call a, step
    i), (call b, step j)) of one pair: its merge runs a's steps before i, then b's up
    to j, so that b's step j comes before a's step i (a replay's race of two calls in
    flight, dcpc.harness.replay).
    """
    steps = len(schedule.step_list())
    slots = schedule.slots
    if order == "interleaved" and (slots < 2 or schedule.streams != m.Streams.per_slot):
        order = "sequential"  # nothing to overlap
    if order not in ("sequential", "interleaved"):
        raise ValueError(f"slot order must be sequential or interleaved, not {order!r}")
    events: list[Event] = []
    if order == "sequential":
        for call in range(calls):
            events += [Event(call, slot_of(call, slots), s) for s in range(steps)]
        return events
    rng = random.Random(f"order/{seed}")
    for first in range(0, calls, 2):
        pair = [c for c in (first, first + 1) if c < calls]
        next_step = {c: 0 for c in pair}
        if lead is not None and {lead[0][0], lead[1][0]} == set(pair):
            (a, i), (b, j) = lead
            events += [Event(a, slot_of(a, slots), s) for s in range(i)]
            events += [Event(b, slot_of(b, slots), s) for s in range(j + 1)]
            next_step.update({a: i, b: j + 1})
        while any(next_step[c] < steps for c in pair):
            ready = [c for c in pair if next_step[c] < steps]
            call = rng.choice(ready)
            events.append(Event(call, slot_of(call, slots), next_step[call]))
            next_step[call] += 1
    return events


@dataclass(frozen=True)
class Fault:
    """Rank ``rank`` stops before step ``step`` of call ``call`` (-1: every call):
    exits, sleeps for good, or pauses ``seconds`` (to open a race window wide)."""

    rank: int
    call: int
    step: str
    kind: str = "exit"  # "exit" | "sleep" | "pause"
    seconds: float = 0.0

    def strike(self, rank: int, call: int, step: str) -> None:
        if (rank, step) != (self.rank, self.step) or self.call not in (-1, call):
            return
        if self.kind == "pause":
            time.sleep(self.seconds)
            return
        if self.kind == "exit":
            os._exit(17)
        time.sleep(3600)  # the launcher kills this process at its deadline


def replay_hold(replay: dict[str, Any], written: Callable[[], bool] | None) -> str:
    """Wait before the held step until the race's other access happened: ``written()``
    says whether the watched instance no longer holds what the held step should see
    (None: no watch); returns what the wait saw, for the report."""
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        # the flag first, then the watch: the other rank raises the flag after its step
        # wrote, so a write that landed with the flag (in one poll) is named as the write
        released = os.path.exists(replay["flag"])
        if written is not None and written():
            return f"released when {replay['watch']} was written, after {waited:.2f} s"
        if released:
            return f"released by the other access's step after {waited:.2f} s"
        if waited >= replay["hold_s"]:
            return (f"NOT FORCED: nothing happened within {replay['hold_s']:g} s of holding "
                    "(the harness orders these steps another way)")
        time.sleep(0.001)


def replay_release(replay: dict[str, Any]) -> None:
    """The other access's step has run on its rank: let the held rank go."""
    with open(replay["flag"], "w"):
        pass
