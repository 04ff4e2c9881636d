"""The engine reads what a method returns, at its return (issue 33 flaky22): a peer's
next push into a returned symmetric output before this rank's return is a race the
checker refuses (it said "ok" to tests/codegen/test_new_op.py's copy + all_gather with
no barrier, whose run then returned the peer's next call's data)."""

from __future__ import annotations

from support.exec_oracle_agree import disagreements
from support.hb_oracle import oracle_keys
from support.schedules import GATHER_NO_BARRIER

from dcpc.check import hb
from dcpc.lang.parse import parse_text

HEAD = GATHER_NO_BARRIER
RETURN_RACE = ("race", "write-after-read", "g", "gather", "gather")


def test_a_gathered_output_no_step_reads_is_refused_without_a_barrier() -> None:
    schedule = parse_text(HEAD)
    for world in (2, 3):
        report = hb.check(schedule, [world])
        assert {f.key for f in report.findings} == {RETURN_RACE} == oracle_keys(schedule, world)
    (finding,) = hb.check(schedule, [2]).findings
    assert (finding.first.rank, finding.first.call, finding.first.access) == (0, 0, "read")
    assert (finding.second.rank, finding.second.call, finding.second.access) == (1, 1, "write")
    assert finding.timeline[1].endswith("| call 1 keep ✓ gather → writing g[rank 0, slot 0] "
                                        "W*D block 1 (dim 1)"), finding.timeline
    assert "barrier after gather" in (finding.hint or "")


def test_a_barrier_after_the_gather_frees_its_output() -> None:
    schedule = parse_text(HEAD + "  - release: {op: barrier}\n")
    for world in (2, 3):
        assert hb.check(schedule, [world]).ok
        assert oracle_keys(schedule, world) == set()


def test_two_gathers_into_one_buffer_with_no_read_between_are_refused() -> None:
    """docs/hb-checker.md's case once "not covered": the second push can land before a
    slow rank's first gather returns, which the first gather's return now reads."""
    schedule = parse_text(HEAD + "  - again: {op: all_gather, src: y, dst: g, dim: 1}\n"
                          "  - release: {op: barrier}\n")
    keys = {f.key for f in hb.check(schedule, [2]).findings}
    assert ("race", "write-after-read", "g", "gather", "again") in keys
    assert keys == oracle_keys(schedule, 2)


# a second gather into g after a barrier, guarded off at W = 2 (issue 33 flaky23): it runs
# on no rank there, but its method is still called on every rank and returns g as it
# stands, which the engine reads (dcpc.harness.worker ``held``); rank 1's next call's
# gather pushes into rank 0's g before that read (a run failed at call 4, 96 elements)
SKIPPED = HEAD + ("  - landed: {op: barrier}\n"
                  '  - again: {op: all_gather, src: y, dst: g, dim: 1, when: "W > 2"}\n')
SKIPPED_RACE = ("race", "write-after-read", "g", "again", "gather")


def test_the_return_of_a_method_that_runs_on_no_rank_is_still_read() -> None:
    schedule = parse_text(SKIPPED)
    for world in (2, 3):  # at W = 3 again runs; at W = 2 it runs nowhere, and still races
        assert {f.key for f in hb.check(schedule, [world]).findings} == {SKIPPED_RACE}
        assert oracle_keys(schedule, world) == {SKIPPED_RACE}
    assert disagreements(schedule, [2, 3]) == []  # the execution oracle runs into it too
    (finding,) = hb.check(schedule, [2]).findings
    assert "the engine still reads what again on rank 0 (call 0) returned" in finding.message
    assert finding.world == 2
    # the other access in the one wording of a returned read (report.access_text)
    assert finding.first.text() == ("the engine reads what again on rank 0 (call 0) returned, "
                                    f"g[rank 0, slot 0], at {finding.first.mark}")
    # again is skipped on both ranks: rank 0 reads what its method returned there
    assert finding.timeline[0].endswith("again (skipped) → reading g[rank 0, slot 0]"), \
        finding.timeline
    assert "again (skipped) | call 1 keep ✓ gather → writing" in finding.timeline[1]
    fixed = parse_text(SKIPPED + "  - release: {op: barrier}\n")
    assert hb.check(fixed, [2]).ok and oracle_keys(fixed, 2) == set()
