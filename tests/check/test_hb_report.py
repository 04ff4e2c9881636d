"""Counterexamples: consistent cuts, readable timelines, the DOT drawing, speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc.check import hb
from dcpc.check.hb.clocks import World, analyze
from dcpc.check.hb.events import lower
from dcpc.check.hb.races import find_races
from dcpc.check.hb.report import race_cut
from dcpc.check.hb.timeline import stream_positions
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "hb_corpus"
RACY = [p for p in sorted(CORPUS.glob("*.yaml"))
        if not p.name.endswith(".fixed.yaml") and "# expect: race" in p.read_text()]


def _clock(world: World, rank: int, pos: int) -> list[int]:
    return world.rotated(pos, rank)


@pytest.mark.parametrize("path", RACY, ids=lambda p: p.stem)
def test_race_cut_is_consistent_and_enables_both_accesses(path: Path) -> None:
    program = lower(parse_file(path))
    for w in (2, 3, 4):
        world = analyze(program, w)
        for race in find_races(world):
            cut = race_cut(world, race)
            # closed under happens-before: every event in it has all its predecessors in it
            for rank in range(w):
                for stream in range(world.streams):
                    done = stream_positions(world, stream)[: cut[rank * world.streams + stream]]
                    for pos in done:
                        assert world.live[pos]
                        assert all(c <= k for c, k in zip(_clock(world, rank, pos), cut,
                                                          strict=True))
            # neither access ran, and each can run next; of a race with a store in flight
            # one access may happen before the other (the push before what touches the
            # instance before it lands): that one has run
            for touch, other in ((race.first, race.second), (race.second, race.first)):
                pos = world.pos(touch.call, touch.j)
                own = touch.rank * world.streams + program.stream(touch.call)
                if world.hb(touch.rank, pos, other.rank, world.pos(other.call, other.j)):
                    assert race.in_flight
                    assert cut[own] > program.stream_index(touch.call, touch.j)
                    continue
                assert cut[own] == program.stream_index(touch.call, touch.j)
                needs = _clock(world, touch.rank, pos)
                needs[own] -= 1
                assert all(c <= k for c, k in zip(needs, cut, strict=True))


def test_timeline_reads_like_the_execution() -> None:
    report = hb.check(parse_file(CORPUS / "query_no_exchange.yaml"), range(2, 9))
    # attention's read (the same race at query_gather's return is the other finding)
    (finding,) = [f for f in report.findings if f.key[3] == "attention"]
    assert finding.world == 2
    assert finding.timeline == [
        "rank 0: call 0 query_gather ✓ attention → reading q_full[rank 0, slot 0]",
        "rank 1: call 0 query_gather ✓ attention ✓ | call 1 query_gather → writing "
        "q_full[rank 0, slot 0] H block 1 (dim 1)",
    ]
    assert (finding.first.rank, finding.first.call, finding.first.access) == (0, 0, "read")
    assert (finding.second.rank, finding.second.call, finding.second.access) == (1, 1, "write")
    assert finding.second.region == "q_full[rank 0, slot 0] H block 1 (dim 1)"


def test_deadlock_timeline_shows_every_rank_stuck() -> None:
    report = hb.check(parse_file(CORPUS / "ring_wait_before_signal.yaml"), range(3, 9))
    (finding,) = report.findings  # one cycle, reported once, at the step that waits
    assert (finding.kind, finding.cls, finding.world) == ("deadlock", "cycle", 3)
    assert finding.first.step == "ring_wait"
    assert len(finding.timeline) == 3
    for line in finding.timeline:
        assert "attention ✓ ring_wait ⏳ waits for rank" in line
        assert "ring_signal, which never runs" in line


def test_large_world_timeline_shows_the_chain_and_names_the_ranks_left_out() -> None:
    text = (CORPUS / "ring_release_w3.yaml").read_text()
    report = hb.check(parse_text(text), [6])
    (finding,) = [f for f in report.findings if f.key[3] == "attention"]
    assert {finding.first.rank, finding.second.rank} == {0, 2}
    *lines, note = finding.timeline
    # rank 1 is on the chain: rank 2 learnt of it (its ring_wait), rank 0's access did not
    assert [int(line.split(":")[0].split()[1]) for line in lines] == [0, 1, 2]
    assert note == ("(ranks 3, 4, 5 not shown: no event of theirs orders, or fails to "
                    "order, the two shown)")


def test_a_rank_past_its_wait_is_not_labelled_waiting() -> None:
    report = hb.check(parse_file(CORPUS / "fused_src_after_wait.yaml"), [2])
    (finding,) = report.findings
    line = next(t for t in finding.timeline if t.startswith("rank 0"))
    assert "combine (sent) → reading o_part" in line and "waiting" not in line


def test_hb_dot_draws_every_rank_and_highlights_the_conflict() -> None:
    schedule = parse_file(CORPUS / "query_no_exchange.yaml")
    finding = hb.check(schedule, [2]).findings[0]
    dot = hb.hb_dot(schedule, 2, finding)
    assert dot.startswith('digraph "hb_query_no_exchange" {') and dot.rstrip().endswith("}")
    assert "cluster_rank0" in dot and "cluster_rank1" in dot
    assert dot.count("color=red, penwidth=2.5") == 2
    assert "write-after-read on q_full" in dot
    # 2 ranks x 2 calls x 3 events; program order 2*(2*3-1); gather signals 2 ranks x 2 calls
    assert dot.count(" [label=") == 12
    assert dot.count("style=dashed") == 4
    clean = hb.hb_dot(parse_file(ROOT / "schedules" / "kimi_k3_dcp.yaml"), 3)
    assert "color=red" not in clean and "cluster_rank2" in clean


def test_kimi_check_for_w_2_to_72() -> None:
    """Proved at every W of 2..72 (its time is a benchmark's: benchmarks/check_scaling.py,
    never a timed test)."""
    schedule = parse_file(ROOT / "schedules" / "kimi_k3_dcp.yaml")
    report = hb.check(schedule, range(2, 73))
    assert report.ok and report.stats["worlds"] == 71


WIPE = """\
schedule: hint_wipe
slots: 1
sizes: {T: {max: 16}, H: {multiple_of: W}, D: 64}
buffers:
  q_local: {shape: [T, H/W, D], dtype: bf16}
  k_local: {shape: [T, H/W, D], dtype: bf16}
  q_full:  {shape: [T, H, D],   dtype: bf16, symmetric: true}
  o_part:  {shape: [T, H, D],   dtype: bf16}
  o2:      {shape: [T, H, D],   dtype: bf16}
steps:
  - query_gather: {op: all_gather, src: q_local, dst: q_full, dim: 1}
  - attention:    {op: external, reads: [q_full], writes: [o_part]}
  - key_gather:   {op: all_gather, src: k_local, dst: q_full, dim: 1}
  - second:       {op: external, reads: [q_full, o_part], writes: [o2]}
"""


def test_hints_are_proved_through_the_whole_pipeline() -> None:
    from dcpc.check.hb.hints import _move_after, proved_keys

    schedule = parse_text(WIPE)
    # moving attention after key_gather ends the race but attention would then read the
    # keys instead of the query: refused
    wiped = _move_after(schedule, "attention", "key_gather")
    assert proved_keys(wiped, schedule, [2], None) is None
    # moving the query gather after its reader is a read-before-write: refused
    early = _move_after(schedule, "query_gather", "attention")
    assert proved_keys(early, schedule, [2], None) is None
    # a barrier after attention keeps the data flow and is checked for real
    from dcpc.check.hb.hints import _barrier_after

    fixed = proved_keys(_barrier_after(schedule, "attention"), schedule, [2], None)
    assert fixed is not None and not any(k[3:] == ("attention", "key_gather") or
                                         k[3:] == ("key_gather", "attention") for k in fixed)
    for finding in hb.check(schedule, [2]).findings:
        assert finding.hint is not None and "move attention after key_gather" not in finding.hint


def test_a_cycle_is_reported_once_at_the_step_that_waits() -> None:
    schedule = parse_text("""\
schedule: two_wait_cycle
slots: 1
sizes: {T: {max: 16}, H: {multiple_of: W}, D: 64}
buffers:
  q_local: {shape: [T, H/W, D], dtype: bf16}
  q_full:  {shape: [T, H, D],   dtype: bf16, symmetric: true}
steps:
  - a_wait:   {op: wait, from: all, channel: a}
  - b_wait:   {op: wait, from: all, channel: b}
  - query_gather: {op: all_gather, src: q_local, dst: q_full, dim: 1}
  - a_signal: {op: signal, to: all, channel: a}
  - b_signal: {op: signal, to: all, channel: b}
""")
    report = hb.check(schedule, range(2, 6))
    assert [(f.kind, f.cls, f.first.step) for f in report.findings] == [
        ("deadlock", "cycle", "a_wait")]
    (diag,) = report.diagnostics()
    assert diag.mark == next(s for s in schedule.step_list() if s.name == "a_wait").mark()
