"""The unroll bound: calls 0 .. 2*slots-1 per rank find every race and deadlock.

Unrolling more calls must find nothing new (same keys, same smallest W); unrolling
fewer must miss something on a schedule that needs them (the bound is not slack).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hb_oracle import oracle_keys, random_schedule_text

from dcpc.check import hb
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "tests" / "hb_corpus").glob("*.yaml")) + sorted(
    (ROOT / "schedules").glob("*.yaml"))


def _found(schedule, worlds, calls=None) -> dict:
    return {f.key: f.world for f in hb.check(schedule, worlds, calls=calls, hints=False).findings}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_more_calls_find_nothing_new_on_the_corpus(path: Path) -> None:
    schedule = parse_file(path)
    bound = 2 * schedule.slots
    assert _found(schedule, range(2, 7), calls=3 * schedule.slots + 2) == _found(
        schedule, range(2, 7))
    # the oracle, with its own unrolling, agrees at the longer horizon too
    for world in (2, 3):
        assert oracle_keys(schedule, world, calls=bound + 3) == oracle_keys(schedule, world)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_more_calls_find_nothing_new_on_random_schedules(data: st.DataObject) -> None:
    schedule = parse_text(random_schedule_text(data.draw, st))
    longer = 3 * schedule.slots + 2
    assert _found(schedule, [2, 3, 4], calls=longer) == _found(schedule, [2, 3, 4])


def test_fewer_calls_miss_the_reuse_of_a_slot() -> None:
    """Two slots on independent streams: the race is between calls c and c+2."""
    schedule = parse_file(ROOT / "tests" / "hb_corpus" / "two_slots_no_cross_rank.yaml")
    assert _found(schedule, [2], calls=2) == {}
    assert _found(schedule, [2]) != {}
    assert oracle_keys(schedule, 2, calls=2) == set()


def test_shared_buffers_need_partners_up_to_slots_away() -> None:
    """A shared buffer with 3 slots: calls 0..5 see it; call 0 alone sees nothing."""
    text = (ROOT / "tests" / "hb_corpus" / "shared_recv_two_slots.yaml").read_text()
    schedule = parse_text(text.replace("slots: 2", "slots: 3"))
    assert _found(schedule, [2], calls=1) == {}
    assert _found(schedule, [2]) == _found(schedule, [2], calls=12) != {}


# --- the world bound: past it, one W stands for every larger one ---------------------

def _every(schedule, worlds) -> dict:
    return {f.key: f.world for f in hb.check(schedule, worlds, hints=False,
                                             every_world=True).findings}


RINGS = sorted((ROOT / "tests" / "sync_regressions").glob("*.yaml")) + [
    ROOT / "tests" / "hb_corpus" / "ring_release_w3.yaml"]


@pytest.mark.parametrize("path", FILES + RINGS, ids=lambda p: p.name)
def test_the_world_bound_finds_what_every_w_finds_on_the_corpus(path: Path) -> None:
    schedule = parse_file(path)
    report = hb.check(schedule, range(2, 61), hints=False)
    assert report.stats["worlds_analysed"] < 59 or report.stats["world_bound"] >= 58
    assert {f.key: f.world for f in report.findings} == _every(schedule, range(2, 61))


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_world_bound_finds_what_every_w_finds_on_random_schedules(
        data: st.DataObject) -> None:
    schedule = parse_text(random_schedule_text(data.draw, st))
    worlds = range(2, 48)
    assert {f.key: f.world for f in hb.check(schedule, worlds, hints=False).findings} == \
        _every(schedule, worlds)


def test_the_world_bound_is_not_slack_for_rings() -> None:
    """A ring release of h hops races first at W = h + 2: every W up to the bound is
    needed, and the bound grows with the hops."""
    text = (ROOT / "tests" / "sync_regressions" / "ring_two_hops.yaml").read_text()
    hops = "".join(f"  - hop{k}_signal: {{op: signal, to: next, channel: ring}}\n"
                   f"  - hop{k}_wait:   {{op: wait, from: prev, channel: ring}}\n"
                   for k in range(3, 7))
    schedule = parse_text(text + hops)  # six hops: clean up to W = 7
    report = hb.check(schedule, range(2, 200), hints=False)
    # the reader's race and the same at the gather's return (the engine reads it)
    assert {(f.kind, f.world) for f in report.findings} == {("race", 8)}
    assert report.stats["world_bound"] >= 2 * 6 * 2 + 3
