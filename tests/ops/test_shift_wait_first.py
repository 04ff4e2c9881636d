"""A shift's wait written before its put (the pipeline stage's receive, compute, send):
the pairing, the located errors, the checker against the brute force and the execution
oracle (chains proved, rings deadlocked, missing credits raced), the float64 reference
in dependency order, and `dcpc run` on the gallery's pipeline hand-off."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import channel_names
from support.hb_oracle import oracle_keys, oracle_unwritten, random_wait_first_schedule_text

from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_text
from dcpc.ops import shift

ROOT = Path(__file__).resolve().parents[2]
GALLERY = ROOT / "schedules" / "gallery" / "pipeline_handoff.yaml"
TWIN = ROOT / "tests" / "gallery_twins" / "pipeline_handoff.no_credit.yaml"

HEAD = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  act: {shape: [N, D], dtype: f32}
  out: {shape: [N, D], dtype: f32}
  recv: {shape: [N, D], dtype: f32, symmetric: true}
steps:
"""

# a stage: receive from the previous one, compute, send to the next; the credit frees
# recv for the next call's put
STAGE = HEAD + """\
  - receive: {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: wait}
  - first: {op: external, when: "rank == 0", reads: [x], writes: [act]}
  - compute: {op: external, when: "rank > 0", reads: [recv], writes: [act]}
  - send: {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: put}
  - free: {op: signal, to: prev, channel: free}
  - freed: {op: wait, from: next, channel: free}
"""


def _errors(text: str) -> list:
    schedule = parse_text(text, "s.yaml")
    return [d for d in structural.check(schedule, range(2, 5)) if d.severity == "error"]


def _agree(text: str, world: int) -> tuple[set, set]:
    """The checker's findings and the brute force's at ``world``: the checker reports
    every race the brute force and the execution oracle find (it takes a line's edge
    ranks as every other rank: phantom stores only add races), and the same deadlocks."""
    schedule = parse_text(text, world=world)
    errors = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
    assert errors == [], (text, world, errors)
    found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
    exact = oracle_keys(schedule, world)
    dead = {k for k in found if k[0] == "deadlock"}
    assert dead == {k for k in exact if k[0] == "deadlock"}, (text, world)
    # the structural read-before-write check passed: the brute force's data flow agrees
    assert oracle_unwritten(schedule, world) == set(), (text, world)
    run = explore(lower(schedule, [world]), world, channels=channel_names(schedule))
    assert run.hung == bool(dead), (text, world)
    if not dead:  # past a hang, the ranks that still run differ (and it is refused)
        assert exact <= found, (text, world, exact - found)
        assert {f.key for f in run.findings if f.kind == "race"} <= found, (text, world)
    return found, exact


# --- the pairing and the located errors -------------------------------------------------

def test_the_kth_wait_polls_the_kth_put_whichever_comes_first() -> None:
    schedule = parse_text(STAGE)
    found = shift.puts(schedule)
    assert found.polls["receive"].name == "send" and found.lands["send"].name == "receive"
    assert found.lonely_waits == found.lonely_puts == []
    assert _errors(STAGE) == []


def test_a_communicating_step_between_a_wait_and_its_later_put_is_located() -> None:
    text = STAGE.replace("  - send:", "  - early: {op: wait, from: next, channel: free}\n"
                         "  - send:").replace("  - freed: {op: wait, from: next, channel: free}\n",
                                              "")
    found = _errors(text)
    assert [d.code for d in found] == ["wait-first-span"], found
    line = text.splitlines().index(next(ln for ln in text.splitlines() if "receive:" in ln))
    assert (found[0].mark.file, found[0].mark.line) == ("s.yaml", line + 1)
    assert "'early'" in found[0].message and "'send'" in found[0].message


@pytest.mark.parametrize("streams,refused", [("per_slot", True), ("single", False)])
def test_two_calls_in_flight_around_a_wait_first_are_located(streams: str,
                                                            refused: bool) -> None:
    """Two slots on their own streams: the other call's steps may run between the wait and
    its put, its credit wait among them (seen: the local backend's interleaved order of
    the ops file with 2 slots hung on CPU at W=2, rank 1's receive waiting for rank 0's
    put behind rank 0's wait for the other call's credit). One stream runs the calls one
    after another."""
    text = STAGE.replace("steps:\n", f"slots: 2\nstreams: {streams}\nsteps:\n")
    found = _errors(text)
    if not refused:
        assert found == []
        return
    assert [d.code for d in found] == ["wait-first-span"], found
    assert "2 slots on their own streams" in found[0].message
    assert "slots: 1" in found[0].hint


def test_the_span_rule_is_what_keeps_the_chain_live() -> None:
    """A ping-pong between the wait and its put: rank r's pong waits for rank r + 1's
    ping, which rank r + 1 makes only after its receive, which needs rank r's put, after
    the pong: a deadlock the brute force finds. The liveness graph without the chain's
    edge cannot see it (it orders nothing through the receive), which is why such a step
    there is refused before the analysis."""
    text = STAGE.replace("  - send:", "  - ping: {op: signal, to: prev, channel: c}\n"
                         "  - pong: {op: wait, from: next, channel: c}\n  - send:")
    assert [d.code for d in _errors(text)] == ["wait-first-span"]
    for world in (2, 3, 4):
        schedule = parse_text(text)
        assert any(k[0] == "deadlock" for k in oracle_keys(schedule, world)), world
        assert not any(f.kind == "deadlock"
                       for f in hb.check(schedule, [world], hints=False).findings), world


@pytest.mark.parametrize("move,words", [
    ("offset: 2", "at W=2 the shift by 2 is a local copy"),
    ('perm: "(W - r) % W"', "rank 0 is a fixed point of the perm")])
def test_a_wait_before_a_local_copy_is_located(move: str, words: str) -> None:
    """No wait event to deadlock on: the copy is made at the put, after the wait."""
    text = STAGE.replace("offset: next, wrap: false", move)
    schedule = parse_text(text, "s.yaml", world=2)
    found = [d for d in structural.check(schedule, [2]) if d.severity == "error"]
    assert [d.code for d in found] == ["wait-first-span"], found
    assert words in found[0].message and found[0].mark.line == 9


def test_a_wait_first_shift_along_an_axis_is_a_chain_per_team() -> None:
    """Along an axis the chain runs in each team (tests/ops/test_shift_axis_perm.py runs
    it); the stage's guards name the rank, so the guarded read on gpu 0 of node 1 (rank
    2, which receives nothing along gpu) is what the structural check locates."""
    text = STAGE.replace("schedule: s\n", "schedule: s\nmesh: {node: 2, gpu: 2}\n").replace(
        "wrap: false,", "wrap: false, axis: gpu,").replace(
        "from: next, channel", "axis: gpu, from: next, channel").replace(
        "to: prev, channel", "axis: gpu, to: prev, channel")
    schedule = parse_text(text, "s.yaml")
    found = [d for d in structural.check(schedule, [MeshWorld((2, 2))]) if d.severity == "error"]
    assert [d.code for d in found] == ["read-before-write"], found
    assert "reads 'recv' on rank 2" in found[0].message


# --- the checker, the brute force and the execution oracle ------------------------------

@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_pipeline_stage_is_proved_by_all_three(world: int) -> None:
    found, exact = _agree(STAGE, world)
    assert found == set() == exact


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_ring_whose_every_rank_waits_first_deadlocks(world: int) -> None:
    text = STAGE.replace("wrap: false, ", "")
    found, _ = _agree(text, world)
    assert ("deadlock", "cycle", "send", "receive", "send") in found
    report = hb.check(parse_text(text, "s.yaml"), [world])
    dead = next(f for f in report.findings if f.kind == "deadlock")
    assert dead.mark.line == 9  # the wait, located
    assert "cycle of waits" in dead.message


@pytest.mark.parametrize("world", [2, 4])
def test_a_perm_that_swaps_pairs_deadlocks(world: int) -> None:
    swap = STAGE.replace("offset: next, wrap: false", 'perm: "r + 1 - 2 * (r % 2)"')
    assert any(k[0] == "deadlock" for k in _agree(swap, world)[0])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_line_perm_is_proved(world: int) -> None:
    line = STAGE.replace("offset: next, wrap: false", 'perm: "r + 1"')
    assert _agree(line, world)[0] == set()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_without_the_credit_the_next_calls_put_races_the_read(world: int) -> None:
    text = STAGE.replace("  - free: {op: signal, to: prev, channel: free}\n", "").replace(
        "  - freed: {op: wait, from: next, channel: free}\n", "")
    found, exact = _agree(text, world)
    assert ("race", "write-after-read", "recv", "compute", "send") in exact & found


@pytest.mark.parametrize("path", [GALLERY, TWIN], ids=lambda p: p.stem)
def test_the_gallery_hand_off_and_its_twin_agree_with_both_oracles(path: Path) -> None:
    for world in (2, 3, 4):
        found, exact = _agree(path.read_text(), world)
        if path == TWIN:
            assert ("race", "write-after-read", "recv", "layers", "send") in exact & found
        else:
            assert found == exact == set()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_checker_reports_what_the_exact_models_find_on_random_wait_first_schedules(
        data: st.DataObject) -> None:
    text = random_wait_first_schedule_text(data.draw, st)
    for world in (2, 3, 4):
        _agree(text, world)


# --- the float64 reference: dependency order, not lock step -----------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_reference_runs_the_chain_in_dependency_order(world: int) -> None:
    """Stage r computes act = 2 recv + r from what stage r - 1 sent this call; stage 0
    act = 2 x. Lock step would hand stage 1 what stage 0 had not computed yet."""
    import torch

    schedule = parse_text(STAGE)

    def external(step, rank, bufs):
        if step.name == "first":
            return {"act": bufs["x"] * 2}
        return {"act": bufs["recv"] * 2 + rank}

    x = torch.full((4, 2), 0.5, dtype=torch.float64)
    inputs = [{"x": x} for _ in range(world)]
    trace: list = []
    out = simulate.simulate_call(schedule, world, {"N": 4, "D": 2}, inputs, external,
                                 trace=trace)
    want = 1.0  # stage 0: 2 x
    for r in range(world):
        want = want * 2 + r if r else want  # stage r doubles what it got, adds its rank
        assert torch.equal(out[r]["act"], torch.full((4, 2), want, dtype=torch.float64))
    assert len(trace) == len(schedule.step_list())
    assert trace[2][world - 1]["act"].flatten()[0].item() == want  # compute's entry


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", ["host", "torch"])
def test_dcpc_run_of_the_pipeline_hand_off_matches_float64(world: int, backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(GALLERY), world=world, backend=backend,
                                    calls=5, seed=world))
    text = format_report(report)
    assert report.ok, text
    assert report.outputs["recv"].compared > 0, text
    assert all(o.mismatches == 0 for o in report.outputs.values()), text


OPS_FILE = ROOT / "schedules" / "ops" / "shift_wait_first.yaml"
BACKWARDS = [("offset: next, wrap: false", "offset: prev, wrap: false"),
             ('when: "rank == 0"', 'when: "rank == X"'),
             ('when: "rank > 0"', 'when: "rank < W - 1"'),
             ('when: "rank == W - 1"', 'when: "rank == 0"'),
             ('when: "rank == X"', 'when: "rank == W - 1"'),
             ("to: prev, channel", "to: next, channel"),
             ("from: next, channel", "from: prev, channel")]


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("variant", ["perm", "backwards"])
def test_dcpc_run_of_a_perm_chain_and_a_backward_chain_matches_float64(
        variant: str, backend: str, tmp_path: Path) -> None:
    """The chain by a perm (r + 1) and the chain run backwards (offset prev: the last
    rank starts it), reference and kernels alike."""
    text = OPS_FILE.read_text()
    edits = ([("offset: next, wrap: false", 'perm: "r + 1"')] if variant == "perm"
             else BACKWARDS)
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"{variant}.yaml"
    path.write_text(text)
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend=backend, calls=5,
                                    seed=3))
    text = format_report(report)
    assert report.ok and report.outputs["recv"].compared > 0, text
    assert all(o.mismatches == 0 for o in report.outputs.values()), text


@pytest.mark.parametrize("order", ["wait-first", "put-first"])
def test_a_line_race_names_a_writer_the_line_has(order: str) -> None:
    """The symmetric model gives the last rank of a line a store past its end (into rank
    0): a race found there was shown as 'send on rank 2' into rank 0's recv at W=3, and
    `dcpc run --replay` then waited for a store that never comes (NOT FORCED). Shown
    rotated, the writer is a rank with a successor, storing into that successor."""
    steps = ("  - clear: {op: external, reads: [x], writes: [recv]}\n"
             "  - receive: {op: shift, src: act, dst: recv, offset: next, wrap: false, "
             "phase: wait}\n"
             "  - send: {op: shift, src: act, dst: recv, offset: next, wrap: false, "
             "phase: put}\n")
    if order == "put-first":
        lines = steps.splitlines(keepends=True)
        steps = lines[0] + lines[2] + lines[1]
    text = HEAD + ("  - first: {op: external, reads: [x], writes: [act]}\n") + steps
    report = hb.check(parse_text(text, "s.yaml"), [3], hints=False)
    shown = [loc for f in report.findings for loc in (f.first, f.second)
             if loc.step == "send" and loc.access == "write"]
    assert shown, [f.message for f in report.findings]
    for loc in shown:
        assert 0 <= loc.rank + 1 < 3 and loc.owner == loc.rank + 1, loc
