"""Property test: the happens-before checker and the brute-force oracle agree."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.hb_oracle import oracle_keys, oracle_unwritten, random_schedule_text

from dcpc.check import hb, structural
from dcpc.lang.model import Schedule
from dcpc.lang.parse import parse_text

UNWRITTEN = re.compile(r"^step '([^']+)' reads symmetric buffer '([^']+)'")


def checker_unwritten(schedule: Schedule) -> set[tuple[str, ...]]:
    """The structural check's reads of symmetric buffers nothing wrote (on some rank), as
    the brute force's keys; any other structural error fails the test."""
    out = set()
    for d in structural.check(schedule, range(2, 5)):
        if d.severity != "error":
            continue
        found = UNWRITTEN.match(d.message)
        assert d.code == "read-before-write" and found, d
        out.add(("read-before-write", "", found.group(2), found.group(1), ""))
    return out


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_oracle_report_the_same_findings(data: st.DataObject) -> None:
    text = random_schedule_text(data.draw, st)
    schedule = parse_text(text)
    errors = [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]
    assert errors == [], text  # the generator only makes structurally valid schedules
    for world in (2, 3, 4):
        report = hb.check(schedule, [world], hints=False)
        assert {f.key for f in report.findings} == oracle_keys(schedule, world), (text, world)
        assert oracle_unwritten(schedule, world) == set(), (text, world)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_reads_of_what_only_a_root_wrote_are_refused_as_the_brute_force_finds(
        data: st.DataObject) -> None:
    """Externals may read a reduce's via, written on its root only: the data flow
    (read-before-write) refuses exactly the reads the brute force finds of an instance
    no write of the call reached; without such reads, the races agree as above."""
    text = random_schedule_text(data.draw, st, root_reads=True)
    schedule = parse_text(text)
    refused = checker_unwritten(schedule)
    for world in (2, 3, 4):
        assert refused == oracle_unwritten(schedule, world), (text, world)
        if not refused:
            keys = {f.key for f in hb.check(schedule, [world], hints=False).findings}
            assert keys == oracle_keys(schedule, world), (text, world)


def test_oracle_sees_what_the_checker_sees_on_a_known_race() -> None:
    """Guard against an oracle that finds nothing: it must find the classic race."""
    schedule = parse_text(
        "schedule: q\nslots: 1\nsizes: {N: 4, K: {multiple_of: W}}\n"
        "buffers:\n  x: {shape: [N, K], dtype: f32}\n"
        "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\n"
        "steps:\n  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n"
        "  - use: {op: external, reads: [g]}\n"
    )
    # the engine's read of what gather returns races too (issue 33 flaky22)
    expected = {("race", "write-after-read", "g", "use", "gather"),
                ("race", "write-after-read", "g", "gather", "gather")}
    assert oracle_keys(schedule, 2) == expected
    assert {f.key for f in hb.check(schedule, [2]).findings} == expected


def test_oracle_sees_a_read_off_the_root_and_a_read_in_flight() -> None:
    """Guard against an oracle that finds no unwritten read: a reduce's via read on
    every rank, a split-phase shift's dst read before its wait lands it."""
    head = ("schedule: q\nsizes: {N: 4, D: 2}\nbuffers:\n  x: {shape: [N, D], dtype: f32}\n"
            "  y: {shape: [N, D], dtype: f32}\n  v: {shape: [W, N, D], dtype: f32, "
            "symmetric: true}\n  s: {shape: [N, D], dtype: f32, symmetric: true}\nsteps:\n")
    reduce = parse_text(head + "  - red: {op: reduce, src: x, dst: y, root: 1, via: v}\n"
                        "  - use: {op: external, reads: [v], writes: [y]}\n")
    shift = parse_text(head + "  - put: {op: shift, src: x, dst: s, phase: put}\n"
                       "  - use: {op: external, reads: [s], writes: [y]}\n"
                       "  - land: {op: shift, src: x, dst: s, phase: wait}\n")
    for world in (2, 3):
        assert oracle_unwritten(reduce, world) == {("read-before-write", "", "v", "use", "")}
        assert oracle_unwritten(shift, world) == {("read-before-write", "", "s", "use", "")}
        assert checker_unwritten(reduce) == oracle_unwritten(reduce, world)
        assert checker_unwritten(shift) == oracle_unwritten(shift, world)
