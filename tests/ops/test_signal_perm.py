"""signal/wait to and from one peer per rank (``offset:``, ``perm:``; dcpc/ops/sync.py):
the checker proves who signals whom exactly (the brute force and the execution oracle
agree on random credits), the conformance file's wrong twin is refused with a located
race, and bad input gets its class."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import disagreements
from support.hb_oracle import (
    CREDIT_HEADER,
    assert_brute_force_agrees,
    oracle_keys,
    random_credit_schedule_text,
    unrolled,
)
from support.schedules import diagnostics

from dcpc import pipeline
from dcpc.check import hb
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.ops._perm import table_at
from dcpc.topology import along, perm_sources

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "signal_perm.yaml"


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_brute_force_and_execution_oracle_agree_on_random_credits(
        data: st.DataObject) -> None:
    """A push by an offset or a translation perm, its credit to one peer (the writer or
    not, by an offset, a perm, next/prev), placed anywhere: the three agree at W = 2..4."""
    text = random_credit_schedule_text(data.draw, st)
    for world, schedule in unrolled(text):
        assert_brute_force_agrees(schedule, world, text)
        assert disagreements(schedule, [world]) == [], (text, world)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_credits_by_other_perms_refuse_every_race_the_brute_force_finds(
        data: st.DataObject) -> None:
    """A credit by a perm that is no translation (the mirror, a chain) orders nothing in
    the checker (its rotation symmetry cannot say whom each rank waits for), so it may
    refuse what the brute force proves, but never the other way round: every race the
    brute force finds, the checker finds."""
    move = data.draw(st.sampled_from(['perm: "W - 1 - r"', 'perm: "(r + 1) % W"',
                                      "offset: 2"]))
    credit = data.draw(st.sampled_from(['perm: "W - 1 - r"', 'perm: "r - 1"',
                                        'perm: "r + 1"', 'perm: "(r + W - 1) % W"']))
    text = CREDIT_HEADER.format(seed=0, slots=data.draw(st.integers(1, 2))) + (
        f"  - push: {{op: shift, src: x, dst: s, {move}}}\n"
        "  - use: {op: external, reads: [s], writes: [y]}\n"
        f"  - free: {{op: signal, {credit}, channel: c}}\n"
        f"  - freed: {{op: wait, {credit}, channel: c}}\n")
    for world, schedule in unrolled(text, (2, 3, 4, 5)):
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert oracle_keys(schedule, world) <= found, (text, world)


# a push into kv_recv and its read come before STEPS (8 lines: STEPS start at line 9)
HEAD = ("schedule: credit\nslots: 2\nsizes: {T: 4, D: 8}\nbuffers:\n"
        "  kv: {shape: [T, D], dtype: f32}\n"
        "  kv_recv: {shape: [T, D], dtype: f32, symmetric: true}\n"
        "  out: {shape: [T, D], dtype: f32}\nsteps:\n")


def _check(tmp_path: Path, steps: str, worlds: list) -> list:
    """The errors `dcpc check` gives ``steps`` at ``worlds`` ([] when proved)."""
    return [d for d in diagnostics(HEAD + steps, tmp_path, "credit.yaml", worlds)
            if d.severity == "error"]


def test_the_wrong_twin_is_refused_with_a_located_race(tmp_path: Path) -> None:
    """The conformance file with its perm credit sent to the next rank instead of the
    writer (right at W = 2, where the next rank is the writer; at W = 3 the offset
    credit of x orders it too): a race naming W, the ranks, the calls and the steps.
    (W = 7: at W = 6 the ranks' real steps order it, as the brute force says; the race
    the model's perm waits, which order nothing, gave there until cex27 had a
    counterexample no execution makes.)"""
    text = FILE.read_text()
    twin = text.replace('{op: signal, perm: "(r + W - (W - W % 2) / 2) % W", channel: kv_free}',
                        "{op: signal, to: next, channel: kv_free}").replace(
        '{op: wait, perm: "(r + W - (W - W % 2) / 2) % W", channel: kv_free}',
        "{op: wait, from: prev, channel: kv_free}")
    assert twin != text and "to: next" in twin and "from: prev" in twin
    path = tmp_path / "signal_perm_wrong.yaml"
    path.write_text(twin)
    pipeline.run(path, pipeline.Options(worlds=[2]), until="hb")  # the writer is next
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=list(range(2, 9))), until="hb")
    races = [d for d in err.value.diagnostics if d.code == "race"]
    assert races, err.value.diagnostics
    first = races[0]
    assert first.mark.line == text.splitlines().index(
        next(x for x in text.splitlines() if x.startswith("  - send:"))) + 1
    assert "kv_recv" in first.message and "(W=7)" in first.message
    # the use's read (and the engine's read of what send returned) against the push
    assert any("send on rank" in d.message and "use on rank" in d.message
               and "(call 0)" in d.message and "(call 2)" in d.message for d in races), races


def test_the_right_credit_is_proved_where_a_barrier_would_be_needed(tmp_path: Path) -> None:
    """A push by a perm of one translation, its credit back by the inverse perm (and by
    the same offset, written as one): proved at W = 2..8 with no barrier; without the
    credit, the race."""
    push = '  - send: {op: shift, src: kv, dst: kv_recv, perm: "(r + 3) % W"}\n' \
           "  - use: {op: external, reads: [kv_recv], writes: [out]}\n"
    for back in ('perm: "(r + W - 3 % W) % W"', "offset: -3"):
        credit = (f"  - free: {{op: signal, {back}, channel: f}}\n"
                  f"  - freed: {{op: wait, {back}, channel: f}}\n")
        assert _check(tmp_path, push + credit, list(range(2, 9))) == [], back
    assert {d.code for d in _check(tmp_path, push, [4])} == {"race"}


@pytest.mark.parametrize(("steps", "code", "says"), [
    ('  - free: {op: signal, perm: "r % 2", channel: f}\n'
     '  - freed: {op: wait, perm: "r % 2", channel: f}\n',
     "bad-perm", "both to rank 0 at W=4"),
    ('  - free: {op: signal, perm: "W - 1 - r", offset: 1, channel: f}\n'
     '  - freed: {op: wait, perm: "W - 1 - r", channel: f}\n',
     "bad-perm", "both 'perm' and 'offset'"),
    ("  - free: {op: signal, to: next, offset: 2, channel: f}\n"
     "  - freed: {op: wait, offset: 2, channel: f}\n",
     "bad-offset", "both 'to' and 'offset'"),
    ("  - free: {op: signal, offset: 2, channel: f}\n"
     "  - freed: {op: wait, offset: -2, channel: f}\n",
     "peer-mismatch", "waits for 'offset -2' peers"),
    ('  - freed: {op: wait, perm: "r + 1", channel: f}\n'
     '  - free: {op: signal, perm: "r + 1", channel: f}\n',
     "wait-first-span", "before the signal it polls"),
    ('  - free: {op: signal, offset: "W", channel: f}\n'
     '  - freed: {op: wait, offset: "W", channel: f}\n',
     "bad-offset", "step 'free' signals by offset 'W' = 4 (at W=4), which signals every"),
    ('  - freed: {op: wait, offset: "W / 3", channel: f}\n'
     '  - free: {op: signal, offset: 2, channel: f}\n',
     "bad-offset", "step 'freed' waits by offset 'W / 3' (at W=4): "),
])
def test_bad_peers_are_refused_with_their_class(tmp_path: Path, steps: str, code: str,
                                                says: str) -> None:
    found = _check(tmp_path, steps, [4])
    assert found and all(d.code == code for d in found), found
    assert says in found[0].message and found[0].mark.line > 8, found[0]


def test_a_wait_from_a_rank_that_never_signals_is_a_deadlock(tmp_path: Path) -> None:
    """Every rank waits by a cyclic perm before the signal it polls: each waits for a rank
    that has not signalled (and never does), a cycle of waits, at every W."""
    steps = ('  - freed: {op: wait, perm: "(r + 1) % W", channel: f}\n'
             '  - free: {op: signal, perm: "(r + 1) % W", channel: f}\n')
    for world in (2, 3, 5):
        found = _check(tmp_path, steps, [world])
        assert [d.code for d in found] == ["deadlock"], (world, found)
        assert "freed" in found[0].message


def test_a_fixed_point_signals_and_waits_for_nobody(tmp_path: Path) -> None:
    """``W - 1 - r`` at odd W leaves the middle rank its own peer: it signals nobody and
    waits for nobody (the lane table says 0), the others one lane each; proved live."""
    steps = ('  - free: {op: signal, perm: "W - 1 - r", channel: f}\n'
             '  - freed: {op: wait, perm: "W - 1 - r", channel: f}\n')
    assert _check(tmp_path, steps, [3, 5]) == []
    path = tmp_path / "credit.yaml"
    plan = pipeline.run(path, pipeline.Options(worlds=[3]), until="lower").plan
    lanes = {p.name: p.attrs.get("peer_of") for p in plan.steps}
    assert lanes == {"free": (2, 0, 1), "freed": (2, 0, 1)}


def test_the_axis_files_wrong_twin_is_refused(tmp_path: Path) -> None:
    """The mesh file with its gpu credit to the next gpu instead of the writer: a race
    on the gpu team's receive buffer at a mesh shape where they differ (G = 3), shown
    on ranks whose real steps race (gpu 0's call 2 into gpu 1's instance: cex27; gpu 2's
    into gpu 0's was shown past a hop gpu 1 had not signalled)."""
    text = (ROOT / "schedules" / "ops" / "signal_perm_axis.yaml").read_text()
    back = '"(r + W - (W - W % 2) / 2) % W"'
    twin = text.replace(f"{{op: signal, axis: gpu, perm: {back}, channel: f}}",
                        "{op: signal, axis: gpu, to: next, channel: f}").replace(
        f"{{op: wait, axis: gpu, perm: {back}, channel: f}}",
        "{op: wait, axis: gpu, from: prev, channel: f}")
    assert twin.count("to: next") == 1 and twin.count("from: prev") == 1
    path = tmp_path / "signal_perm_axis_wrong.yaml"
    path.write_text(twin)
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=[MeshWorld((2, 3))]), until="hb")
    (first, *_) = [d for d in err.value.diagnostics if d.code == "race"]
    assert "race on mirror" in first.message and "(W=2x3)" in first.message
    assert "send on rank (node=0, gpu=0) (call 2)" in first.message


@pytest.mark.e2e
@pytest.mark.parametrize(("name", "world", "backend"), [
    ("signal_perm", 3, "torch"), ("signal_perm", 4, "local"),
    ("signal_perm_axis", MeshWorld((2, 3)), "torch"),
    ("signal_perm_axis", MeshWorld((2, 2)), "local")], ids=str)
def test_the_files_run_on_torch_and_local_against_float64(name: str, world, backend: str
                                                          ) -> None:
    """The host backend runs them in tests/ops/test_op_schedules.py; the torch backend
    (a barrier at each wait) and the local one (the kernels' one-peer lanes, ranks as
    threads) too, every output compared."""
    report = run_schedule(RunConfig(schedule=str(ROOT / "schedules" / "ops" / f"{name}.yaml"),
                                    world=world, backend=backend, calls=5, seed=23))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    assert all(s.compared > 0 for s in report.outputs.values()), text


def test_an_offset_over_two_axes_needs_one(tmp_path: Path) -> None:
    """An offset moves one coordinate, as next/prev: over every axis of a 2-axis mesh it
    is `axis-required`, at its key; a perm takes any team."""
    text = ("schedule: m\nmesh: {node: N, gpu: G}\nsizes: {N: {max: 4}, G: {max: 4}}\nbuffers:\n"
            "  x: {shape: [N], dtype: f32}\nsteps:\n"
            "  - free: {op: signal, offset: 1, channel: f}\n"
            "  - freed: {op: wait, offset: 1, channel: f}\n")
    found = [d for d in diagnostics(text, tmp_path, "m.yaml", [MeshWorld((2, 2))])
             if d.severity == "error"]
    assert [(d.code, d.mark.line) for d in found] == [("axis-required", 7), ("axis-required", 8)]
    assert "names 'offset 1' peers over 2 axes" in found[0].message
    assert _check(tmp_path, '  - a: {op: signal, perm: "(r + 1) % W", channel: f}\n'
                  '  - b: {op: wait, perm: "(r + 1) % W", channel: f}\n', [4]) == []


@pytest.mark.parametrize("world", [3, 5])
def test_the_kernels_lanes_name_the_peer_the_reference_does(world: int) -> None:
    """Every one-peer signal and wait of the conformance file, at a W where +k and -k are
    different ranks: the emitted module's ``PEER=`` lane (the kernel's member RANK + PEER,
    0: none) is the peer dcpc.topology names, a signal's the destination (``along`` by its
    offset, or its perm's table) and a wait's the rank whose signal reaches it
    (``perm_sources``). Signal and wait turned round together would still pair up on the
    torch backend and at W = 2 or 4, so the direction is pinned here."""
    text = pipeline.run(FILE, pipeline.Options(worlds=[world]), until="emit").module_text
    lines = text.splitlines()
    steps = [next(iter(s.items())) for s in yaml.safe_load(FILE.read_text())["steps"]]
    one_peer = [(n, b) for n, b in steps if b["op"] in ("signal", "wait")]
    assert {n for n, _ in one_peer} >= {"free", "free_x", "freed", "freed_x"}
    for name, body in one_peer:
        if "perm" in body:
            dests = table_at(body["perm"], world)
        else:
            k = {"next": 1, "prev": -1}.get(body["offset"], body["offset"])
            dests = [along(r, world, k) for r in range(world)]
        peers = dests if body["op"] == "signal" else perm_sources(dests)
        launch = next(i for i, x in enumerate(lines) if x.strip().startswith(f"_{name}_kernel["))
        lane = next(x.strip() for x in lines[launch:] if x.strip().startswith("PEER="))
        for rank in range(world):
            got = eval(lane.removeprefix("PEER=").rstrip(","),  # noqa: S307 (our module)
                       {"self": SimpleNamespace(world=world, rank=rank)})
            want = peers[rank] if peers[rank] not in (-1, rank) else rank  # none: PEER 0
            assert along(rank, world, got) == want, (name, world, rank, lane)


def test_a_perm_wait_no_signal_reaches_names_the_perms_as_written(tmp_path: Path) -> None:
    """peer-mismatch names both perms as written (not their tables at one W: the same
    words at every W, so one error) and the key the wait names its peers by."""
    steps = ('  - free: {op: signal, perm: "W - 1 - r", channel: f}\n'
             '  - freed: {op: wait, perm: "(r + 1) % W", channel: f}\n')
    (found,) = _check(tmp_path, steps, [3, 4])
    assert found.code == "peer-mismatch" and found.mark.line == 10, found
    assert ("waits for 'perm (r + 1) % W' peers on channel 'f', but no signal on it goes "
            "to them (step 'free' signals 'perm W - 1 - r' peers)") in found.message
    assert found.hint == "use 'to: all' or 'perm (r + 1) % W' on 'free', or another 'perm' here"


def test_a_perm_and_an_offset_alike_mod_w_pair_up(tmp_path: Path) -> None:
    """In a file unrolled at one W (it has a perm), a wait by an offset polls a signal by a
    perm that is the same translation mod W (`(r + W - 1) % W` and -1) or by an offset
    alike mod W (2 and -2 at W = 4 only); the credit orders the push (the brute force
    agrees). Checked at every W (no perm), 2 and -2 stay apart."""
    push = ('  - send: {op: shift, src: kv, dst: kv_recv, perm: "(r + 1) % W"}\n'
            "  - use: {op: external, reads: [kv_recv], writes: [out]}\n")
    steps = push + ('  - free: {op: signal, perm: "(r + W - 1) % W", channel: f}\n'
                    "  - freed: {op: wait, offset: -1, channel: f}\n")
    assert _check(tmp_path, steps, [2, 3, 4, 5]) == []
    for world, schedule in unrolled(HEAD + steps, (3, 4, 5)):
        assert_brute_force_agrees(schedule, world, HEAD + steps)
        assert oracle_keys(schedule, world) == set(), world
    alike = ('  - two: {op: signal, offset: 2, channel: g}\n'
             '  - back: {op: wait, offset: -2, channel: g}\n')
    assert _check(tmp_path, steps + alike, [4]) == []
    assert {d.code for d in _check(tmp_path, steps + alike, [5])} == {"peer-mismatch"}
    assert {d.code for d in _check(tmp_path, alike, [4])} == {"peer-mismatch"}
