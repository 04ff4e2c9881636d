"""A shift's wait written before its put (the pipeline stage's receive, compute, send):
the pairing, the located errors, the checker against the brute force and the execution
oracle (chains proved, rings deadlocked, missing credits raced), the float64 reference
in dependency order, and `dcpc run` on the gallery's pipeline hand-off."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import channel_names
from support.hb_oracle import oracle_keys, oracle_unwritten, random_wait_first_schedule_text
from support.kernels import construct_on_local_ranks

from dcpc import pipeline
from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import load_module_class
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_text
from dcpc.ops import _split, shift

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


def _errors(text: str, world: int | None = None) -> list:
    schedule = parse_text(text, "s.yaml", world=world)
    worlds = range(2, 5) if world is None else [world]
    return [d for d in structural.check(schedule, worlds) if d.severity == "error"]


def _interleaved(schedule) -> bool:
    """Whether a wait written before its put stands inside another's span."""
    holder = SimpleNamespace(schedule=schedule)
    return any(shift._inner(holder, s) for s in schedule.step_list())


def _agree(text: str, world: int) -> tuple[set, set]:
    """The checker's findings and the brute force's at ``world``: the checker reports
    every race the brute force and the execution oracle find (it takes a line's edge
    ranks as every other rank: phantom stores only add races), and the same deadlocks
    (interleaved pairs on a ring: one cycle through both waits, which the checker
    reports once, at its first wait, and the brute force at each wait on it)."""
    schedule = parse_text(text, world=world)
    errors = [d for d in structural.check(schedule, [world]) if d.severity == "error"]
    assert errors == [], (text, world, errors)
    found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
    exact = oracle_keys(schedule, world)
    dead, exact_dead = ({k for k in keys if k[0] == "deadlock"} for keys in (found, exact))
    if _interleaved(schedule):
        assert dead <= exact_dead and bool(dead) == bool(exact_dead), (text, world)
    else:
        assert dead == exact_dead, (text, world)
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
    found = _split.puts(schedule)
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


def test_a_read_on_a_rank_the_chain_does_not_reach_names_the_wait() -> None:
    """Review finding: a read of recv on rank 0 (the line's first rank receives nothing)
    said "no earlier step writes it"; the put that lands at the wait written before it
    does, on every other rank."""
    found = _errors(STAGE.replace('when: "rank > 0", reads: [recv]',
                                  'when: "rank >= 0", reads: [recv]'))
    assert [d.code for d in found] == ["read-before-write"], found
    assert ("step 'compute' reads 'recv' on rank 0 at W=2, where nothing the call ran "
            "before wrote it; 'send' stores it at its wait 'receive' (a wait written "
            "before its put: the chain), but rank 0 receives nothing at W=2 (a shift "
            "without wrap: no source on that side of the line)") == found[0].message
    assert "no earlier step writes it" not in found[0].message


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


# two interleaved pairs of one chain (the gallery's hidden_states and residual)
PAIR_HEAD = HEAD.replace("  recv:", "  aux: {shape: [N, D], dtype: f32}\n"
                         "  recv_b: {shape: [N, D], dtype: f32, symmetric: true}\n  recv:")
PAIR = PAIR_HEAD + """\
  - receive: {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: wait}
  - receive_b: {op: shift, src: aux, dst: recv_b, offset: next, wrap: false, phase: wait}
  - first: {op: external, when: "rank == 0", reads: [x], writes: [act, aux]}
  - compute: {op: external, when: "rank > 0", reads: [recv, recv_b], writes: [act, aux]}
  - send: {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: put}
  - send_b: {op: shift, src: aux, dst: recv_b, offset: next, wrap: false, phase: put}
  - free: {op: signal, to: prev, channel: free}
  - freed: {op: wait, from: next, channel: free}
"""


def _line(text: str, name: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if f"- {name}:" in ln)


def test_two_interleaved_pairs_of_one_chain_are_accepted() -> None:
    found = _split.puts(parse_text(PAIR))
    assert {w: p.name for w, p in found.polls.items()} == {"receive": "send",
                                                          "receive_b": "send_b"}
    assert _errors(PAIR) == []


CYCLE = ("at W=2, hangs: rank 0 waits at 'receive_b' for rank 1's 'send_b'; rank 1 waits at "
         "'receive' for rank 0's 'send' (the cycle of waits 0 -> 1 -> 0)")


def test_a_wait_of_another_chain_between_that_hangs_is_located() -> None:
    """The second pair on the other direction: rank 0 waits for rank 1's second put,
    rank 1 for rank 0's first: the span, run rank by rank, hangs (the brute force and
    the execution oracle find it too: the random schedules' test)."""
    text = PAIR.replace("src: aux, dst: recv_b, offset: next, wrap: false",
                        "src: aux, dst: recv_b, offset: prev, wrap: false")
    found = [d for d in _errors(text) if d.code == "wait-first-span"]
    assert len(found) == 1, found
    refused = found[0]
    assert (refused.mark.file, refused.mark.line) == ("s.yaml", _line(text, "receive"))
    assert refused.mark.col == text.splitlines()[refused.mark.line - 1].index("wait}") + 1
    assert CYCLE in refused.message, refused.message
    assert "a forward and a backward hand-off on one axis each its own span" in refused.hint


def test_a_ring_wait_between_is_the_checkers_deadlock() -> None:
    """A ring's wait first in the span (every rank waits first): its edge stays in the
    happens-before model, whose cycle is the deadlock, reported with its execution."""
    text = PAIR.replace("src: aux, dst: recv_b, offset: next, wrap: false",
                        "src: aux, dst: recv_b, offset: next")
    assert _errors(text) == []
    found, _ = _agree(text, 3)
    assert any(k[0] == "deadlock" for k in found), found


@pytest.mark.parametrize("world", [2, 3, 4])
def test_another_chain_on_the_axis_interleaves_where_nothing_hangs(world: int) -> None:
    """The second pair by the perm r + 2 (r + 2 past the last rank: none) beside the
    line r + 1: another chain on the same axis, whose edges with the first close no
    cycle: live, proved by the checker and by the brute force and the execution oracle
    (issue 33's gap (a): refused before as 'another chain on a common axis')."""
    text = PAIR.replace("src: aux, dst: recv_b, offset: next, wrap: false",
                        'src: aux, dst: recv_b, perm: "r + 2"')
    text = text.replace("reads: [recv, recv_b]", "reads: [recv]")
    assert _errors(text, world) == []
    found, exact = _agree(text, world)  # the credit to prev leaves r + 2's recv_b racing
    assert {k[0] for k in found | exact} <= {"race"}, (found, exact)


SPELLINGS = ['perm: "r + 1"', "offset: 1, wrap: false"]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("which", ["second", "first"])
def test_one_chain_written_two_ways_interleaves(spelling: str, which: str) -> None:
    """A chain is its rank -> peer edges at the W checked, not its spelling: the line
    r + 1 written as a perm (or offset 1) beside 'offset: next, wrap: false' is proved at
    W 2..6, by the checker, the brute force and the execution oracle alike."""
    old = "src: aux, dst: recv_b, " if which == "second" else "src: act, dst: recv, "
    text = PAIR.replace(old + "offset: next, wrap: false", old + spelling)
    assert text.count(spelling) == 2
    for world in range(2, 7):
        assert _errors(text, world) == [], world
    for world in (2, 3, 4):
        found, exact = _agree(text, world)
        assert found == set() == exact, world


def test_a_put_whose_wait_comes_later_between_is_located() -> None:
    """A put-first pair of the same chain inside the span: on the torch backend its
    exchange would be taken by the wait's receive (messages between two ranks match in
    order)."""
    lines = PAIR.replace("reads: [recv, recv_b]", "reads: [recv]").splitlines(keepends=True)
    wait_b, put_a, put_b = (_line(PAIR, n) - 1 for n in ("receive_b", "send", "send_b"))
    order = ([ln for i, ln in enumerate(lines) if i not in (wait_b, put_a, put_b)
              and "- free:" not in ln])
    at = next(i for i, ln in enumerate(order) if "- compute:" in ln) + 1
    order[at:at] = [lines[put_b], lines[put_a], lines[wait_b],
                    "  - free: {op: signal, to: prev, channel: free}\n"]
    text = "".join(order)
    found = _errors(text)
    assert [d.code for d in found] == ["wait-first-span"], found
    assert found[0].mark.line == _line(text, "receive")
    assert "puts for a wait written after it" in found[0].message


def _reversed(text: str) -> str:
    lines = text.splitlines(keepends=True)
    a, b = _line(text, "send") - 1, _line(text, "send_b") - 1
    lines[a], lines[b] = lines[b], lines[a]
    return "".join(lines)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_puts_in_another_order_than_their_waits_are_proved(world: int) -> None:
    """wait A, wait B, put B, put A: live (the span's run), proved by all three (issue
    33's gap (b): refused before for the torch backend, which now receives put B's
    message at wait A: schedules/ops/shift_wait_first_reversed.yaml runs it)."""
    text = _reversed(PAIR)
    assert _errors(text) == []
    found, exact = _agree(text, world)
    assert found == exact == set()


def test_puts_in_another_order_with_a_guarded_wait_are_located() -> None:
    """With a 'when:' on one of the waits the torch backend's early receive could take
    a message on a rank that skips the later wait: still refused, at the early put."""
    text = _reversed(PAIR).replace(
        "dst: recv_b, offset: next, wrap: false, phase: wait}",
        'dst: recv_b, offset: next, wrap: false, phase: wait, when: "W > 1"}')
    found = _errors(text)
    assert [d.code for d in found] == ["wait-first-span"], found
    assert found[0].mark.line == _line(text, "send_b")
    assert "'send_b' puts before 'send'" in found[0].message
    assert "one of them has a 'when:'" in found[0].message
    assert "put 'send' before 'send_b'" in found[0].hint


@pytest.mark.parametrize("world", [2, 3, 4])
def test_without_the_credit_the_next_calls_puts_race_both_reads(world: int) -> None:
    text = PAIR.replace("  - free: {op: signal, to: prev, channel: free}\n", "").replace(
        "  - freed: {op: wait, from: next, channel: free}\n", "")
    found, exact = _agree(text, world)
    for dst, put in (("recv", "send"), ("recv_b", "send_b")):
        assert ("race", "write-after-read", dst, "compute", put) in exact & found


# --- the checker, the brute force and the execution oracle ------------------------------

STAGES = pytest.mark.parametrize("stage", [STAGE, PAIR], ids=["one pair", "two pairs"])


@STAGES
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_a_pipeline_stage_is_proved_by_all_three(world: int, stage: str) -> None:
    found, exact = _agree(stage, world)
    assert found == set() == exact


@STAGES
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_ring_whose_every_rank_waits_first_deadlocks(world: int, stage: str) -> None:
    text = stage.replace("wrap: false, ", "")
    assert _errors(text) == []  # the waits first of one ring: the checker's deadlock
    found, exact = _agree(text, world)
    assert ("deadlock", "cycle", "send", "receive", "send") in found & exact
    if stage == PAIR:  # one cycle through both waits: the brute force names each
        assert ("deadlock", "cycle", "send_b", "receive_b", "send_b") in exact
    report = hb.check(parse_text(text, "s.yaml"), [world])
    dead = next(f for f in report.findings if f.kind == "deadlock")
    assert dead.mark.line == _line(text, "receive")  # the wait, located
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
            assert (("race", "write-after-read", "recv_hidden", "layers", "send_hidden")
                    in exact & found)
        else:
            assert found == exact == set()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_checker_reports_what_the_exact_models_find_on_random_wait_first_schedules(
        data: st.DataObject) -> None:
    text = random_wait_first_schedule_text(data.draw, st)
    for world in (2, 3, 4):
        _agree(text, world)


def _hangs(text: str, world: int) -> bool:
    """Whether the brute force and the execution oracle both find ``text`` stuck at
    ``world`` (a deadlock; the two agree)."""
    schedule = parse_text(text, world=world)
    dead = any(k[0] == "deadlock" for k in oracle_keys(schedule, world))
    run = explore(lower(schedule, [world]), world, channels=channel_names(schedule))
    assert run.hung == dead, (text, world)
    return dead


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_span_run_agrees_with_the_exact_models_on_random_chains_of_two_kinds(
        data: st.DataObject) -> None:
    """Two interleaved pairs that move each its own way (a forward and a backward
    hand-off, a line and a perm, a chain and a ring) with their puts in either order:
    what the checker proves, the brute force and the execution oracle find live with
    every race reported (_agree); what it refuses as a span that hangs, they find stuck
    at the W it names (no false proof, and here no false refusal either)."""
    text = random_wait_first_schedule_text(data.draw, st, mixed=True)
    for world in (2, 3, 4):
        errors = _errors(text, world)
        if not errors:
            _agree(text, world)
            continue
        assert {d.code for d in errors} == {"wait-first-span"}, errors
        hang = next((d for d in errors if "hangs" in d.message), None)
        if hang is None:  # the puts' order (the torch backend)
            assert all("puts before" in d.message for d in errors), errors
            continue
        at = int(hang.message.split("at W=")[1].split(",")[0].split(" ")[0])
        if "the torch backend" not in hang.message:
            assert _hangs(text, at), (text, at, hang.message)


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


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_reference_runs_two_pairs_rank_by_rank_with_srcs_as_put(world: int) -> None:
    """Two pairs, and a local step between the puts that overwrites the first put's src:
    a receiver gets the src as it stood at the put (stage r: act = 2 recv + r, aux =
    recv_b + 1; then act = 0 after 'send')."""
    import torch

    text = PAIR.replace("  - send_b:", "  - clobber: {op: external, reads: [x], "
                        "writes: [act]}\n  - send_b:")
    schedule = parse_text(text)
    assert _errors(text) == []

    def external(step, rank, bufs):
        if step.name == "first":
            return {"act": bufs["x"] * 2, "aux": bufs["x"] * 0 + 1}
        if step.name == "clobber":
            return {"act": bufs["x"] * 0}
        return {"act": bufs["recv"] * 2 + rank, "aux": bufs["recv_b"] + 1}

    x = torch.full((4, 2), 0.5, dtype=torch.float64)
    out = simulate.simulate_call(schedule, world, {"N": 4, "D": 2},
                                 [{"x": x} for _ in range(world)], external)
    act, aux = 1.0, 1.0  # stage 0
    for r in range(1, world):
        assert torch.equal(out[r]["recv"], torch.full((4, 2), act, dtype=torch.float64))
        assert torch.equal(out[r]["recv_b"], torch.full((4, 2), aux, dtype=torch.float64))
        act, aux = act * 2 + r, aux + 1


# On the host backend: tests/cli/test_gallery.py (its `# run: 2 3 4`, every returned
# buffer compared where its step runs).
@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", ["torch"])
def test_dcpc_run_of_the_pipeline_hand_off_matches_float64(world: int, backend: str) -> None:
    report = run_schedule(RunConfig(schedule=str(GALLERY), world=world, backend=backend,
                                    calls=5, seed=world))
    text = format_report(report)
    assert report.ok, text
    assert report.outputs["recv_hidden"].compared > 0, text
    assert report.outputs["recv_residual"].compared > 0, text
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


PAIR_FILE = ROOT / "schedules" / "ops" / "shift_wait_first_pair.yaml"


@pytest.mark.e2e
@pytest.mark.parametrize("world,backend", [(2, "host"), (3, "host"), (4, "host"),
                                           (3, "torch")])
def test_dcpc_run_of_one_chain_written_two_ways_matches_float64(
        world: int, backend: str, tmp_path: Path) -> None:
    """The op file's two interleaved pairs, the second written as the perm r + 1: the
    reference runs the merged span along the one chain, the kernels and gloo agree."""
    text = PAIR_FILE.read_text()
    for step in ("receive_b", "send_b"):
        old = next(ln for ln in text.splitlines() if ln.startswith(f"  - {step}:"))
        text = text.replace(old, old.replace("offset: next, wrap: false", 'perm: "r + 1"'))
    assert text.count('perm: "r + 1"') == 2
    path = tmp_path / "two_spellings.yaml"
    path.write_text(text)
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend=backend,
                                    calls=5, seed=world))
    shown = format_report(report)
    assert report.ok, shown
    assert report.outputs["recv_b"].compared > 0, shown  # what the perm moved
    assert all(o.mismatches == 0 for o in report.outputs.values()), shown


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


FAR = PAIR_HEAD + """\
  - wa: {op: shift, src: act, dst: recv, offset: 9, wrap: false, phase: wait}
  - wb: {op: shift, src: aux, dst: recv_b, offset: -9, wrap: false, phase: wait}
  - mk: {op: external, reads: [x], writes: [act, aux]}
  - pa: {op: shift, src: act, dst: recv, offset: 9, wrap: false, phase: put}
  - pb: {op: shift, src: aux, dst: recv_b, offset: -9, wrap: false, phase: put}
  - credit: {op: signal, to: all, channel: free}
  - freed: {op: wait, from: all, channel: free}
  - last: {op: external, reads: [act, aux], writes: [out]}
"""


def test_two_offsets_past_every_w_checked_are_proved_there_and_refused_past(
        tmp_path: Path) -> None:
    """Offsets 9 and -9 (wrap: false) link no ranks at W 2..4, the W checked: the file is
    proved there, and only there. At W = 10 rank 0 would wait for rank 9 and rank 9 for
    rank 0, each before its put, but the compiled module refuses W = 10 (``WORLDS``:
    runtime/teams.py ``_check_proved``); the span is decided at exactly the W checked, and
    deciding it at W past them too (as a review fix once did) only refused files that are
    live at every W they claim."""
    assert _errors(FAR) == []
    assert _errors(FAR.replace("offset: -9", "offset: 9")) == []  # one chain, two pairs
    path = tmp_path / "far.yaml"
    path.write_text(FAR)
    c = pipeline.run(path, pipeline.Options(worlds=[2, 3, 4]))
    module = tmp_path / "far.py"
    module.write_text(c.module_text)
    cls = load_module_class(str(module), c.schedule.schedule)
    assert cls.WORLDS == (2, 3, 4)
    said = construct_on_local_ranks(cls, 10, lambda rank: {})
    assert len(said) == 10, said
    for text in said.values():
        assert "proved and compiled for W 2, 3, 4, but the group is 10" in text, text
