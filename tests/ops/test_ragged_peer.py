"""ragged_all_to_all to one peer per rank (``offset:``, with ``phase``; dcpc/ops/
ragged_all_to_all.py): the checker's model of the one-peer store (``Region.peer``: writer
p's block in rank p + k's instance only) agrees with the brute force and the execution
oracle, the conformance files' wrong twins (a refill without its head's credit) are
refused with a located race, offsets 0 and multiples of W are local copies, bad input
gets its class at its key, the emitted lanes name the peer the reference does, and the
files run on the torch backend against float64 (the host backend runs them in
tests/ops/test_op_schedules.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import disagreements
from support.hb_oracle import assert_brute_force_agrees, unrolled
from support.schedules import diagnostics, ragged_head, run_ranks

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.topology import along

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "ragged_all_to_all_peer.yaml"
AXIS = ROOT / "schedules" / "ops" / "ragged_all_to_all_peer_axis.yaml"
CREDIT = '        - credit: {op: wait, offset: "0 - (h + 1)", channel: head}\n'
AXIS_CREDIT = '        - credit: {op: wait, axis: node, offset: "0 - (h + 1)", channel: head}\n'

HEAD = """schedule: peer
slots: {slots}
sizes: {{C: 3, H: 4}}
buffers:
  x: {{shape: [W, C, H], dtype: f32}}
  n: {{shape: [W], dtype: i32}}
  y: {{shape: [W, C, H], dtype: f32, symmetric: true}}
  m: {{shape: [W], dtype: i32, symmetric: true}}
  out: {{shape: [W, C, H], dtype: f32}}
steps:
"""
KEYS = "src: x, dst: y, counts: n, recv_counts: m, capacity: C"


def _put(name: str, k: int, phase: str) -> str:
    return f"  - {name}: {{op: ragged_all_to_all, {KEYS}, phase: {phase}, offset: {k}}}\n"


def random_peer_schedule_text(draw, st) -> str:
    """Puts by offsets 0..3 into one dst (two of one offset at times), each after a
    credit from its destination or not, their waits anywhere after them, the read of
    every block and the credits given back (to r - k) placed at random: clean rings,
    races and deadlocks all occur."""
    slots = draw(st.integers(1, 2))
    offsets = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    body: list[str] = []
    credited = []
    for i, k in enumerate(offsets):
        if k and draw(st.booleans()):
            body.append(f"  - credit{i}: {{op: wait, offset: {-k}, channel: c{i}}}\n")
            credited.append((i, k))
        body.append(_put(f"put{i}", k, "put"))
    for i, k in enumerate(offsets):  # a wait after its put, anywhere later
        at = draw(st.integers(body.index(_put(f"put{i}", k, "put")) + 1, len(body)))
        body.insert(at, _put(f"landed{i}", k, "wait"))
    last = max(body.index(_put(f"landed{i}", k, "wait")) for i, k in enumerate(offsets))
    body.insert(draw(st.integers(last + 1, len(body))),
                "  - use: {op: external, reads: [y, m], writes: [out]}\n")
    for i, k in credited:  # the head back to the sender, r - k, before or after the use
        body.insert(draw(st.integers(0, len(body))),
                    f"  - free{i}: {{op: signal, offset: {-k}, channel: c{i}}}\n")
    return HEAD.format(slots=slots) + "".join(body)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_brute_force_and_execution_oracle_agree_on_random_one_peer_puts(
        data: st.DataObject) -> None:
    """Random one-peer puts and credits: the three agree at W = 2..4 (a put's store
    reaches its one destination only, so puts to different peers into one dst may be in
    flight at once, and two to the same may not)."""
    text = random_peer_schedule_text(data.draw, st)
    for world, schedule in unrolled(text):
        assert_brute_force_agrees(schedule, world, text)
        assert disagreements(schedule, [world]) == [], (text, world)


@pytest.mark.parametrize(("path", "worlds"), [
    (FILE, (2, 3, 4)), (AXIS, (MeshWorld((2, 2)), MeshWorld((3, 2))))], ids=["flat", "axis"])
def test_the_files_and_their_wrong_twins_agree_with_the_brute_force(path: Path, worlds
                                                                    ) -> None:
    """The conformance files (proved) and their twins without the credit (races): the
    checker's findings are the brute force's, exactly."""
    text = path.read_text()
    twin = text.replace(CREDIT, "").replace(AXIS_CREDIT, "")
    assert twin != text
    for source in (text, twin):
        for world, schedule in unrolled(source, worlds):
            assert_brute_force_agrees(schedule, world, source)


def _twin_races(tmp_path: Path, path: Path, credit: str, worlds: list) -> tuple[str, list]:
    """The file ``path`` less its sender's ``credit`` line, and the races the checker
    refuses it with at ``worlds`` (some, or this fails)."""
    text = path.read_text()
    twin = text.replace(credit, "")
    assert twin != text
    wrong = tmp_path / f"{path.stem}.no_credit.yaml"
    wrong.write_text(twin)
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(wrong, pipeline.Options(worlds=worlds), until="hb")
    races = [d for d in err.value.diagnostics if d.code == "race"]
    assert races, err.value.diagnostics
    return twin, races


def test_the_wrong_twin_is_refused_with_a_located_race(tmp_path: Path) -> None:
    """The file with the sender's credit dropped (a refill without its destination's
    head): the next call's put into block r of rank r + 1 races the experts' read of it
    there, at the put, naming W, ranks and calls."""
    twin, races = _twin_races(tmp_path, FILE, CREDIT, [2, 3])
    put = next(i for i, x in enumerate(twin.splitlines()) if x.lstrip().startswith("- put:"))
    assert races[0].mark.line == put + 1
    assert any("experts on rank 0 (call 0)" in d.message and "put_h0 on rank 1 (call 1)"
               in d.message and "x_recv" in d.message and "(W=2)" in d.message
               for d in races), [d.message for d in races]
    # the one-peer store's receiver, resolved (rank 1 + 1 at W = 2 is rank 0)
    notes = [n for d in races for n in d.notes if "put_h0 → writing" in n]
    assert any("into rank 0's only" in n for n in notes), notes


def test_the_axis_files_wrong_twin_is_refused(tmp_path: Path) -> None:
    """Along node: without the credit, the next call's rail put races the route's read."""
    _, races = _twin_races(tmp_path, AXIS, AXIS_CREDIT, [MeshWorld((2, 2))])
    assert any("route on rank (node=0, gpu=0) (call 0)" in d.message
               and "put_h0 on rank (node=1, gpu=0) (call 1)" in d.message for d in races), \
        [d.message for d in races]


def _errors(tmp_path: Path, steps: str, worlds: list) -> list:
    return [d for d in diagnostics(HEAD.format(slots=1) + steps, tmp_path, "peer.yaml", worlds)
            if d.severity == "error"]


@pytest.mark.parametrize("k", ["0", "W", "2"])
def test_a_local_block_needs_no_credit(tmp_path: Path, k: str) -> None:
    """Offset 0, W (any W) and 2 at W = 2: the rank's own block, a local copy ordered by
    program order: proved with no credit at all; 2 at W = 3 and 4 is another rank's
    block, which the next call's put overwrites under the use: a race."""
    steps = (f"  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, offset: {k}}}\n"
             f"  - b: {{op: ragged_all_to_all, {KEYS}, phase: wait, offset: {k}}}\n"
             "  - use: {op: external, reads: [y, m], writes: [out]}\n")
    assert _errors(tmp_path, steps, [2]) == []
    found = {d.code for d in _errors(tmp_path, steps, [3, 4])}
    assert found == (set() if k != "2" else {"race"})


@pytest.mark.parametrize(("steps", "code", "line", "says"), [
    (f"  - a: {{op: ragged_all_to_all, {KEYS}, offset: 1}}\n",
     "bad-offset", 11, "but has no 'phase'"),
    (f'  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, offset: "q + 1"}}\n'
     f'  - b: {{op: ragged_all_to_all, {KEYS}, phase: wait, offset: "q + 1"}}\n',
     "bad-offset", 11, "names 'q'"),
    (f'  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, perm: "W - 1 - r"}}\n'
     f'  - b: {{op: ragged_all_to_all, {KEYS}, phase: wait, perm: "W - 1 - r"}}\n',
     "unknown-key", 11, "unknown key 'perm'"),
    (f"  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, offset: 1}}\n"
     f"  - b: {{op: ragged_all_to_all, {KEYS}, phase: wait, offset: 2}}\n",
     "unmatched-put", 11, "to rank r + 1 (offset 1)"),
    (f"  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, offset: 1.5}}\n",
     "wrong-type", 11, "offset"),
    (f'  - a: {{op: ragged_all_to_all, {KEYS}, phase: put, offset: 1, when: "rank > 0"}}\n'
     f'  - b: {{op: ragged_all_to_all, {KEYS}, phase: wait, offset: 1, when: "rank > 0"}}\n',
     "when-on-communication", 11, "sends to one peer (offset 1) and has 'when:'"),
], ids=["no-phase", "unknown-name", "perm", "other-offset", "float", "when"])
def test_bad_offsets_are_located_diagnostics(tmp_path: Path, steps: str, code: str,
                                             line: int, says: str) -> None:
    found = _errors(tmp_path, steps, [2, 3])
    assert found, steps
    first = found[0]
    assert (first.code, first.mark.line) == (code, line), found
    assert says in first.message, first.message
    assert first.mark.col > 1  # at the key, not the step


@pytest.mark.parametrize("world", [3, 5])
def test_the_kernels_lanes_name_the_peer_the_reference_does(world: int) -> None:
    """Every one-peer put and wait of the conformance file at a W where +k and -k differ:
    the emitted module's ``PEER=`` lane (member RANK + PEER, 0: none) is the put's
    destination r + k and the wait's source r - k (``along``), and the put's kernel
    sends only block RANK + PEER."""
    text = pipeline.run(FILE, pipeline.Options(worlds=[world]), until="emit").module_text
    lines = text.splitlines()
    steps = {f"put_h{h}": h + 1 for h in range(world - 1)} | {
        f"landed_h{h}": -(h + 1) for h in range(world - 1)} | {"local": 0, "local_landed": 0}
    for name, k in steps.items():
        launch = next(i for i, x in enumerate(lines) if x.strip().startswith(f"_{name}_kernel["))
        lane = next(x.strip() for x in lines[launch:] if x.strip().startswith("PEER="))
        for rank in range(world):
            got = eval(lane.removeprefix("PEER=").rstrip(","),  # noqa: S307 (our module)
                       {"self": SimpleNamespace(world=world, rank=rank)})
            assert along(rank, world, got) == along(rank, world, k), (name, rank, lane)
    assert "peer = (RANK + PEER) % WORLD" in text


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "world"), [
    (FILE, 3), (AXIS, MeshWorld((2, 3)))], ids=["flat-3", "axis-2x3"])
def test_the_files_run_on_torch_against_float64(path: Path, world) -> None:
    """The torch backend (every member in the one exchange, the other parts empty) lands
    the one block each put sends and leaves the others: every output compared."""
    report = run_schedule(RunConfig(schedule=str(path), world=world, backend="torch",
                                    calls=4, seed=24))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert all(s.compared > 0 for s in report.outputs.values()), text


def test_the_kernels_touch_what_the_plan_says() -> None:
    """The access tracer (dcpc/harness/trace.py): each one-peer put stores block `rank`
    of its one destination's dst and recv_counts only (Region.peer), nothing of any
    other rank's, before its signal. W = 4: offsets 1, 2 (its own inverse) and 3 (-1),
    every kind of peer W = 3's 1 and 2 (-1) are (the lanes at odd W: the test above)."""
    from dcpc.harness import trace as tr

    run = tr.run_traced(str(FILE), 4, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


@pytest.mark.e2e
def test_the_file_runs_on_the_local_backend_against_float64() -> None:
    """The kernels' one-peer lanes with the ranks as threads (the local backend)."""
    report = run_schedule(RunConfig(schedule=str(FILE), world=4, backend="local", calls=3,
                                    seed=24))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert all(s.compared > 0 for s in report.outputs.values()), text


ONE_PEER = ragged_head("one_peer") + """\
  - put:  {op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, capacity: C,
           phase: put, offset: 1}
  - got:  {op: ragged_all_to_all, src: x, dst: y, counts: n, recv_counts: m, capacity: C,
           phase: wait, offset: 1}
"""


@pytest.mark.parametrize("bad", ["sent", "not_sent"])
def test_a_count_over_capacity_fails_its_sender_only_where_it_is_sent(bad: str,
                                                                      tmp_path: Path) -> None:
    """W = 3, each rank sends block r + 1 only: a count over the capacity in that block
    fails the sender's call (its put records it; the receiver checks no count), one in a
    block it does not send (r + 2) is never read: every call returns."""
    import torch

    def body(inst: Any, rank: Any) -> str:
        counts = torch.full((3,), 2, dtype=torch.int32)
        if rank.rank == 1:  # block 2 is rank 1's sent one (1 + 1), block 0 is not
            counts[2 if bad == "sent" else 0] = 5
        inst.put(torch.randn(3, 4, 8).bfloat16(), counts)
        inst.got()
        return "returned"

    ranks = run_ranks(ONE_PEER, tmp_path, 3, {"C": 4}, body)
    if bad == "not_sent":
        assert ranks == ["returned"] * 3, ranks
    else:
        assert "counts[2] = 5, over the capacity 4" in ranks[1], ranks


NAN_TO_ZERO = ("tl.where(vals.to(tl.float32) != vals.to(tl.float32), 0, vals)")


@pytest.mark.e2e
@pytest.mark.parametrize("kernel", ["_local_kernel", "_put_h1_kernel"])
def test_a_nan_a_block_sent_is_compared_whichever_lands_first(kernel: str,
                                                             tmp_path: Path) -> None:
    """W = 3: one kernel stores 0 where its bf16 payload is NaN. The local block lands
    first, before the peers' blocks (each landing keeps the others' blocks): the run
    fails whichever block it is, as the reference carries what nothing wrote yet this
    call (Sim.unsent_mask) and never infers it from a NaN in the values."""
    text = pipeline.run(FILE, pipeline.Options(worlds=[3]), until="emit").module_text
    head, body = text.split(f"def {kernel}(", 1)
    body, tail = body.split("@_rt.fast_launch", 1)
    store = "tl.store(dst + dst_rows[:, None] + c[None, :], vals, mask=m)"
    assert body.count(store) == 1, kernel
    body = body.replace(store, store.replace("vals,", f"{NAN_TO_ZERO},"))
    module = tmp_path / "bad.py"
    module.write_text(f"{head}def {kernel}({body}@_rt.fast_launch{tail}")
    report = run_schedule(RunConfig(schedule=str(FILE), world=3, backend="host", calls=4,
                                    seed=24, module=str(module)))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches > 0, text
