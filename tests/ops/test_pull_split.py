"""pull's split forms (issue 33, uneven splits): a dst of src's rank splits the dim in W
parts, S // W rows each and the remainder on the last rank (``split: last``, vLLM's
cross_device_reduce_2stage rule) or equal parts that must divide (``split: even``). The
concat form reads part p out of rank p's src; ``reduce: sum`` sums this rank's part of
every rank's src from its own value on. Runs match float64 (moves bit for bit) on the
host, torch and local backends at W 2, 3, 4 with rows W does not divide; the checker, the
brute force and the execution oracle agree on the two-shot all-reduce and its racy twin;
the kernels read peers where the plan says; bad keys are located errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.exec_oracle_agree import disagreements
from support.hb_oracle import oracle_keys
from support.schedules import first_error, run_clean

from dcpc import pipeline
from dcpc.check import hb, structural
from dcpc.harness import trace as tr
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text
from dcpc.ops import OPS
from dcpc.ops.pull import parts

ROOT = Path(__file__).resolve().parents[2]
SPLIT = ROOT / "schedules" / "ops" / "pull_split.yaml"
TWO_SHOT = ROOT / "schedules" / "gallery" / "custom_all_reduce_two_shot.yaml"
TWIN = ROOT / "tests" / "gallery_twins" / "custom_all_reduce_two_shot.shared_tmp.yaml"
AXIS = ROOT / "schedules" / "ops" / "pull_split_axis.yaml"
MESHES = [MeshWorld((2, 2)), MeshWorld((2, 3)), MeshWorld((3, 2))]


def test_the_parts_are_vllm_s_floor_parts_with_the_remainder_on_the_last_rank() -> None:
    for world in range(1, 9):
        for size in range(0, 40):
            # vLLM: part = size / ngpus; start = rank * part;
            # end = rank == ngpus - 1 ? size : start + part
            part = size // world
            want = [(r * part, (size if r == world - 1 else r * part + part) - r * part)
                    for r in range(world)]
            assert parts(size, world) == want, (size, world)
            assert sum(n for _, n in want) == size


def test_a_reduce_is_compared_as_a_sum_and_a_concat_bit_for_bit() -> None:
    schedule = parse_file(SPLIT)
    steps = {s.name: s.op for s in schedule.step_list()}
    assert not OPS["pull"].moves(steps["reduce_x"]) and OPS["pull"].moves(steps["gather_x"])


@pytest.mark.parametrize("path", [SPLIT, TWO_SHOT], ids=lambda p: p.stem)
def test_proved_and_the_oracles_agree(path: Path) -> None:
    c = pipeline.run(path, pipeline.Options(worlds=list(range(2, 9))), until="hb")
    assert c.hb_report is not None and c.hb_report.findings == []
    schedule = parse_file(path)
    assert disagreements(schedule, [2, 3, 4]) == []
    for world in (2, 3, 4):
        assert oracle_keys(schedule, world) == set(), world


def test_the_shared_tmp_twin_races_and_the_oracles_agree() -> None:
    """Two slots sharing vLLM's one tmp buffer: the checker, the brute force (its own model
    of pull: every member's whole src read after the reader's wait) and the execution
    oracle (the plan's slots and epochs run) find the same races at W 2, 3, 4."""
    twin = parse_file(TWIN)
    report = hb.check(twin, [2, 3, 4], hints=False)
    keys = {f.key for f in report.findings}
    assert ("race", "write-after-read", "tmp", "gather", "reduce_part") in keys, keys
    assert {k[2] for k in keys} == {"tmp"}, keys
    for world in (2, 3, 4):
        assert oracle_keys(twin, world) == {f.key for f in hb.check(
            twin, [world], hints=False).findings}, world
    assert disagreements(twin, [2, 3, 4]) == []


def test_over_teams_proved_and_the_oracles_agree() -> None:
    """The parts of a team's split: W the team's size, r the member index; the brute
    force computes the teams on its own."""
    c = pipeline.run(AXIS, pipeline.Options(worlds=MESHES), until="hb")
    assert c.hb_report is not None and c.hb_report.findings == []
    for world in MESHES:
        schedule = parse_file(AXIS, world)
        assert oracle_keys(schedule, world) == set(), world
        assert disagreements(schedule, [world]) == [], world


def test_the_kernels_read_peers_where_the_plan_says() -> None:
    run = tr.run_traced(str(SPLIT), 3, programs=2, block=256, calls=2)
    assert run.mismatches == 0 and run.problems == [], run.problems


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [
    (2, "host"), (3, "host"), (4, "host"), (3, "torch"), (4, "torch"), (3, "local")],
    ids=str)
def test_dcpc_run_matches_float64_with_rows_w_does_not_divide(world: int,
                                                               backend: str) -> None:
    # T = 23 rows at call 0, 1 at call 1 (every part empty but the last's), then random
    report = run_schedule(RunConfig(schedule=str(SPLIT), world=world, backend=backend,
                                    calls=5, seed=11, programs=2, sizes={"T": 23}))
    text = format_report(report)
    assert report.launch.ok, text
    assert report.mismatches == 0, text
    for name in ("x_part", "y_part", "x_out", "y_out"):
        assert report.outputs[name].compared == 5 * world, (name, text)
    # the gathers move bits: bit for bit; x_part is a bf16 sum rounded once
    assert report.outputs["x_out"].max_abs_err == 0.0, text


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(3, "host"), (3, "torch"), (4, "local")],
                         ids=str)
def test_the_two_shot_all_reduce_matches_float64(world: int, backend: str) -> None:
    report, text = run_clean(schedule=str(TWO_SHOT), world=world, backend=backend, calls=4, seed=5,
                             programs=2)
    assert report.outputs["out"].compared == 4 * world, text


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [
    (MeshWorld((2, 3)), "host"), (MeshWorld((3, 2)), "torch")], ids=str)
def test_over_teams_dcpc_run_matches_float64(world: MeshWorld, backend: str) -> None:
    report, text = run_clean(schedule=str(AXIS), world=world, backend=backend, calls=4, seed=3,
                             programs=2, sizes={"T": 23})
    assert report.outputs["y_all"].compared == 4 * int(world), text
    assert report.outputs["x_gpus"].max_abs_err == 0.0, text


INT_CONCAT = """\
schedule: op_pull_split_int
sizes: {T: {max: 13}, D: 8}
buffers:
  n:     {shape: [T, D], dtype: i64}
  n_sym: {shape: [T, D], dtype: i64, symmetric: true}
  n_all: {shape: [T, D], dtype: i64}
steps:
  - stage:  {op: copy, src: n, dst: n_sym}
  - gather: {op: pull, src: n_sym, dst: n_all, split: last}
  - read:   {op: signal, to: all, channel: pulled}
  - freed:  {op: wait, from: all, channel: pulled}
"""


@pytest.mark.e2e
@pytest.mark.parametrize(("world", "backend"), [(3, "host"), (4, "torch")], ids=str)
def test_an_integer_concat_moves_bit_for_bit(world: int, backend: str,
                                            tmp_path: Path) -> None:
    """An i64 payload, 13 rows in 3 or 4 parts (the last the longer), bit for bit."""
    path = tmp_path / "op_pull_split_int.yaml"
    path.write_text(INT_CONCAT)
    report, text = run_clean(schedule=str(path), world=world, backend=backend, calls=4, seed=2,
                             programs=2, sizes={"T": 13})
    stats = report.outputs["n_all"]
    assert stats.compared == 4 * world and stats.max_abs_err == 0.0, text


HEAD = """\
schedule: s
sizes: {T: {max: 8}, D: 4, F: {multiple_of: W}}
buffers:
  x:     {shape: [T, D], dtype: f32}
  x_f:   {shape: [F, D], dtype: f32, symmetric: true}
  x_sym: {shape: [T, D], dtype: f32, symmetric: true}
  x_all: {shape: [W, T, D], dtype: f32}
  x_w:   {shape: [W*T, D], dtype: f32}
  x_q:   {shape: [F/W, D], dtype: f32}
  x_i:   {shape: [T, D], dtype: i32, symmetric: true}
  x_j:   {shape: [T, D], dtype: i32}
  x_8:   {shape: [T, D], dtype: fp8e4m3}
  x_8s:  {shape: [T, D], dtype: fp8e4m3, symmetric: true}
  x_o:   {shape: [T, D], dtype: f32}
  x_k:   {shape: [T, D], dtype: i32}
  x_9:   {shape: [T, D], dtype: fp8e4m3}
steps:
  - stage: {op: copy, src: x, dst: x_sym}
  - fill:  {op: external, writes: [x_f]}
  - cast:  {op: copy, src: x_j, dst: x_i}
  - cast8: {op: copy, src: x_8, dst: x_8s}
"""


@pytest.mark.parametrize(("step", "code", "col"), [
    # a stack has nothing to split
    ("{op: pull, src: x_sym, dst: x_all, split: last}", "bad-split", 53),
    ("{op: pull, src: x_sym, dst: x_o, split: ceil}", "bad-value", 51),
    # split: last sizes the part side for the whole dim
    ("{op: pull, src: x_sym, dst: x_w, split: last}", "shape-mismatch", 39),
    ("{op: pull, src: x_f, dst: x_q, reduce: sum, split: last}", "shape-mismatch", 37),
    # split: even: a concat is W times src, a reduce's part src / W, which must divide
    ("{op: pull, src: x_sym, dst: x_o}", "shape-mismatch", 39),
    ("{op: pull, src: x_sym, dst: x_o, reduce: sum}", "inexact-division", 27),
    ("{op: pull, src: x_sym, dst: x_all, reduce: sum}", "shape-mismatch", 39),
    ("{op: pull, src: x_i, dst: x_k, reduce: sum, split: last}", "non-float-output", 27),
    ("{op: pull, src: x_8s, dst: x_9, reduce: sum, split: last}", "bad-reduce", 51),
    ("{op: pull, src: x_sym, dst: x_o, reduce: max}", "bad-value", 52),
])
def test_bad_split_keys_are_located_errors(step: str, code: str, col: int) -> None:
    text = HEAD + f"  - pull: {step}\n"
    assert first_error(text) == [(code, text.count("\n"), col)]


def test_the_two_shot_with_equal_parts_is_refused_where_w_does_not_divide() -> None:
    """vLLM's packs (8 per token) in 3 equal parts do not divide: split: even says so,
    located at the reduce's src, naming W and the sizes; split: last takes them."""
    text = TWO_SHOT.read_text().replace(", split: last}", "}")
    found = [d for d in structural.check(parse_text(text, "t.yaml"), [2, 3, 4])
             if d.severity == "error"]
    assert found and found[0].code == "inexact-division", found
    assert "W=3" in found[0].message, found[0].message
    line = text.splitlines().index(
        next(s for s in text.splitlines() if s.startswith("  - reduce_part:"))) + 1
    assert found[0].mark.line == line, found[0]
