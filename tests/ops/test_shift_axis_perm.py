"""shift's `perm:` and its wait written before its put along one mesh axis (issue 33 items
1-2: JAX's ``ppermute(x, axis_name='gpu', perm)``, a pipeline per node): the member table
mapped to ranks (r: the member index, W: the team's size), the located refusals (a member
outside the axis, a perm over two axes), the checker against the brute force
(tests/support/hb_oracle.py) and the execution oracle on 2x2, 2x3 and 3x2, the float64
reference per team, and `dcpc run` of the ops files on the host and torch backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import channel_names, checker_covers
from support.hb_oracle import oracle_keys, random_mesh_schedule_text
from support.schedules import run_clean

from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import simulate
from dcpc.harness import trace as tr
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text
from dcpc.topology import team_table, torus

ROOT = Path(__file__).resolve().parents[2]
PERM = ROOT / "schedules" / "ops" / "shift_perm_axis.yaml"
CHAIN = ROOT / "schedules" / "ops" / "shift_wait_first_axis.yaml"
PAIR = ROOT / "tests" / "mesh_backends" / "wait_first_pair_axis.yaml"
SHAPES = [MeshWorld((2, 2)), MeshWorld((2, 3)), MeshWorld((3, 2))]

HEAD = """\
schedule: s
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, T: 4, D: 2}
buffers:
  x: {shape: [T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32, symmetric: true}
  z: {shape: [T, D], dtype: f32}
steps:
"""
# one perm step along AXIS, a use of its dst and (CREDIT) a barrier that frees it
ONE = HEAD + "  - hop: {op: shift, axis: AXIS, src: x, dst: y, perm: PERM}\n" \
    "  - use: {op: external, reads: [y], writes: [z]}\n"
CREDIT = "  - done: {op: barrier}\n"


def _one(axis: str, perm: str) -> str:
    return ONE.replace("AXIS", axis).replace("PERM", perm)


def _errors(text: str, world: MeshWorld) -> list:
    try:
        schedule = parse_text(text, "s.yaml", world)
    except DiagnosticError as err:
        return list(err.diagnostics)
    return [d for d in structural.check(schedule, [world]) if d.severity == "error"]


# --- the member table, mapped to ranks ------------------------------------------------

@pytest.mark.parametrize("axis,perm,shape,ranks", [
    # (n, g) -> (n, G - 1 - g): ranks n * G + g
    ("gpu", '"W - 1 - r"', (2, 3), [2, 1, 0, 5, 4, 3]),
    # (n, g) -> (n + 1 mod N, g)
    ("node", '"(r + 1) % W"', (3, 2), [2, 3, 4, 5, 0, 1]),
    # pairs and a table name member indices: gpu 0 -> gpu 1 only
    ("gpu", "[[0, 1]]", (2, 2), [1, -1, 3, -1]),
    ("gpu", "[1, 0, -1]", (2, 3), [1, 0, -1, 4, 3, -1]),
])
def test_the_member_table_maps_to_each_team_s_ranks(axis: str, perm: str, shape: tuple,
                                                    ranks: list) -> None:
    schedule = parse_text(_one(axis, perm) + CREDIT, world=MeshWorld(shape))
    (hop,) = [s for s in schedule.step_list() if s.kind == "shift"]
    assert hop.op.perm == ranks
    assert schedule.loop_world == shape  # one schedule per mesh shape, not per W
    t, at = torus(shape), (1 if axis == "gpu" else 0,)
    members = team_table(ranks, t.team(0, at))
    assert list(t.perm_ranks(members, at)) == ranks  # the one mapping, both ways
    for rank in range(t.size):  # every team reads the same member table
        assert team_table(ranks, t.team(rank, at)) == members


def test_a_member_outside_the_axis_is_bad_perm_located() -> None:
    text = _one("gpu", "[1, 5]")
    (err,) = _errors(text, MeshWorld((2, 2)))
    assert err.code == "bad-perm" and "destination 5 is not a rank of W=2" in err.message
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "perm:" in t)
    assert (err.mark.line, err.mark.col) == (line, text.splitlines()[line - 1].index("[1,") + 1)
    # pairs naming gpu 3 are written for a team of 4: the shape to check it at is named
    (err,) = _errors(_one("gpu", "[[0, 3], [3, 0]]"), MeshWorld((2, 2)))
    assert err.code == "loop-world" and "--world 2x4 (axis 'gpu' of 4 ranks)" in err.hint


@pytest.mark.parametrize("axis", ["[node, gpu]", "null"])
def test_a_perm_over_both_axes_is_a_perm_of_the_ranks(axis: str) -> None:
    """Over every axis (listed, or none named) the team is the whole mesh and its member
    index is the rank (row-major): ppermute over both axis names."""
    text = _one(axis, '"W - 1 - r"').replace("axis: null, ", "") + CREDIT
    schedule = parse_text(text, world=MeshWorld((2, 3)))
    assert schedule.step_list()[0].op.perm == [5, 4, 3, 2, 1, 0]
    assert _errors(text, MeshWorld((2, 3))) == []


# --- the checker, the brute force and the execution oracle ------------------------------

@pytest.mark.parametrize("world", SHAPES, ids=str)
@pytest.mark.parametrize("axis,perm", [
    ("gpu", '"W - 1 - r"'),  # mirror (a fixed point at odd G)
    ("node", '"(r + 1) % W"'),  # rotation across nodes
    ("gpu", '"r + 1 - 2 * (r % 2)"'),  # swapped pairs (at odd G the last has none)
    ("[node, gpu]", '"(r + 1) % W"'),  # over the whole mesh: rank r + 1 (no translation)
    ("[node, gpu]", '"W - 1 - r"'),  # the mesh's mirror: both coordinates mirrored
])
def test_a_perm_along_an_axis_races_without_a_credit_and_is_proved_with_one(
        world: MeshWorld, axis: str, perm: str) -> None:
    size = {"gpu": world.shape[1], "node": world.shape[0]}.get(axis, int(world))
    racy = _one(axis, perm)
    if "r % 2" in perm and size % 2:  # the last member of each team is no destination
        (err,) = _errors(racy + CREDIT, world)
        assert err.code == "read-before-write", err
        assert "has a perm in which some ranks are no destination" in err.message, err.message
        return
    found, exact = checker_covers(racy, world)  # the checker covers both exact models
    if any(d >= 0 and d != r for r, d in
           enumerate(parse_text(racy, world=world).step_list()[0].op.perm)):
        assert ("race", "write-after-write", "y", "hop", "hop") in exact & found, world
    found, exact = checker_covers(racy + CREDIT, world)
    assert found == exact == set(), world


@pytest.mark.parametrize("world", SHAPES, ids=str)
def test_the_ops_files_are_proved_by_all_three(world: MeshWorld) -> None:
    for path in (PERM, CHAIN):
        found, exact = checker_covers(path.read_text(), world)
        assert found == exact == set(), (path.name, world)


@pytest.mark.parametrize("world", SHAPES, ids=str)
def test_a_ring_of_wait_firsts_along_an_axis_deadlocks(world: MeshWorld) -> None:
    text = CHAIN.read_text().replace(", wrap: false", "")
    found, _ = checker_covers(text, world)
    assert ("deadlock", "cycle", "send", "receive", "send") in found
    report = hb.check(parse_text(text, "s.yaml", world), [world])
    dead = next(f for f in report.findings if f.kind == "deadlock")
    assert "cycle of waits" in dead.message
    assert dead.mark.line == next(i for i, t in enumerate(text.splitlines(), 1)
                                  if "receive:" in t)


def test_a_wait_first_along_an_axis_whose_team_divides_the_offset_is_located() -> None:
    """At G=2 a shift by 2 along gpu is a local copy: made at the put, after the wait."""
    text = CHAIN.read_text().replace("offset: next, wrap: false", "offset: 2")
    schedule = parse_text(text, "s.yaml")
    found = [d for d in structural.check(schedule, [MeshWorld((3, 2))])
             if d.severity == "error"]
    assert [d.code for d in found] == ["wait-first-span"]
    assert "at W=6 the shift by 2 is a local copy" in found[0].message


LOOP = HEAD + """\
  - ring:
      repeat: G - 1
      as: h
      steps:
        - hop:  {op: shift, axis: gpu, src: x, dst: y, perm: "(r + h + 1) % W"}
        - use:  {op: external, reads: [y], writes: [z]}
        - done: {op: barrier, axis: gpu}
"""


@pytest.mark.parametrize("world", SHAPES, ids=str)
def test_a_ring_pass_by_perm_along_an_axis_reads_the_hop_index(world: MeshWorld) -> None:
    """A ring along gpu by perm (hop h: member r -> r + h + 1 mod G), freed by a barrier
    of the team: proved; without it the next hop's store races the read."""
    g = world.shape[1]
    tables = [s.op.perm for s in parse_text(LOOP, world=world).step_list()
              if s.kind == "shift"]
    t = torus(world.shape)
    assert tables == [[t.team(r, (1,))[(t.member(r, (1,)) + h + 1) % g]
                       for r in range(t.size)] for h in range(g - 1)]
    assert checker_covers(LOOP, world) == (set(), set())
    if g > 2:
        found, exact = checker_covers(LOOP.replace("        - done: {op: barrier, axis: gpu}\n",
                                                   ""), world)
        assert ("race", "write-after-read", "y", "use_h0", "hop_h1") in exact & found


# --- the float64 reference and the runs ----------------------------------------------------

def test_the_reference_moves_src_to_the_member_the_perm_names_in_each_team() -> None:
    world = MeshWorld((2, 3))
    schedule = parse_text(_one("gpu", "[[0, 2], [2, 1]]").replace("T: 4, D: 2", "T: 4, D: 40")
                          .replace("  - use:", "  - use_:").replace("reads: [y]", "reads: [x]"),
                          world=world)
    gen = torch.Generator().manual_seed(7)
    inputs = [{"x": simulate.as_stored(schedule, "x", torch.randn(
        4, 40, generator=gen, dtype=torch.float64))} for _ in range(6)]
    out = simulate.simulate_call(schedule, world, {"T": 4, "D": 40, "N": 2, "G": 3}, inputs,
                                 lambda step, rank, bufs: {"z": bufs["x"] * 1})
    for node in (0, 1):  # gpu 0 -> gpu 2 -> gpu 1 inside each node; gpu 0 gets nothing
        base = 3 * node
        assert torch.equal(out[base + 2]["y"], inputs[base + 0]["x"])
        assert torch.equal(out[base + 1]["y"], inputs[base + 2]["x"])
        assert "y" not in out[base + 0]


def test_the_reference_runs_each_team_s_chain_in_order() -> None:
    world = MeshWorld((2, 3))
    schedule = parse_file(CHAIN, world)
    sizes = {"T": 2, "D": 40, "N": 2, "G": 3}
    inputs = [{"x": torch.full((2, 40), float(r), dtype=torch.float64)} for r in range(6)]

    def external(step, rank, bufs):  # each stage adds 10 to what it received
        if step.name == "first":
            return {"act": bufs["x"] * 1}
        if step.name == "stage":
            return {"act": bufs["recv"] + 10}
        return {"out": bufs["act"] * 1}

    out = simulate.simulate_call(schedule, world, sizes, inputs, external)
    for node in (0, 1):  # gpu g of node n holds node n's gpu-0 input + 10 g
        for gpu in range(3):
            assert torch.equal(out[3 * node + gpu]["act"],
                               torch.full((2, 40), 3.0 * node + 10 * gpu,
                                          dtype=torch.float64)), (node, gpu)


@pytest.mark.parametrize("path", [PERM, CHAIN], ids=lambda p: p.stem)
def test_traced_kernels_store_into_the_team_peer_only(path: Path) -> None:
    """The Triton kernels (interpreter) store into the ranks the table over ranks names
    (TO and FROM are global ranks, indexed by the rank: no template change)."""
    run = tr.run_traced(str(path), MeshWorld((2, 3)), programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


# Both files run on the host backend at 2x2 and 2x3 in tests/ops/test_op_schedules.py
# (every rank of every call compared or kept); which ranks receive is the float64
# reference's, the same on every backend: the torch backend here.
@pytest.mark.e2e
@pytest.mark.parametrize("world", SHAPES[:2], ids=str)
@pytest.mark.parametrize("backend", ["torch"])
@pytest.mark.parametrize("path", [PERM, CHAIN], ids=lambda p: p.stem)
def test_dcpc_run_along_an_axis_matches_float64(path: Path, world: MeshWorld,
                                                 backend: str) -> None:
    ranks = int(world)
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=3, seed=5)
    if path == PERM:
        assert report.outputs["mirror"].compared == 3 * ranks, text
        assert report.outputs["across"].compared == 3 * ranks, text
    else:  # every gpu but gpu 0 of each node receives (and computes from it)
        assert report.outputs["recv"].compared == 3 * (ranks - world.shape[0]), text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_checker_covers_both_exact_models_on_random_mesh_schedules_with_perms(
        data: st.DataObject) -> None:
    """Shifts along an axis by offset or by a perm (member indices), gathers, barriers and
    credits over teams, at each small mesh: every race the brute force and the execution
    oracle find, the checker reports, and their deadlocks agree (a perm's wait orders
    nothing in the checker: it may report more, never fewer)."""
    text = random_mesh_schedule_text(data.draw, st, shifts=True, perms=True)
    for world in SHAPES:
        errors = _errors(text, world)
        assume(not any(d.code == "read-before-write" for d in errors))
        assert errors == [], text
        checker_covers(text, world)


def test_a_perm_along_a_misspelt_axis_is_unknown_axis() -> None:
    (err,) = _errors(_one("gpuu", '"W - 1 - r"'), MeshWorld((2, 2)))
    assert err.code == "unknown-axis" and err.hint == "did you mean 'gpu'?"
    assert "runs over axis 'gpuu', but the mesh's axes are node, gpu" in err.message


PERM_CHAIN = CHAIN.read_text().replace("offset: next, wrap: false", 'perm: "r + 1"')


@pytest.mark.parametrize("world", SHAPES, ids=str)
def test_a_wait_first_perm_chain_along_an_axis_is_proved_and_its_ring_deadlocks(
        world: MeshWorld) -> None:
    assert checker_covers(PERM_CHAIN, world) == (set(), set())
    ring = PERM_CHAIN.replace('perm: "r + 1"', 'perm: "(r + 1) % W"')
    found, _ = checker_covers(ring, world)
    assert ("deadlock", "cycle", "send", "receive", "send") in found


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["host", "torch"])
def test_dcpc_run_of_a_wait_first_perm_chain_along_an_axis_matches_float64(
        tmp_path: Path, backend: str) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(PERM_CHAIN)
    report, text = run_clean(schedule=str(path), world=MeshWorld((2, 3)), backend=backend,
                             calls=2, seed=6)
    assert report.outputs["recv"].compared == 2 * 4, text


def test_a_perm_s_deltas_at_a_mesh_shape_are_not_those_of_its_w() -> None:
    """A mesh shape equals its W as an int (MeshWorld): the checker's cached deltas of a
    perm were served across the two (the mirror of 6 ranks as rank offsets mod 6 at
    2x3), and races of the mesh were missed when a plain W=6 had been checked first."""
    from dcpc.check.hb.events import peer_deltas
    from dcpc.ops.common import perm_peers

    mirror = perm_peers((5, 4, 3, 2, 1, 0))
    plain = peer_deltas(mirror, 6)
    mesh = peer_deltas(mirror, MeshWorld((2, 3)))
    t = torus((2, 3))
    assert plain == {(d - r) % 6 for r, d in enumerate(range(5, -1, -1))} - {0}
    assert mesh == {t.sub(d, r) for r, d in enumerate(range(5, -1, -1))} - {0}
    assert plain != mesh


@pytest.mark.e2e
@pytest.mark.parametrize("backend", [{"node": "torch", "gpu": "host"},
                                     {"node": "host", "gpu": "torch"}], ids=str)
@pytest.mark.parametrize("path", [PERM, CHAIN, PAIR], ids=lambda p: p.stem)
def test_dcpc_run_with_a_backend_per_axis_matches_float64(path: Path, backend: dict) -> None:
    """Each axis on its own kind: a torch step's team settles (a barrier) after it, but
    not after either half of a wait written before its put (its later members still
    wait for this rank's puts: the chain would deadlock; with two interleaved pairs the
    first put's barrier waited for a member blocked in the second receive)."""
    world = MeshWorld((2, 3))
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=3, seed=7)
    outs = {PERM: ["mirror"], CHAIN: ["recv"], PAIR: ["ra", "rb"]}[path]
    for out in outs:  # PERM: every rank receives; a chain: the 4 members with a source
        assert report.outputs[out].compared == 3 * (6 if path == PERM else 4), text


CROSS = ROOT / "tests" / "mesh_backends" / "wait_first_cross_axes.yaml"
# the node chain run backwards (offset prev: the last node starts it)
CROSS_BACK = CROSS.read_text().replace(
    "axis: node, src: aux, dst: rb, offset: next", "axis: node, src: aux, dst: rb, offset: prev"
).replace('"node == 0"', '"node == N - 1"').replace('"node > 0"', '"node < N - 1"').replace(
    "axis: node, to: prev", "axis: node, to: next").replace(
    "axis: node, from: next", "axis: node, from: prev")


def _cross(which: str) -> str:
    return CROSS.read_text() if which == "forward" else CROSS_BACK


@pytest.mark.parametrize("world", SHAPES + [MeshWorld((3, 3))], ids=str)
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_pairs_along_two_axes_interleave(which: str, world: MeshWorld) -> None:
    """Two chains along axes apart (gpu, node; either direction) close no cycle: an edge
    along node keeps the gpu coordinate, so a cycle would be one of the gpu line alone.
    Interleaved, they are proved by the checker, the brute force and the execution
    oracle alike (the review's UnwrittenRead: the reference now takes each wait's own
    sources, a rank after all of them)."""
    assert CROSS_BACK.count("offset: prev") == 2
    assert _errors(_cross(which), world) == []
    assert checker_covers(_cross(which), world) == (set(), set())


@pytest.mark.e2e
@pytest.mark.parametrize("world", SHAPES[:2], ids=str)
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_dcpc_run_of_pairs_along_two_axes_matches_float64(
        which: str, world: MeshWorld, tmp_path: Path) -> None:
    path = tmp_path / f"{which}.yaml"
    path.write_text(_cross(which))
    report, text = run_clean(schedule=str(path), world=world, backend="host", calls=3,
                             seed=9)
    n, g = world.shape  # ra: all but gpu 0 of each node; rb: all but one node's ranks
    assert report.outputs["ra"].compared == 3 * n * (g - 1), text
    assert report.outputs["rb"].compared == 3 * (n - 1) * g, text


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", {"node": "torch", "gpu": "host"}], ids=str)
def test_dcpc_run_of_pairs_along_two_axes_on_gloo_matches_float64(backend: Any) -> None:
    """The two chains on gloo (each on its team's group), and the node chain on gloo
    beside the gpu chain's host kernels."""
    report, text = run_clean(schedule=str(CROSS), world=MeshWorld((2, 3)), backend=backend,
                             calls=3, seed=10)
    assert report.outputs["ra"].compared == 3 * 2 * 2, text
    assert report.outputs["rb"].compared == 3 * 1 * 3, text


# two chains on a common axis that close a cycle: (a) the gpu line and the gpu line
# backwards; (b) the gpu line and a perm over the whole mesh (both axes) that sends
# each odd gpu back to its even one (2x2: ranks 1 -> 0 and 3 -> 2)
ON_ONE_AXIS = {
    "gpu backwards": CROSS.read_text().replace(
        "axis: node, src: aux, dst: rb, offset: next", "axis: gpu, src: aux, dst: rb, "
        "offset: prev"),
    "whole-mesh perm": CROSS.read_text().replace(
        "axis: node, src: aux, dst: rb, offset: next, wrap: false",
        "src: aux, dst: rb, perm: [-1, 0, -1, 2]")}


@pytest.mark.parametrize("case", sorted(ON_ONE_AXIS))
def test_pairs_on_a_common_axis_that_deadlock_are_refused_located(case: str) -> None:
    """Refused (wait-first-span, at the first wait: the span run rank by rank hangs,
    with the cycle of waits); without the refusal the brute force and the execution
    oracle both find the deadlock the happens-before model (which drops each chain's
    wait edges) would miss."""
    text, world = ON_ONE_AXIS[case], MeshWorld((2, 2))
    found = [d for d in _errors(text, world) if d.code == "wait-first-span"]
    first = next(d for d in found if "'wa' waits before its put 'pa'" in d.message)
    assert first.mark.line == next(i for i, t in enumerate(text.splitlines(), 1)
                                   if "- wa:" in t)
    assert ("at W=4 (mesh 2x2), hangs: rank 0 waits at 'wb' for rank 1's 'pb'; rank 1 "
            "waits at 'wa' for rank 0's 'pa' (the cycle of waits 0 -> 1 -> 0)") in first.message
    assert "each its own span" in first.hint
    schedule = parse_text(text, "s.yaml", world)
    dead = {k for k in oracle_keys(schedule, world) if k[0] == "deadlock"}
    assert ("deadlock", "cycle", "pa", "wa", "pa") in dead, dead
    run = explore(lower(schedule, [world]), world, channels=channel_names(schedule))
    assert run.hung


PAIR_TWO_WAYS = "".join(
    ln.replace("offset: next, wrap: false", 'perm: "r + 1"') if "src: aux" in ln else ln
    for ln in PAIR.read_text().splitlines(keepends=True))


@pytest.mark.parametrize("world", SHAPES, ids=str)
def test_one_chain_along_an_axis_written_two_ways_interleaves(world: MeshWorld) -> None:
    """The second pair by the member perm r + 1 along gpu, the first by 'offset: next,
    wrap: false': the same edges in every team, so one chain, proved by all three."""
    assert PAIR_TWO_WAYS.count('perm: "r + 1"') == 2
    assert _errors(PAIR_TWO_WAYS, world) == []
    assert checker_covers(PAIR_TWO_WAYS, world) == (set(), set())


@pytest.mark.e2e
@pytest.mark.parametrize("world", SHAPES[:2], ids=str)
def test_dcpc_run_of_one_chain_along_an_axis_written_two_ways_matches_float64(
        tmp_path: Path, world: MeshWorld) -> None:
    path = tmp_path / "two_ways.yaml"
    path.write_text(PAIR_TWO_WAYS)
    report, text = run_clean(schedule=str(path), world=world, backend="host", calls=2,
                             seed=8)
    for out in ("ra", "rb"):  # the members with a source: all but gpu 0 of each node
        assert report.outputs[out].compared == 2 * (int(world) - world.shape[0]), text


def test_a_perm_along_an_axis_without_a_mesh_is_an_unknown_axis() -> None:
    """Review: with no 'mesh:' a perm along 'gpu' was an internal error (ValueError)."""
    text = ("schedule: s\nslots: 1\nsizes: {T: 4}\nbuffers:\n"
            "  kv: {shape: [T], dtype: f32}\n"
            "  m: {shape: [T], dtype: f32, symmetric: true}\n"
            "steps:\n"
            '  - send: {op: shift, axis: gpu, src: kv, dst: m, perm: "W - 1 - r"}\n'
            "  - done: {op: barrier}\n")
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", 4)
    (d,) = err.value.diagnostics
    col = text.splitlines()[7].index("gpu") + 1
    assert d.code == "unknown-axis" and (d.mark.line, d.mark.col) == (8, col), d
    assert "declares no 'mesh:' (its one axis is 'world')" in d.message
    parse_text(text.replace("axis: gpu", "axis: world"), "s.yaml", 4)  # the one axis


SEVERAL = ROOT / "tests" / "mesh_backends" / "wait_first_several_axes.yaml"


def test_a_perm_over_two_axes_interleaves_with_a_chain_along_the_third() -> None:
    """A wait-first perm over [a, b] and a wait-first chain along c, interleaved, at
    2x2x2: proved, and the brute force and the execution oracle find nothing; so is the
    same chain along b (an axis the perm spans: refused before as another chain on a
    common axis; both move forward in member order, so no cycle, issue 33's gap (a))."""
    world = MeshWorld((2, 2, 2))
    text = SEVERAL.read_text()
    assert _errors(text, world) == []
    assert checker_covers(text, world) == (set(), set())
    along_b = (text.replace("axis: c,", "axis: b,").replace('"c == 0"', '"b == 0"')
               .replace('"c > 0"', '"b > 0"'))
    assert _errors(along_b, world) == []
    assert checker_covers(along_b, world) == (set(), set())
