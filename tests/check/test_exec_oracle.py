"""The execution oracle (dcpc.check.oracle) on hand-built plans.

The plans are written here field by field, as dcpc/codegen/plan.py describes them (per
step ``effects`` (buffer, kind, when, region) and ``sync`` (signal, wait, polls)), so
these tests pin the oracle's execution model, not the lowering.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from dcpc.check.oracle import explore
from dcpc.ops.common import peers_of
from dcpc.topology import MeshWorld

BLOCK0 = NS(scheme="block", dim=0, interleave=0)
INDEX0 = NS(scheme="index", dim=0, interleave=0)


def eff(buffer: str, kind: str, when: str = "before", region: NS | None = None) -> NS:
    return NS(buffer=buffer, kind=kind, when=when, region=region)


def sync(signal: str | None = None, wait: str | None = None, polls: int | None = None) -> NS:
    return NS(signal=signal, wait=wait, polls=polls)


def plan(steps: list[tuple[str, list[NS], NS]], buffers: dict[str, str], slots: int = 1,
         streams: str = "per_slot") -> NS:
    return NS(
        slots=slots, streams=streams,
        buffers=[NS(name=n, kind=k) for n, k in buffers.items()],
        steps=[NS(name=n, index=i, effects=e, sync=s, attrs={})
               for i, (n, e, s) in enumerate(steps)],
    )


def gather(i: int, dst: str = "g", region: NS = BLOCK0, src: str = "x") -> tuple:
    return (f"gather{i}" if i else "gather",
            [eff(src, "read"), eff(dst, "write", region=region)], sync("all", "all", i))


def use(name: str, reads: list[str], writes: list[str] = ()) -> tuple:  # type: ignore[assignment]
    return (name, [eff(b, "read") for b in reads] + [eff(b, "write") for b in writes], sync())


def barrier(i: int, name: str = "barrier") -> tuple:
    return (name, [], sync("all", "all", i))


BUFS = {"x": "engine", "g": "symmetric", "s": "symmetric", "y": "engine"}


def pairs(report) -> set[tuple]:
    return {(f.kind, f.cls, f.buffer, f.key[3], f.key[4]) for f in report.findings}


def test_peers_follow_the_kernels_loop_order() -> None:
    assert peers_of("all", 1, 4) == [2, 3, 0]
    assert peers_of("next", 3, 4) == [0] and peers_of("prev", 0, 4) == [3]
    assert peers_of("next", 0, 2) == peers_of("prev", 0, 2) == [1]
    assert peers_of(None, 0, 3) == [] and peers_of("all", 0, 1) == []
    # one mapping for the oracle and the checker's real-steps cut (dcpc.check.hb.legal):
    # a team along one axis of a mesh, from the next member on; an offset and a line
    # along it; a perm's own entry (none for -1); the rank's own flag
    mesh = MeshWorld((2, 3))
    assert peers_of("all", 4, mesh, (1,)) == [5, 3] and peers_of("all", 4, mesh, (0,)) == [1]
    assert peers_of("all", 4, mesh) == [5, 0, 1, 2, 3]
    assert peers_of("next", 5, mesh, (1,)) == [3] and peers_of("prev", 3, mesh, (1,)) == [5]
    assert peers_of("line+1", 5, mesh, (1,)) == [] and peers_of("-2", 3, mesh, (1,)) == [4]
    assert peers_of("perm:2,-1,0", 0, 3) == [2] and peers_of("perm:2,-1,0", 1, 3) == []
    assert peers_of("self", 2, mesh, (0,)) == [2]


def test_gather_then_read_races_with_the_peers_next_gather() -> None:
    p = plan([gather(0), use("attention", ["g"], ["y"])], BUFS)
    for world in (2, 3, 5):
        report = explore(p, world)
        assert pairs(report) == {("race", "write-after-read", "g", "attention", "gather")}
        assert not report.hung


def test_a_barrier_after_the_read_orders_the_next_gather() -> None:
    p = plan([gather(0), use("attention", ["g"], ["y"]), barrier(2)], BUFS)
    for world in (2, 3, 4, 5):
        assert explore(p, world, randoms=4).findings == []


def test_read_before_the_gather_of_the_same_call_is_a_read_after_write_race() -> None:
    # a local read of g, then the gather into g: the peer's store of this call is not
    # ordered after our read (write-after-read), nor its previous one before it.
    p = plan([use("early", ["g"]), gather(1)], BUFS)
    keys = pairs(explore(p, 2))
    assert ("race", "write-after-read", "g", "early", "gather1") in keys


def test_stores_of_one_partition_overlap_only_for_the_same_writer() -> None:
    # two pushes into g, both signalled before either is waited for: every rank's two
    # stores land in every instance unordered with the peers' ones
    def steps(region: NS) -> list[tuple]:
        return [("push0", [eff("g", "write", region=BLOCK0)], sync(signal="all")),
                ("push1", [eff("g", "write", region=region)], sync(signal="all")),
                ("wait0", [], sync(wait="all", polls=0)), ("wait1", [], sync(wait="all", polls=1)),
                use("attention", ["g"]), barrier(5)]
    # the same partition: writer p only ever writes part p
    assert explore(plan(steps(BLOCK0), BUFS), 3).findings == []
    # another partition (index) overlaps every part of the block one
    keys = pairs(explore(plan(steps(INDEX0), BUFS), 2))
    assert keys == {("race", "write-after-write", "g", "push0", "push1")}


def test_split_phase_release_ring_is_enough_at_w2_not_at_w3() -> None:
    steps = [gather(0), use("attention", ["g"]),
             ("ring_signal", [], sync(signal="next")),
             ("ring_wait", [], sync(wait="prev", polls=2))]
    p = plan(steps, BUFS)
    assert explore(p, 2).findings == []
    assert pairs(explore(p, 3)) == {("race", "write-after-read", "g", "attention", "gather")}


def test_a_second_wait_polling_the_same_signal_passes_at_once() -> None:
    """Issue 12, bug 1: the emitted wait polled the channel's FIRST signal step."""
    steps = [gather(0), ("sig1", [], sync(signal="all")), ("wait1", [], sync(wait="all", polls=1)),
             use("attention", ["g"]), ("sig2", [], sync(signal="all")),
             ("wait2", [], sync(wait="all", polls=1))]  # should poll 4
    buggy = plan(steps, BUFS)
    assert ("race", "write-after-read", "g", "attention", "gather") in pairs(explore(buggy, 2))
    steps[5] = ("wait2", [], sync(wait="all", polls=4))
    assert explore(plan(steps, BUFS), 2).findings == []


def test_a_wait_from_next_polling_a_signal_to_next_hangs_from_w3() -> None:
    steps = [("sig", [], sync(signal="next")),
             ("from_prev", [], sync(wait="prev", polls=0)),
             ("from_next", [], sync(wait="next", polls=0))]
    p = plan(steps, BUFS)
    assert not explore(p, 2).hung
    report = explore(p, 3)
    assert report.hung
    assert pairs(report) == {("deadlock", "no-signal", "sig", "from_next", "")}


def test_waiting_before_signalling_is_a_cycle() -> None:
    steps = [("wait", [], sync(wait="prev", polls=1)), ("signal", [], sync(signal="next"))]
    report = explore(plan(steps, BUFS), 3)
    assert report.hung
    assert pairs(report) == {("deadlock", "cycle", "signal", "wait", "signal")}
    assert {(r, c) for r, c, _ in report.blocked} == {(0, 0), (1, 0), (2, 0)}


def test_a_step_blocked_behind_a_hang_is_not_a_finding() -> None:
    # rank r waits for rank r+1 on a channel nobody signals towards r+1 ... r: the
    # barrier after it hangs too, but only because of the first wait.
    steps = [("sig", [], sync(signal="next")), ("bad", [], sync(wait="next", polls=0)),
             barrier(2)]
    report = explore(plan(steps, BUFS), 3)
    assert report.hung
    assert {f.key[3] for f in report.findings} == {"bad"}


def test_shared_instance_races_between_slots_on_independent_streams() -> None:
    steps = [gather(0, dst="s"), use("attention", ["s"]), barrier(2)]
    bufs = dict(BUFS, s="shared")
    per_slot = plan(steps, bufs, slots=2)
    keys = pairs(explore(per_slot, 2))
    assert ("race", "write-after-write", "s", "gather", "gather") in keys
    assert ("race", "read-after-write", "s", "gather", "attention") in keys
    # one stream per rank orders the slots: clean
    assert explore(plan(steps, bufs, slots=2, streams="single"), 2).findings == []
    # per-slot instances: clean on independent streams too
    assert explore(plan(steps, BUFS, slots=2), 3).findings == []


def test_after_effects_follow_the_wait() -> None:
    # a fused exchange: push into via, signal, wait, then read via and (own part) src
    fused = ("combine", [eff("o", "read"), eff("via", "write", region=INDEX0),
                         eff("via", "read", "after"), eff("o", "read", "after"),
                         eff("y", "write", "after")], sync("all", "all", 1))
    bufs = {"o": "symmetric", "via": "symmetric", "x": "engine", "y": "engine"}
    # o is written by peers (a gather) and read after the wait: the next call's gather
    # is not ordered after the merge's read of o
    p = plan([gather(0, dst="o"), fused], bufs)
    keys = pairs(explore(p, 2))
    assert ("race", "write-after-read", "o", "combine", "gather") in keys
    assert ("race", "write-after-read", "o", "combine", "gather") in keys
    p = plan([gather(0, dst="o"), fused, barrier(2)], bufs)
    assert explore(p, 3).findings == []


@pytest.mark.parametrize(("case", "world"), [("ring", 2), ("ring", 3), ("two_waits", 2),
                                             ("two_waits", 3), ("shared", 2), ("fused", 2),
                                             ("fused", 3)])
def test_the_schedulers_reach_everything_the_exhaustive_search_reaches(case: str,
                                                                         world: int) -> None:
    """Tiny cases: the union over EVERY interleaving is what lockstep alone finds."""
    bufs = dict(BUFS, s="shared")
    slots = 1
    if case == "ring":
        steps = [gather(0), use("attention", ["g"]), ("sig", [], sync(signal="next")),
                 ("wait", [], sync(wait="prev", polls=2))]
    elif case == "two_waits":
        steps = [gather(0), ("sig1", [], sync(signal="all")),
                 ("wait1", [], sync(wait="all", polls=1)), use("attention", ["g"]),
                 ("wait2", [], sync(wait="all", polls=1))]
    elif case == "shared":
        steps, slots = [gather(0, dst="s"), use("attention", ["s"])], 2
    else:
        steps = [gather(0), ("sig", [], sync(signal="prev")), use("attention", ["g"]),
                 ("wait", [], sync(wait="next", polls=1))]
    p = plan(steps, bufs, slots=slots)
    calls = 2 * slots
    every = explore(p, world, calls=calls, exhaustive=True)
    assert every.states > 10
    for policy in ("lockstep", "hold"):
        assert explore(p, world, calls=calls, policies=[policy]).keys() == every.keys()
    some = explore(p, world, calls=calls, policies=[], randoms=6, seed=world)
    assert some.keys() <= every.keys()


def test_more_calls_find_nothing_new_on_the_hand_built_cases() -> None:
    p = plan([gather(0, dst="s"), use("attention", ["s"]), barrier(2)],
             dict(BUFS, s="shared"), slots=3)
    base = explore(p, 3).keys()
    assert base and explore(p, 3, calls=12).keys() == base
