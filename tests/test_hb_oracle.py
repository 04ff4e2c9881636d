"""Property test: the happens-before checker and the brute-force oracle agree."""

from __future__ import annotations

from hb_oracle import oracle_keys, random_schedule_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcpc.check import hb, structural
from dcpc.lang.parse import parse_text


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


def test_oracle_sees_what_the_checker_sees_on_a_known_race() -> None:
    """Guard against an oracle that finds nothing: it must find the classic race."""
    schedule = parse_text(
        "schedule: q\nslots: 1\nsizes: {N: 4, K: {multiple_of: W}}\n"
        "buffers:\n  x: {shape: [N, K], dtype: f32}\n"
        "  g: {shape: [W*N, K], dtype: f32, symmetric: true}\n"
        "steps:\n  - gather: {op: all_gather, src: x, dst: g, dim: 0}\n"
        "  - use: {op: external, reads: [g]}\n"
    )
    expected = {("race", "write-after-read", "g", "use", "gather")}
    assert oracle_keys(schedule, 2) == expected
    assert {f.key for f in hb.check(schedule, [2]).findings} == expected
