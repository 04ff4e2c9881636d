"""The hint search's kept proofs (dcpc.check.hb.hints.Proofs): every answer it keeps for
an edit is the one a fresh re-check of that edit gives (``proved_keys``), and two edits
are one only when they are the same schedule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    suggest,
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


def _edits(twin: str, worlds: list[int]) -> Iterator[tuple[Any, Proofs, list[int], Any]]:
    """Every edit the hint search makes for the findings of ``twin`` at ``worlds`` (one
    Proofs for all, as hb.check's): (the compiled twin, the Proofs, the W it is proved
    at, the edited schedule)."""
    c = pipeline.run(TWINS / f"{twin}.yaml", pipeline.Options(worlds=worlds), until="lower")
    assert c.schedule is not None and c.semantics is not None
    report = hb.check(c.schedule, c.worlds, plan=c.plan, semantics=c.semantics, hints=False)
    assert report.findings, twin
    proofs = Proofs(c.schedule, c.semantics)
    for finding in report.findings:
        at = proving_worlds(c.schedule, finding, c.worlds)
        edits = (_race_edits(c.schedule, finding, c.semantics) if finding.kind == "race"
                 else _deadlock_edits(c.schedule, finding))
        for _, make in edits:
            try:
                edited = make()
            except (KeyError, StopIteration, ValueError):
                continue
            yield c, proofs, at, edited


@pytest.mark.parametrize(("twin", "worlds"), CASES, ids=[c[0] for c in CASES])
def test_a_kept_proof_is_the_one_a_recheck_gives(twin: str, worlds: list[int]) -> None:
    asked = 0
    for c, proofs, at, edited in _edits(twin, worlds):
        asked += 1
        assert proofs.proved(edited, at, None) == proved_keys(
            edited, c.schedule, at, None), twin
    assert asked > 0


def test_every_twin_case_keeps_proofs_for_repeated_edits() -> None:
    """The kept proofs are used: over the findings of these twins some edit comes back
    (else the comparison above compares nothing kept)."""
    repeated = 0
    for twin, worlds in CASES:
        keys = [(proofs._edit_key(edited), tuple(at))
                for _, proofs, at, edited in _edits(twin, worlds)]
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


# a credit to the wrong neighbour: at W = 2 next is prev and the file is proved, at W = 3
# the sender refills s while its destination still reads it
WRONG_NEIGHBOUR = """\
schedule: wrong_neighbour
slots: 1
sizes: {N: 4, K: 2}
buffers:
  x: {shape: [N, K], dtype: f32}
  y: {shape: [N, K], dtype: f32}
  s: {shape: [N, K], dtype: f32, symmetric: true}
steps:
  - send:  {op: shift, src: x, dst: s, offset: 1}
  - use:   {op: external, reads: [s], writes: [y]}
  - free:  {op: signal, to: next, channel: c}
  - freed: {op: wait, from: prev, channel: c}
"""


def test_a_kept_proof_is_kept_per_w() -> None:
    """The same edit proved at two lists of W: two answers, each a fresh re-check's (a
    proof kept without its W would answer W = 3 with W = 2's)."""
    schedule = parse_text(WRONG_NEIGHBOUR, "wrong_neighbour.yaml")
    proofs = Proofs(schedule)
    edit = _barrier_after(schedule, "send")
    at2, at3 = proofs.proved(edit, [2], None), proofs.proved(edit, [3], None)
    assert at2 == proved_keys(edit, schedule, [2], None) == set()
    assert at3 == proved_keys(edit, schedule, [3], None) and at3, at3


def test_proofs_kept_for_another_schedule_are_refused() -> None:
    schedule = parse_text(WRONG_NEIGHBOUR, "wrong_neighbour.yaml")
    (finding, *_) = hb.check(schedule, [3], hints=False).findings
    other = parse_text(WRONG_NEIGHBOUR, "wrong_neighbour.yaml")
    with pytest.raises(ValueError, match="another schedule"):
        suggest(schedule, finding, worlds=[3], proofs=Proofs(other))
    assert suggest(schedule, finding, worlds=[3], proofs=Proofs(schedule))
