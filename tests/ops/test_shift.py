"""shift, the point-to-point op (whole, or split in ``phase: put`` / ``phase: wait``):
its verifier, its semantics (a store into ONE peer's instance), the checker against the
brute force (tests/support/hb_oracle.py) and the execution oracle on random shift schedules,
its float64 reference, the access tracer, and runs on the host and torch backends."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import checker_covers, disagreements
from support.hb_oracle import oracle_keys, oracle_unwritten, random_shift_schedule_text
from support.schedules import run_clean, shift_head

from dcpc.check import hb, structural
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import simulate
from dcpc.harness import trace as tr
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld, torus
from dcpc.lang.parse import parse_file, parse_text
from dcpc.lang.semantics import Region, semantics

HERE = Path(__file__).parents[1] / "shift"
PASS, SPLIT, FAR = HERE / "pass_credit.yaml", HERE / "split.yaml", HERE / "far.yaml"


def _errors(text: str) -> list:
    schedule = parse_text(text, "s.yaml")
    return [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]


def _keys(text: str, world: int) -> set:
    return {f.key for f in hb.check(parse_text(text), [world], hints=False).findings}


HEAD = shift_head("e: {shape: [N, D], dtype: f32}",
                  "b: {shape: [N, 3], dtype: f32, symmetric: true}")


# --- the verifier -------------------------------------------------------------------

@pytest.mark.parametrize("step,code,at,words", [
    ("  - hop: {op: shift, src: x, dst: y, offset: 0}\n", "bad-offset", "0}",
     "an offset is a nonzero integer"),
    ("  - hop: {op: shift, src: x, dst: y, offset: -2147483648}\n", "bad-offset", "-2147483648}",
     "at most 2147483647 ranks"),
    ("  - hop: {op: shift, src: x, dst: e}\n", "not-symmetric", "e}", "engine-owned"),
    ("  - hop: {op: shift, src: x, dst: b}\n", "shape-mismatch", "b}", "the shift of src 'x'"),
    ("  - hop: {op: shift, src: x, dst: y, phase: wait}\n", "unmatched-wait", "wait}",
     "no 'phase: put' step"),
    ("  - hop: {op: shift, src: x, dst: y, phase: put}\n", "unmatched-put", "put}",
     "no 'phase: wait' step"),
])
def test_bad_shifts_are_located_errors(step: str, code: str, at: str, words: str) -> None:
    found = _errors(HEAD + step)
    assert [d.code for d in found] == [code], found
    col = step.index(at) + 1  # the value the error is about (columns count from 1)
    assert (found[0].mark.file, found[0].mark.line, found[0].mark.col) == ("s.yaml", 10, col)
    assert words in found[0].message


def test_a_wait_of_another_offset_is_not_the_puts() -> None:
    text = HEAD + ("  - send: {op: shift, src: x, dst: y, phase: put}\n"
                   "  - recv: {op: shift, src: x, dst: y, offset: prev, phase: wait}\n")
    assert sorted(d.code for d in _errors(text)) == ["unmatched-put", "unmatched-wait"]


# --- the semantics: one peer's instance, whole ---------------------------------------

def test_the_semantics_store_into_the_offset_peer_only() -> None:
    schedule = parse_file(SPLIT)
    steps = {s.name: s for s in schedule.step_list()}
    put, wait = semantics(schedule, steps["send"]), semantics(schedule, steps["recv"])
    store = [e for e in put.effects if e.kind == "write"]
    assert [(e.buffer, e.when, e.region) for e in store] == [
        ("y", "before", Region("peer", 0, offset=-1))]
    assert (put.sync.signal, put.sync.wait) == ("prev", None)
    assert (wait.effects, wait.sync.wait, wait.sync.polls) == ((), "next", steps["send"].index)
    assert Region("peer", 0, offset=-1).writers(0, 5) == [1]


HOP_HOP = ("race", "write-after-write", "y", "hop", "hop")
# the engine reads what hop returns, at its return: the next call's push may land first
HOP_RETURN = ("race", "write-after-read", "y", "hop", "hop")
NO_CREDIT = HEAD + ("  - hop: {op: shift, src: x, dst: y}\n"
                    "  - use: {op: external, reads: [y], writes: [z]}\n")


@pytest.mark.parametrize("world", [2, 3, 5])
def test_a_ring_pass_without_credit_races_and_with_it_is_proved(world: int) -> None:
    # the next call's push can overwrite y before use reads it, and before this call's
    # hop (its wait) has even returned it: y is in flight from the push to the wait
    race = {("race", "write-after-read", "y", "use", "hop"), HOP_HOP, HOP_RETURN}
    assert _keys(NO_CREDIT, world) == race == oracle_keys(parse_text(NO_CREDIT), world)
    # the credit goes to the ONE writer of y (prev): a model that let the shift write
    # every rank's y would call this a race at W >= 3 (rank r + 2 is not credited)
    credit = NO_CREDIT + ("  - free: {op: signal, to: prev, channel: f}\n"
                          "  - freed: {op: wait, from: next, channel: f}\n")
    assert _keys(credit, world) == set() == oracle_keys(parse_text(credit), world)
    wrong_side = NO_CREDIT + ("  - free: {op: signal, to: next, channel: f}\n"
                              "  - freed: {op: wait, from: prev, channel: f}\n")
    assert _keys(wrong_side, world) == (race if world > 2 else set())
    assert oracle_keys(parse_text(wrong_side), world) == _keys(wrong_side, world)


def test_a_far_offset_counts_its_ranks_in_the_world_bound() -> None:
    """A shift by 3 with a credit back: each call's wait moves a chain 3 ranks, so the
    bound grows 3 times as fast as for next/prev (hb-checker.md, world bound)."""
    from dcpc.check.hb.checker import world_bound
    from dcpc.check.hb.events import lower

    def bound(offset: str) -> int:
        text = NO_CREDIT.replace("dst: y}", f"dst: y, offset: {offset}}}")
        return world_bound(lower(parse_text(text)))

    assert (bound("next"), bound("3"), bound("-5")) == (8, 15, 23)


@pytest.mark.parametrize("world", [2, 3, 4, 6, 7])
def test_a_far_offset_wraps_mod_w(world: int) -> None:
    """offset 2 at W=2 is a local copy (no signal: the use still races with the next
    call's copy only if... never: same rank, program order); at W=4 +2 and -2 meet."""
    text = NO_CREDIT.replace("dst: y}", "dst: y, offset: 2}")
    keys = _keys(text, world)
    assert keys == oracle_keys(parse_text(text), world)
    assert keys == (set() if world == 2 else {("race", "write-after-read", "y", "use", "hop"),
                                              HOP_HOP, HOP_RETURN})
    credit = text + ("  - free: {op: signal, to: next, channel: f}\n"
                     "  - freed: {op: wait, from: prev, channel: f}\n")
    # the credit goes to rank r + 1, but y's writer is rank r - 2: proved only where they
    # coincide (W = 3) or where the shift is local (W = 2)
    want = set() if world in (2, 3) else {("race", "write-after-read", "y", "use", "hop"),
                                          HOP_HOP, HOP_RETURN}
    assert _keys(credit, world) == want == oracle_keys(parse_text(credit), world)


def _by_world(schedule, worlds, every: bool) -> dict:
    return {f.key: f.world for f in hb.check(schedule, worlds, hints=False,
                                             every_world=every).findings}


@pytest.mark.parametrize("offset", ["3", "-5", "next"])
def test_the_world_bound_finds_what_every_w_finds_for_far_offsets(offset: str) -> None:
    text = NO_CREDIT.replace("dst: y}", f"dst: y, offset: {offset}}}") + (
        "  - free: {op: signal, to: prev, channel: f}\n"
        "  - freed: {op: wait, from: next, channel: f}\n")
    schedule = parse_text(text)
    found = _by_world(schedule, range(2, 50), every=False)
    assert found == _by_world(schedule, range(2, 50), every=True)
    assert bool(found) == (offset != "next")  # the credit reaches the writer only for +1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_world_bound_finds_what_every_w_finds_on_random_shift_schedules(
        data: st.DataObject) -> None:
    schedule = parse_text(random_shift_schedule_text(data.draw, st))
    assert _by_world(schedule, range(2, 40), every=False) == \
        _by_world(schedule, range(2, 40), every=True)


def test_the_shipped_examples_check_clean_over_a_range() -> None:
    for path in (PASS, SPLIT, FAR):
        report = hb.check(parse_file(path), range(2, 17))
        assert report.findings == [], path


# --- the checker against the brute force and the execution oracle --------------------

@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_brute_force_agree_on_random_shift_schedules(data: st.DataObject) -> None:
    text = random_shift_schedule_text(data.draw, st)
    schedule = parse_text(text)
    errors = [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]
    assert errors == [], text  # the generator only makes structurally valid schedules
    for world in (2, 3, 4):
        report = hb.check(schedule, [world], hints=False)
        assert {f.key for f in report.findings} == oracle_keys(schedule, world), (text, world)
        assert oracle_unwritten(schedule, world) == set(), (text, world)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_execution_oracle_agree_on_random_shift_schedules(
        data: st.DataObject) -> None:
    text = random_shift_schedule_text(data.draw, st)
    assert disagreements(parse_text(text), [2, 3, 4]) == [], text


# --- the float64 reference -----------------------------------------------------------

@pytest.mark.parametrize("path,k", [(PASS, 1), (SPLIT, -1)])
def test_the_reference_moves_src_to_the_offset_rank(path: Path, k: int) -> None:
    schedule, world = parse_file(path), 3
    gen = torch.Generator().manual_seed(7)
    inputs = [{n: simulate.as_stored(schedule, n, torch.randn(5, 48, generator=gen,
                                                              dtype=torch.float64))
               for n in ("x", "w") if n in schedule.buffers} for _ in range(world)]
    trace: list = []
    out = simulate.simulate_call(schedule, world, {"N": 5, "D": 48}, inputs,
                                 lambda step, rank, bufs: {n: bufs["x"] * 0 + rank
                                                           for n in step.op.writes},
                                 trace=trace)
    wrote = [s.index for s in schedule.step_list() if "y" in trace[s.index][0]]
    assert wrote == [2 if k < 0 else 0]  # the split shift's data lands at its wait
    for r in range(world):
        assert torch.equal(out[(r + k) % world]["y"], inputs[r]["x"])


# --- the kernels: every access where the plan says, outputs against float64 ----------

@pytest.mark.parametrize("path,world", [(PASS, 3), (SPLIT, 3), (FAR, 4), (FAR, 2)],
                         ids=["pass-3", "split-3", "far-4", "far-local-2"])
def test_traced_kernels_store_into_the_offset_peer_only(path: Path, world: int) -> None:
    run = tr.run_traced(str(path), world, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems
    assert max(run.trace.programs.values()) > 1, run.trace.programs  # several programs ran
    if world > 2:  # the tracer's peer check has teeth: a plan naming another target fails
        step = next(s for s in run.plan.steps if s.op == "shift" and s.sync.signal)
        def flipped(e):  # the store said to go the other way round the ring
            if e.region is None:
                return e
            return dataclasses.replace(e, region=dataclasses.replace(
                e.region, offset=-e.region.offset))

        plan = dataclasses.replace(run.plan, steps=[
            dataclasses.replace(s, effects=[flipped(e) for e in s.effects]) if s is step else s
            for s in run.plan.steps])
        problems = tr.check(run.trace, plan, world)
        assert any("writes 'y' of rank" in p and "outside rank" in p for p in problems), problems


@pytest.mark.e2e
@pytest.mark.parametrize("path,world,backend", [(SPLIT, 3, "host"), (SPLIT, 2, "torch")],
                         ids=["split-host-3", "split-torch-2"])
def test_dcpc_run_matches_float64(path: Path, world: int, backend: str) -> None:
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=4, seed=3)
    assert report.outputs["y"].compared == 4 * world, text


# --- issue 31 F1: a put's dst is in flight from the put to its wait --------------------
# The language (and the float64 reference) lands a split-phase shift's data at its
# `phase: wait`; the kernel stores at the put. Whatever touches the put's dst in between,
# on any rank, is refused, also when a barrier or a credit orders it after the store.

FLIGHT = """\
schedule: flight
sizes: {N: 4, D: 2}
buffers:
  a: {shape: [N, D], dtype: f32}
  b: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32, symmetric: true}
  z: {shape: [N, D], dtype: f32}
steps:
"""
REVERSED = FLIGHT + """\
  - put_a: {op: shift, src: a, dst: y, phase: put}
  - put_b: {op: shift, src: b, dst: y, phase: put}
  - wait_b: {op: shift, src: b, dst: y, phase: wait}
  - wait_a: {op: shift, src: a, dst: y, phase: wait}
  - use: {op: external, reads: [y], writes: [z]}
  - done: {op: barrier}
"""
# between the put and its wait, ordered after the store by a barrier or a credit
ORDER = {"barrier": "  - order: {op: barrier}\n",
         "credit": "  - order: {op: signal, to: next, channel: c}\n"
                   "  - ordered: {op: wait, from: prev, channel: c}\n"}


def _between(access: str, order: str, fill: bool = True) -> str:
    body = "  - fill: {op: external, reads: [a], writes: [y]}\n  - sync: {op: barrier}\n" \
        if fill else ""
    body += "  - put: {op: shift, src: a, dst: y, phase: put}\n" + ORDER[order]
    body += {"read": "  - peek: {op: external, reads: [y], writes: [z]}\n",
             "write": "  - peek: {op: external, reads: [b], writes: [y]}\n"}[access]
    body += ("  - land: {op: shift, src: a, dst: y, phase: wait}\n"
             "  - use: {op: external, reads: [y], writes: [z]}\n  - done: {op: barrier}\n")
    return FLIGHT + body


def _refused(tmp_path: Path, text: str) -> list:
    """What `dcpc check --world 2..16` says of ``text`` (it must refuse it)."""
    from dcpc import pipeline
    from dcpc.diagnostics import DiagnosticError

    path = tmp_path / "flight.yaml"
    path.write_text(text)
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=range(2, 17)), until="hb")
    errors = [d for d in err.value.diagnostics if d.severity == "error"]
    assert all(d.mark.file == str(path) for d in errors)
    return errors


def _line(text: str, step: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if f"- {step}:" in line)


def test_two_puts_whose_waits_land_the_other_way_round_are_refused(tmp_path: Path) -> None:
    """F1: put_a then put_b into one dst, their waits in the other order: the kernel
    leaves b in y, the data flow (and the reference) a. Was: ok for W 2..16."""
    returned, diag = _refused(tmp_path, REVERSED)  # wait_b returns y: the engine's read
    assert returned.code == "race", returned.message
    assert "write-after-read race on y: the engine can read what wait_b" in returned.message
    assert diag.code == "race" and "write-after-write race on y" in diag.message
    for name in ("put_a", "put_b", "wait_a", "wait_b"):
        assert name in diag.message, diag.message
    assert (diag.mark.line, diag.mark.col) == (_line(REVERSED, "put_a"), 5)
    assert diag.hint is not None and "move put_a after wait_b with a barrier" in diag.hint, \
        diag.hint
    for world in (2, 3, 5):
        keys = _keys(REVERSED, world)
        assert keys == {("race", "write-after-write", "y", "put_b", "put_a"),
                        ("race", "write-after-read", "y", "wait_b", "put_a")}  # its return
        assert keys == oracle_keys(parse_text(REVERSED), world)
    (found,) = [f for f in hb.check(parse_text(REVERSED), [3], hints=False).as_json()["findings"]
                if f["kind"] == "race" and "write-after-write" in f["message"]]
    assert (found["first"]["lands"], found["second"]["lands"]) == ("wait_b", "wait_a")


@pytest.mark.parametrize("access", ["read", "write"])
@pytest.mark.parametrize("order", ["barrier", "credit"])
def test_an_access_to_a_dst_in_flight_is_refused_even_when_ordered(
        tmp_path: Path, access: str, order: str) -> None:
    """F1 variants: a read or a local write of the put's dst between the put and its
    wait, with a barrier or a signal/wait between the put and it (the store happens
    before it, the data flow lands it after). Was: ok."""
    text = _between(access, order)
    (diag,) = _refused(tmp_path, text)
    cls = "write-after-read" if access == "read" else "write-after-write"
    assert diag.code == "race" and f"{cls} race on y" in diag.message, diag.message
    assert "peek" in diag.message and "put" in diag.message and "land" in diag.message
    # the fix: the access before the barrier that orders the push after the fill
    assert diag.hint is not None and "move peek before sync" in diag.hint, diag.hint
    for world in (2, 3, 4):
        keys = _keys(text, world)
        assert keys == {("race", cls, "y", "peek", "put")}, keys
        assert keys == oracle_keys(parse_text(text), world)


def test_a_read_of_a_dst_in_flight_that_nothing_wrote_before_is_read_before_write(
        tmp_path: Path) -> None:
    """The data flow lands the put's data at the wait: a read before it reads what no
    step of the call wrote (was: ok with the barrier)."""
    text = _between("read", "barrier", fill=False)
    (diag,) = _refused(tmp_path, text)
    assert diag.code == "read-before-write", diag
    assert "'peek'" in diag.message and "'land'" in diag.message, diag.message
    assert diag.mark.line == _line(text, "peek")
    assert diag.hint is not None and "land" in diag.hint
    for world in (2, 3):  # the brute force: no write reaches the read on any rank
        assert oracle_unwritten(parse_text(text), world) == {
            ("read-before-write", "", "y", "peek", "")}


def test_two_puts_in_flight_at_once_are_refused_and_one_at_a_time_is_proved() -> None:
    """With the waits in put order the second push still lands in y before the first
    wait returns it (dcpc run: 6 mismatches at W=3): refused. One push in flight at a
    time (the second after the first's wait and a barrier) and a read after the wait
    are proved."""
    in_order = REVERSED.replace("  - wait_b: {op: shift, src: b, dst: y, phase: wait}\n", "")
    in_order = in_order.replace("  - use:", "  - wait_b: {op: shift, src: b, dst: y, phase: wait}\n"
                                "  - use:")
    one_at_a_time = REVERSED.replace(
        "  - put_b: {op: shift, src: b, dst: y, phase: put}\n"
        "  - wait_b: {op: shift, src: b, dst: y, phase: wait}\n", "").replace(
        "  - put_a:", "  - put_b: {op: shift, src: b, dst: y, phase: put}\n"
        "  - wait_b: {op: shift, src: b, dst: y, phase: wait}\n  - landed: {op: barrier}\n"
        "  - put_a:")
    after = _between("read", "barrier").replace(
        "  - peek: {op: external, reads: [y], writes: [z]}\n", "").replace(
        "  - use:", "  - peek: {op: external, reads: [y], writes: [z]}\n  - use:")
    for world in (2, 3, 4):
        want = {("race", "write-after-write", "y", "put_a", "put_b"),
                ("race", "write-after-read", "y", "wait_a", "put_b")}  # wait_a returns y
        assert _keys(in_order, world) == want == oracle_keys(parse_text(in_order), world)
        for text in (one_at_a_time, after):
            assert _keys(text, world) == set() == oracle_keys(parse_text(text), world)


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["shift_puts_land_reversed", "shift_read_in_flight"])
def test_dcpc_run_agrees_with_the_verdicts_on_stores_in_flight(name: str) -> None:
    """The model against the kernels: each refused corpus case gives wrong data when run
    (the push is ordered before the wrong access), its fixed twin none."""
    corpus = Path(__file__).parents[1] / "hb_corpus"
    for twin, bad in ((f"{name}.yaml", True), (f"{name}.fixed.yaml", False)):
        report = run_schedule(RunConfig(schedule=str(corpus / twin), world=3, calls=3,
                                        seed=5))
        text = format_report(report)
        assert report.launch.ok, text
        assert (report.mismatches > 0) == bad, text


def test_two_whole_shifts_into_one_dst_are_refused_unless_the_first_has_landed() -> None:
    """The same for whole shifts: the second push can land in y before the first hop
    has returned it on the receiver (was: ok; dcpc run --world 3 showed 2 to 3
    mismatches of hop1's output per 4 calls). A barrier between them proves it."""
    text = FLIGHT + ("  - hop1: {op: shift, src: a, dst: y}\n"
                     "  - hop2: {op: shift, src: b, dst: y}\n"
                     "  - use: {op: external, reads: [y], writes: [z]}\n"
                     "  - done: {op: barrier}\n")
    fixed = text.replace("  - hop2:", "  - landed: {op: barrier}\n  - hop2:")
    for world in (2, 3, 4):
        keys = _keys(text, world)
        assert ("race", "write-after-write", "y", "hop1", "hop2") in keys, keys
        assert keys == oracle_keys(parse_text(text), world)
        assert _keys(fixed, world) == set() == oracle_keys(parse_text(fixed), world)
    assert disagreements(parse_text(text), [2, 3]) == []


# --- offset expressions: W and the hop index, evaluated when the file is unrolled ------
# (dcpc/lang/loops.py): `offset: W / 2` is the double ring's half-ring hop, one file for
# every even W; every later stage sees the integer.

HALF = HERE / "half_ring.yaml"


def test_a_half_ring_offset_checks_clean_at_every_even_w() -> None:
    from dcpc import pipeline

    c = pipeline.run(HALF, pipeline.Options(worlds=[2, 4, 6, 8]), until="hb")
    assert c.per_world == [2, 4, 6, 8]  # one unrolled schedule per W
    for world in (2, 4, 6, 8):
        steps = parse_file(HALF, world=world).step_list()
        assert [s.op.offset for s in steps if s.op.op == "shift"] == [world // 2] * 2


def test_a_half_ring_offset_at_an_odd_w_is_a_located_inexact_division() -> None:
    from dcpc import pipeline
    from dcpc.diagnostics import DiagnosticError

    with pytest.raises(DiagnosticError) as err:
        pipeline.run(HALF, pipeline.Options(worlds=range(2, 9)), until="hb")
    text = HALF.read_text()
    lines = text.splitlines()
    found = sorted(err.value.diagnostics, key=lambda d: (d.mark.line, d.message))
    # every W it fails at is named, not the first alone (each W is parsed on its own)
    assert [(d.code, d.mark.line) for d in found] == [("bad-offset", 12)] * 3 + [
        ("bad-offset", 13)] * 3
    for d, w in zip(found, [3, 5, 7] * 2, strict=True):
        assert d.mark.file == str(HALF)
        assert d.mark.col == lines[d.mark.line - 1].index("W / 2") + 1
        assert f"(at W={w})" in d.message and "not a whole number" in d.message, d.message


def test_a_half_ring_module_holds_a_class_per_w() -> None:
    from dcpc import pipeline

    both = pipeline.run(HALF, pipeline.Options(worlds=[2, 4])).module_text
    assert "    LOOP_WORLD = 2\n" in both and "    LOOP_WORLD = 4\n" in both
    text = pipeline.run(HALF, pipeline.Options(worlds=[4])).module_text
    assert "LOOP_WORLD = 4" in text and "LOOP_WORLDS" not in text


@pytest.mark.e2e
def test_dcpc_run_of_a_half_ring_offset_matches_float64() -> None:
    report, text = run_clean(schedule=str(HALF), world=4, backend="host", calls=4, seed=3)
    assert report.outputs["y"].compared == 4 * 4, text


LOOPED = HEAD.replace("steps:\n", """\
  r: {shape: [3, N, D], dtype: f32, symmetric: true}
steps:
""")


def test_a_hop_index_offset_unrolls_to_the_integers_written_out() -> None:
    looped = LOOPED + """\
  - ring:
      repeat: 3
      as: h
      steps:
        - put: {op: shift, src: x, dst: "r[h]", offset: h + 1, phase: put}
        - get: {op: shift, src: x, dst: "r[h]", offset: 2 * h - 5, phase: wait}
"""
    written = LOOPED + "".join(
        f"  - put_h{h}: {{op: shift, src: x, dst: \"r[{h}]\", offset: {h + 1}, phase: put}}\n"
        f"  - get_h{h}: {{op: shift, src: x, dst: \"r[{h}]\", offset: {2 * h - 5}, "
        "phase: wait}\n" for h in range(3))

    def offsets(text: str) -> list:
        return [(s.name, s.op.offset) for s in parse_text(text, "s.yaml").step_list()]

    assert offsets(looped) == offsets(written) == [
        ("put_h0", 1), ("get_h0", -5), ("put_h1", 2), ("get_h1", -3), ("put_h2", 3),
        ("get_h2", -1)]


@pytest.mark.parametrize("offset,world,code,words", [
    ("W / 2", 3, "bad-offset", "'W / 2' (at W=3): W/2 is 3/2, which is not a whole number"),
    ("W", 4, "bad-offset", "'W' = 4 (at W=4), which sends every rank's data to itself "
                           "(a multiple of W=4)"),
    ("3 * W / 2 + W / 2", 2, "bad-offset", "= 4 (at W=2), which sends every rank's data"),
    ("2 - 2", None, "bad-offset", "'2 - 2' = 0, which sends every rank's data to itself"),
    ("h + 1", 4, "bad-offset", "names 'h': not the hop index of an enclosing loop"),
    ("nxt", 4, "bad-offset", "names 'nxt'"),
    ("W +", 4, "bad-offset", "'W +' (at W=4): expected a number"),
    # a leading minus is one minus before a name, a number or '(' (not two, not alone)
    ('"--"', None, "bad-offset", "'--': expected a number, a size name or '(', found '-'"),
    ('"- -D"', None, "bad-offset", "'- -D': expected a number, a size name or '(', found '-'"),
    ('"-"', None, "bad-offset", "'-': expected a number, a size name or '(', found end"),
    ("W * -D", 4, "bad-offset", "found '-'"),
    ("-(W / 2)", 3, "bad-offset", "W/2 is 3/2, which is not a whole number"),
    ("W / 2", None, "loop-world", "names W; a schedule that depends on W is unrolled"),
])
def test_bad_offset_expressions_are_located_errors(offset: str, world: int | None, code: str,
                                                   words: str) -> None:
    from dcpc.diagnostics import DiagnosticError

    step = f"  - hop: {{op: shift, src: x, dst: y, offset: {offset}}}\n"
    with pytest.raises(DiagnosticError) as err:
        parse_text(HEAD + step, "s.yaml", world=world)
    found = err.value.diagnostics
    assert [d.code for d in found] == [code], found
    where = (found[0].mark.file, found[0].mark.line, found[0].mark.col)
    assert where == ("s.yaml", 10, step.index("offset: ") + len("offset: ") + 1)
    assert words in found[0].message, found[0].message
    if offset == "nxt":
        assert found[0].hint == "did you mean 'next'?"


def test_a_leading_minus_negates_an_offset_as_zero_minus_it_does() -> None:
    """``offset: -D`` (a shift's, a signal's, a wait's) is ``0 - D``: a leading minus
    before a name or a parenthesis, Python's precedence (-a * b is (-a) * b)."""
    for offset, want in [("-D", -2), ("-(W / 2)", -2), ("-D * 3 + 1", -5), ("-1", -1),
                         ('"-(D + 1)"', -3)]:
        both = [f"  - {n}: {{op: shift, src: x, dst: y, offset: {o}}}\n"
                for n, o in (("a", offset), ("b", "0 - D" if offset == "-D" else want))]
        steps = parse_text(HEAD + "".join(both), "s.yaml", world=4).step_list()
        assert [s.op.offset for s in steps] == [want, want], offset
    sync = ("  - tell: {op: signal, channel: c, offset: -D}\n"
            "  - hear: {op: wait, channel: c, offset: -(D - 1)}\n")
    steps = parse_text(HEAD + sync, "s.yaml", world=4).step_list()
    assert [s.op.offset for s in steps] == [-2, -1]


def test_a_zero_offset_at_one_hop_names_the_hop() -> None:
    from dcpc.diagnostics import DiagnosticError

    text = LOOPED + """\
  - ring:
      repeat: 3
      as: h
      steps:
        - hop: {op: shift, src: x, dst: "r[h]", offset: h - 1}
"""
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml")
    (d,) = err.value.diagnostics
    assert (d.code, d.mark.line) == ("bad-offset", 15)
    assert "step 'hop' shifts by offset 'h - 1' = 0 (at h=1)" in d.message, d.message


# --- wrap: false, the non-cyclic shift (issue 33): the pipeline stage hand-off ---------
# Rank r stores into rank r + k only when 0 <= r + k < W; a rank whose r - k is not a
# rank receives nothing (dst kept) and does not wait. The checker models every rank alike
# (a "line" wait orders nothing, its dependency still counts): sound, so every race the
# brute force (which models the edges exactly) finds, the checker reports.

ROOT = Path(__file__).parents[2]
NOWRAP = ROOT / "schedules" / "ops" / "shift_nowrap.yaml"
SPLIT_NOWRAP = HERE / "split_nowrap.yaml"
HAND_OFF = NOWRAP.read_text()
NOWRAP_NO_CREDIT = HAND_OFF.split("  - credit:")[0]  # the receiver never frees recv
NOWRAP_IN_FLIGHT = (  # a stage re-writes recv while the hand-off into it is in flight
    HAND_OFF.replace("wrap: false}", "wrap: false, phase: put}")
    .replace("  - credit:", "  - poke:   {op: external, reads: [x], writes: [recv]}\n"
             "  - land:   {op: shift, src: act, dst: recv, offset: next, wrap: false, "
             "phase: wait}\n  - credit:"))


def test_a_nowrap_shift_stores_on_the_line_only() -> None:
    schedule = parse_text(HAND_OFF)
    hand = next(s for s in schedule.step_list() if s.name == "hand")
    sem = semantics(schedule, hand)
    (store,) = [e for e in sem.effects if e.kind == "write"]
    assert store.region == Region("line", 0, offset=1) and not store.region.covers_all
    assert (sem.sync.signal, sem.sync.wait) == ("line+1", "line-1")
    gen = torch.Generator().manual_seed(5)
    world = 4
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(3, 40, generator=gen,
                                                                  dtype=torch.float64))}
              for _ in range(world)]
    trace: list = []
    out = simulate.simulate_call(schedule, world, {"N": 3, "D": 40}, inputs,
                                 lambda step, rank, bufs: {"act": bufs["x"] * 0 + rank + 1},
                                 trace=trace)
    assert "recv" not in out[0]  # stage 0 receives nothing: its recv is left as it was
    for r in range(1, world):
        assert torch.equal(out[r]["recv"], torch.full((3, 40), float(r), dtype=torch.float64))


@pytest.mark.parametrize("path", [NOWRAP, SPLIT_NOWRAP], ids=["hand-off", "split"])
def test_nowrap_shifts_check_clean_for_every_w(path: Path) -> None:
    report = hb.check(parse_file(path), range(2, 9))
    assert report.findings == [], [f.key for f in report.findings]
    schedule = parse_file(path)
    for world in (2, 3, 4, 5):
        assert oracle_keys(schedule, world) == set(), world
        assert disagreements(schedule, [world]) == [], world


def test_a_nowrap_hand_off_without_credit_races() -> None:
    race = ("race", "write-after-write", "recv", "hand", "hand")
    for world in (2, 3, 4):
        assert race in _keys(NOWRAP_NO_CREDIT, world)
        assert race in oracle_keys(parse_text(NOWRAP_NO_CREDIT), world)


def test_a_nowrap_dst_rewritten_in_flight_is_refused() -> None:
    # the data flow lands hand's store at 'land', after 'poke': poke is the first
    race = ("race", "write-after-write", "recv", "poke", "hand")
    for world in (2, 3, 4):
        assert race in _keys(NOWRAP_IN_FLIGHT, world)
        assert race in oracle_keys(parse_text(NOWRAP_IN_FLIGHT), world)


def test_dcpc_check_refuses_the_nowrap_twins_with_their_class(tmp_path: Path) -> None:
    for name, text in (("no_credit", NOWRAP_NO_CREDIT), ("in_flight", NOWRAP_IN_FLIGHT)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "dcpc", "check", str(path),
                               "--world", "2..8"], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "write-after-write" in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_read_of_a_nowrap_dst_is_read_before_write() -> None:
    """Stage 0's recv is never written: a read of it on every rank reads nothing."""
    text = HAND_OFF.replace("  - credit:", "  - use:    {op: external, reads: [recv], "
                            "writes: [act]}\n  - credit:")
    found = _errors(text)
    assert [d.code for d in found] == ["read-before-write"], found
    assert ("read-before-write", "", "recv", "use", "") in oracle_unwritten(parse_text(text), 3)


@pytest.mark.parametrize("value,words", [("3", "not an integer"), ('"no"', "not a string"),
                                         ("[false]", "not a list")])
def test_a_bad_wrap_is_a_located_error(value: str, words: str) -> None:
    step = f"  - hop: {{op: shift, src: x, dst: y, wrap: {value}}}\n"
    with pytest.raises(DiagnosticError) as err:
        _errors(HEAD + step)
    (d,) = err.value.diagnostics
    assert (d.mark.file, d.mark.line, d.mark.col) == ("s.yaml", 10, step.index(value) + 1)
    assert "must be true or false" in d.message and words in d.message


def test_a_nowrap_wait_does_not_poll_a_cyclic_put() -> None:
    text = HEAD + ("  - send: {op: shift, src: x, dst: y, phase: put}\n"
                   "  - recv: {op: shift, src: x, dst: y, wrap: false, phase: wait}\n")
    assert sorted(d.code for d in _errors(text)) == ["unmatched-put", "unmatched-wait"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_checker_finds_every_race_the_brute_force_finds_without_wrap(
        data: st.DataObject) -> None:
    text = random_shift_schedule_text(data.draw, st, nowrap=True)
    for world in (2, 3, 4):
        checker_covers(text, world, executed=False)


@pytest.mark.parametrize("path,world", [(NOWRAP, 3), (SPLIT_NOWRAP, 3), (SPLIT_NOWRAP, 2)],
                         ids=["hand-off-3", "split-3", "split-2"])
def test_traced_nowrap_kernels_store_on_the_line_only(path: Path, world: int) -> None:
    run = tr.run_traced(str(path), world, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


# shift_nowrap.yaml on the host backend: tests/ops/test_op_schedules.py (W = 2, 3, 4, every
# rank of every call compared or kept); which rank is kept is the float64 reference's,
# the same on every backend (the torch case).
@pytest.mark.e2e
@pytest.mark.parametrize("path,world,backend", [
    (NOWRAP, 3, "torch"), (SPLIT_NOWRAP, 3, "host"), (SPLIT_NOWRAP, 2, "torch")])
def test_dcpc_run_of_a_nowrap_shift_matches_float64(path: Path, world: int,
                                                    backend: str) -> None:
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=4, seed=3)
    out = "recv" if path == NOWRAP else "y"
    # the rank at the end that receives nothing is not compared; every other rank is
    assert report.outputs[out].compared == 4 * (world - 1), text
    assert report.outputs[out].kept == 4, text


# --- shift along one mesh axis (issue 33 item 1: `axis:`, like ppermute over one axis) --

AXIS = Path(__file__).parents[2] / "schedules" / "ops" / "shift_axis.yaml"
SHAPES = [MeshWorld(s) for s in ((2, 2), (2, 3), (3, 2))]

MESH_HEAD = """\
schedule: m
mesh: {node: N, gpu: G}
sizes: {T: 4, D: 2}
buffers:
  x: {shape: [T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32, symmetric: true}
  z: {shape: [T, D], dtype: f32}
steps:
"""

TWO_AXES_ONE_DST = MESH_HEAD + (  # two pushes along different axes in flight into y
    "  - along_gpu:  {op: shift, axis: gpu, src: x, dst: y, offset: next, phase: put}\n"
    "  - along_node: {op: shift, axis: node, src: x, dst: y, offset: next, phase: put}\n"
    "  - land_gpu:   {op: shift, axis: gpu, src: x, dst: y, offset: next, phase: wait}\n"
    "  - land_node:  {op: shift, axis: node, src: x, dst: y, offset: next, phase: wait}\n"
    "  - use:        {op: external, reads: [y], writes: [z]}\n"
    "  - done:       {op: barrier}\n")
# the gpu ring's receive buffer without its credit: the next call's push meets the read
NO_GPU_CREDIT = "".join(line + "\n" for line in AXIS.read_text().splitlines()
                        if "free_g" not in line)


def test_a_shift_along_an_axis_moves_within_its_team() -> None:
    """Rank (n, g) pushes into (n, g + k mod G) along gpu, (n + k mod N, g) along node:
    its region and sync carry the team's axis, the peer is Torus.peer's, and the
    float64 reference (run per team) lands each member's src in the next one's dst."""
    schedule = parse_file(AXIS)
    steps = {s.name: s for s in schedule.step_list()}
    ring = semantics(schedule, steps["ring"])
    (store,) = [e for e in ring.effects if e.kind == "write"]
    assert store.region == Region("peer", 0, offset=1, axes=(1,))
    assert (ring.sync.signal, ring.sync.wait, ring.sync.axes) == ("next", "prev", (1,))
    t = torus((2, 3))
    assert [t.peer(r, (1,), 1) for r in range(6)] == [1, 2, 0, 4, 5, 3]
    assert [t.peer(r, (0,), -1) for r in range(6)] == [3, 4, 5, 0, 1, 2]
    assert [t.peer(r, (1,), 1, wrap=False) for r in range(6)] == [1, 2, None, 4, 5, None]
    assert store.region.writers(5, MeshWorld((2, 3))) == [4]  # (1, 2) <- (1, 1)
    world, gen = MeshWorld((2, 3)), torch.Generator().manual_seed(7)
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(
        3, 40, generator=gen, dtype=torch.float64)), "w": torch.zeros(3, 40,
                                                                      dtype=torch.float64)}
              for _ in range(6)]
    out = simulate.simulate_call(schedule, world, {"N": 2, "G": 3, "T": 3, "D": 40}, inputs,
                                 lambda step, rank, bufs: {"o": bufs["x"] * 0 + rank,
                                                           "z": bufs["x"]})
    for r in range(6):
        n, g = divmod(r, 3)
        assert torch.equal(out[r]["y_gpu"], inputs[n * 3 + (g - 1) % 3]["x"]), r
        assert torch.equal(out[r]["y_node"], inputs[((n + 1) % 2) * 3 + g]["x"]), r
        if g == 0:  # wrap: false: gpu 0 has no source, its y_line is left as it was
            assert "y_line" not in out[r]
        else:
            assert torch.equal(out[r]["y_line"], torch.full((3, 40), float(r - 1),
                                                            dtype=torch.float64)), r


def test_the_shift_axis_record_is_proved_and_the_oracles_agree() -> None:
    schedule = parse_file(AXIS)
    report = hb.check(schedule, SHAPES)
    assert report.findings == [], [f.key for f in report.findings]
    for world in SHAPES:
        assert oracle_keys(schedule, world) == set(), world
    assert disagreements(schedule, SHAPES[:2]) == []


@pytest.mark.parametrize("text,race", [
    (NO_GPU_CREDIT, ("race", "write-after-read", "y_gpu", "use", "ring")),
    (TWO_AXES_ONE_DST, ("race", "write-after-write", "y", "along_gpu", "along_node")),
], ids=["no-gpu-credit", "two-axes-one-dst"])
def test_the_wrong_twins_of_a_shift_along_an_axis_race(text: str, race: tuple) -> None:
    schedule = parse_text(text)
    # well formed (shifts along one axis are the language's), wrong only in their order
    assert [d for d in structural.check(schedule, SHAPES) if d.severity == "error"] == []
    for world in SHAPES:
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert race in found, (world, found)
        assert race in oracle_keys(schedule, world), world


def test_dcpc_check_refuses_the_axis_twins_with_their_class(tmp_path: Path) -> None:
    for name, text, cls in (("no_credit", NO_GPU_CREDIT, "write-after-read race on y_gpu"),
                            ("two_axes", TWO_AXES_ONE_DST, "write-after-write race on y")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        proc = subprocess.run([sys.executable, "-m", "dcpc", "check", str(path),
                               "--world", "2x2,2x3,3x2"], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert cls in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("step,code,at,words", [
    ("{op: shift, axis: nosuch, src: x, dst: y}", "unknown-axis", "nosuch",
     "the mesh's axes are node, gpu"),
    ("{op: shift, axis: gpus, src: x, dst: y}", "unknown-axis", "gpus", "did you mean 'gpu'"),
    ("{op: shift, axis: [node, gpu], src: x, dst: y}", "axis-unsupported", "axis",
     "a shift moves along one axis"),
    ("{op: shift, src: x, dst: y}", "axis-unsupported", "{op", "runs over 2 mesh axes"),
])
def test_a_shift_over_no_single_axis_is_a_located_error(step: str, code: str, at: str,
                                                        words: str) -> None:
    line = f"  - hop: {step}\n"
    schedule = parse_text(MESH_HEAD + line + "  - use: {op: external, reads: [y]}\n"
                          "  - done: {op: barrier}\n", "s.yaml")
    found = [d for d in structural.check(schedule, SHAPES) if d.severity == "error"]
    assert [d.code for d in found] == [code], found
    col = line.index(at) + 1 if at != "{op" else 5  # the axis key, or the step's name
    assert (found[0].mark.file, found[0].mark.line, found[0].mark.col) == ("s.yaml", 9, col)
    assert words in found[0].message + (found[0].hint or "")


def test_axis_on_a_shift_without_a_mesh_is_the_unknown_axis_error() -> None:
    """Unchanged by shifts along an axis (a guard: it passed before them too)."""
    found = _errors(HEAD + "  - hop: {op: shift, axis: gpu, src: x, dst: y}\n")
    assert [d.code for d in found] == ["unknown-axis"], found
    assert "declares no 'mesh:'" in found[0].message


def test_w_in_the_offset_of_a_shift_along_an_axis_is_the_team_size() -> None:
    """`offset: W - 1` along gpu is the previous gpu (G - 1), not rank r + N*G - 1."""
    text = MESH_HEAD + ("  - hop: {op: shift, axis: gpu, src: x, dst: y, offset: W - 1}\n"
                        "  - use: {op: external, reads: [y]}\n  - done: {op: barrier}\n")
    for shape, want in (((2, 3), 2), ((3, 2), 1), ((2, 4), 3)):
        schedule = parse_text(text, world=MeshWorld(shape))
        (hop,) = [s for s in schedule.step_list() if s.name == "hop"]
        assert hop.op.offset == want, shape


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch"])  # host: test_op_schedules (2x2 and 2x3)
def test_dcpc_run_of_a_shift_along_an_axis_matches_float64(backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(AXIS), world=MeshWorld((2, 2)),
                                    backend=backend, calls=3, seed=4))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["y_gpu"].compared == 3 * 4, text
    assert report.outputs["y_line"].compared == 3 * 2, text  # gpu 0 receives nothing
