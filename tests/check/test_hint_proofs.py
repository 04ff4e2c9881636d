"""The hint search's kept proofs (dcpc.check.hb.hints.Proofs): every answer it keeps for
an edit is the one a fresh re-check of that edit gives (``proved_keys``), and two edits
are one only when they are the same schedule."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcpc import pipeline
from dcpc.check import hb
from dcpc.check.hb.hints import (
    Proofs,
    _barrier_after,
    _deadlock_edits,
    _race_edits,
    _with_op,
    proved_keys,
    proving_worlds,
)
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
TWINS = ROOT / "tests" / "gallery_twins"

# wrong twins whose findings propose the same edits again (a barrier after one step,
# `slots: 2`, a move), races and deadlocks (`wait on channel`, `use to:`), at W where
# they are found; small enough to re-check every edit afresh
CASES = [
    ("ring_attention.no_credit", [2, 3, 4]),
    ("custom_all_reduce.no_end_barrier", [2, 3, 4]),
    ("ring_attention.wait_before_signal", [2, 3, 4]),
    ("moe_dispatch_combine.shared_recv", [2, 3, 4]),
    ("pcp_prefill.no_release", [2, 3, 4]),
    ("pipeline_handoff.no_credit", [2, 3, 4]),
]


@pytest.mark.parametrize(("twin", "worlds"), CASES, ids=[c[0] for c in CASES])
def test_a_kept_proof_is_the_one_a_recheck_gives(twin: str, worlds: list[int]) -> None:
    c = pipeline.run(TWINS / f"{twin}.yaml", pipeline.Options(worlds=worlds), until="lower")
    assert c.schedule is not None and c.semantics is not None
    report = hb.check(c.schedule, c.worlds, plan=c.plan, semantics=c.semantics, hints=False)
    assert report.findings, twin
    proofs = Proofs(c.schedule, c.semantics)  # one for every finding, as hb.check's
    asked = 0
    for finding in report.findings:
        at = proving_worlds(c.schedule, finding, c.worlds)
        edits = (_race_edits(c.schedule, finding, c.semantics) if finding.kind == "race"
                 else _deadlock_edits(c.schedule, finding))
        for _, make in edits:
            try:
                edited = make()
            except (KeyError, StopIteration, ValueError):
                continue
            asked += 1
            assert proofs.proved(edited, at, None) == proved_keys(
                edited, c.schedule, at, None), (twin, finding.key)
    assert asked > 0


def test_every_twin_case_keeps_proofs_for_repeated_edits() -> None:
    """The kept proofs are used: over the findings of these twins some edit comes back
    (else the comparison above compares nothing kept)."""
    repeated = 0
    for twin, worlds in CASES:
        c = pipeline.run(TWINS / f"{twin}.yaml", pipeline.Options(worlds=worlds),
                         until="lower")
        assert c.schedule is not None and c.semantics is not None
        report = hb.check(c.schedule, c.worlds, plan=c.plan, semantics=c.semantics,
                          hints=False)
        proofs = Proofs(c.schedule, c.semantics)
        keys = []
        for finding in report.findings:
            at = proving_worlds(c.schedule, finding, c.worlds)
            edits = (_race_edits(c.schedule, finding, c.semantics) if finding.kind == "race"
                     else _deadlock_edits(c.schedule, finding))
            for _, make in edits:
                try:
                    keys.append((proofs._edit_key(make()), tuple(at)))
                except (KeyError, StopIteration, ValueError):
                    continue
        repeated += len(keys) - len(set(keys))
    assert repeated > 0


TWO_WAITS = """\
schedule: two_waits
slots: 1
sizes: {T: {max: 16}, H: {multiple_of: W}, D: 64}
buffers:
  q_local: {shape: [T, H/W, D], dtype: bf16}
  q_full:  {shape: [T, H, D],   dtype: bf16, symmetric: true}
steps:
  - a_signal: {op: signal, to: all, channel: a}
  - b_signal: {op: signal, to: all, channel: b}
  - gather:   {op: all_gather, src: q_local, dst: q_full, dim: 1}
  - a_wait:   {op: wait, from: all, channel: a}
  - b_wait:   {op: wait, from: all, channel: b}
"""


def test_two_edits_are_one_only_when_they_are_the_same_schedule() -> None:
    schedule = parse_text(TWO_WAITS)
    proofs = Proofs(schedule)
    key = proofs._edit_key
    # the same edit made twice (new op objects each time): one
    assert key(_barrier_after(schedule, "gather")) == key(_barrier_after(schedule, "gather"))
    assert key(_with_op(schedule, "a_wait", channel="c")) == key(
        _with_op(schedule, "a_wait", channel="c"))
    # the same words for two steps ("wait on channel c"): two edits
    assert key(_with_op(schedule, "a_wait", channel="c")) != key(
        _with_op(schedule, "b_wait", channel="c"))
    assert key(_barrier_after(schedule, "gather")) != key(_barrier_after(schedule, "a_wait"))
    # a schedule-level field and a buffer's flag count
    assert key(schedule.model_copy(update={"slots": 2})) != key(schedule)
    buffers = dict(schedule.buffers)
    buffers["q_full"] = buffers["q_full"].model_copy(update={"shared": True})
    assert key(schedule.model_copy(update={"buffers": buffers})) != key(schedule)
    # and the answers are those of a fresh re-check
    for edited in (_barrier_after(schedule, "gather"), _with_op(schedule, "b_wait", channel="a")):
        assert proofs.proved(edited, [2, 3], None) == proved_keys(edited, schedule, [2, 3], None)
