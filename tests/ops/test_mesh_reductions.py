"""all_reduce (sum, max, lse), broadcast, reduce and all_to_all's split_dim/concat_dim form
over a team (issue 33 item 1): `axis:` runs the op within each team separately, `root`
is a member index of the team, a split/concat exchange splits in G parts. The
float64 reference says so on values written by hand; the checker proves the
conformance files at several mesh shapes and finds a team's missing credit (with the
brute force and the execution oracle agreeing on random mesh schedules); the kernels
and gloo match float64 at 2x2 and 2x3 (the host backend: tests/ops/test_op_schedules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.exec_oracle_agree import disagreements
from support.hb_oracle import MESH_SHAPES as SHAPES
from support.hb_oracle import oracle_keys, random_mesh_schedule_text

from dcpc.check import hb, structural
from dcpc.cli import main
from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import returned_names
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "schedules" / "ops" / f"{op}_axis.yaml"
         for op in ("all_reduce", "all_reduce_lse", "broadcast", "reduce", "all_to_all_concat")]

HEAD = """\
schedule: teams
mesh: {node: N, gpu: G}
sizes: {T: 2, D: 4}
buffers:
  x:   {shape: [T, D], dtype: f32}
  s:   {shape: [T, D], dtype: f32}
  b:   {shape: [T, D], dtype: f32, symmetric: true}
  r:   {shape: [T, D], dtype: f32}
  v:   {shape: [G, T, D], dtype: f32, symmetric: true}
  y:   {shape: [T, D], dtype: f32}
  c:   {shape: [T, G], dtype: f32}
  ch:  {shape: [G*T, 1], dtype: f32, symmetric: true}
steps:
"""


def _errors(text: str, shapes: list[int] | None = None) -> list:
    schedule = parse_text(text, "t.yaml")
    return [d for d in structural.check(schedule, shapes or SHAPES) if d.severity == "error"]


def test_the_reference_runs_each_team_on_its_own_with_root_a_member_index() -> None:
    """On 2x3 (node x gpu): the sum over gpu is each node's own, the broadcast from root 1
    hands gpu 1's x to its node only, and the reduce lands on gpu 2 of each node."""
    text = HEAD + ("  - total: {op: all_reduce, axis: gpu, src: x, dst: s, via: v}\n"
                   "  - bcast: {op: broadcast, axis: gpu, src: x, dst: b, root: 1}\n"
                   "  - red:   {op: reduce, axis: gpu, src: x, dst: r, root: 2}\n")
    schedule = parse_text(text, "t.yaml")
    world = MeshWorld((2, 3))
    assert _errors(text, [world]) == []
    inputs = [{"x": torch.full((2, 4), float(10 * r + 1), dtype=torch.float64)}
              for r in range(6)]
    out = simulate.simulate_call(schedule, world, {"N": 2, "G": 3, "T": 2, "D": 4}, inputs,
                                 lambda step, rank, bufs: {})
    for r in range(6):
        n, g = divmod(r, 3)
        node = [inputs[n * 3 + k]["x"] for k in range(3)]
        assert torch.equal(out[r]["s"], sum(node)), r
        assert torch.equal(out[r]["v"], torch.stack(node)), r  # via[member]
        assert torch.equal(out[r]["b"], inputs[n * 3 + 1]["x"]), r
        assert torch.equal(out[r]["r"], sum(node) if g == 2 else torch.zeros(2, 4,
                                                                        dtype=torch.float64)), r


def test_a_split_concat_exchange_over_a_team_moves_member_p_s_part_to_block_p() -> None:
    """On 2x3 over gpu: c [T, G] split in G parts along dim 1; rank (n, g)'s ch [G*T, 1]
    holds member p's column g at rows p*T .. p*T + T-1, members of its own node only."""
    text = HEAD + ("  - a2a: {op: all_to_all, axis: gpu, src: c, dst: ch, split_dim: 1, "
                   "concat_dim: 0}\n")
    schedule, world = parse_text(text, "t.yaml"), MeshWorld((2, 3))
    assert _errors(text, [world]) == []
    inputs = [{"c": torch.arange(6, dtype=torch.float64).view(2, 3) + 100 * r} for r in range(6)]
    out = simulate.simulate_call(schedule, world, {"N": 2, "G": 3, "T": 2, "D": 4}, inputs,
                                 lambda step, rank, bufs: {})
    for r in range(6):
        n, g = divmod(r, 3)
        want = torch.cat([inputs[n * 3 + p]["c"][:, g:g + 1] for p in range(3)])
        assert torch.equal(out[r]["ch"], want), r


def test_dcpc_check_proves_the_team_files_at_several_mesh_shapes() -> None:
    """And the brute force (teams computed on its own) finds no race in them either."""
    for path in FILES:
        got = CliRunner().invoke(main, ["check", str(path), "--world", "2x2,2x3,3x2,3x3,2x4"])
        assert got.exit_code == 0, got.output
        assert f"{path}: ok (W " in got.output, got.output
        for world in SHAPES:
            assert oracle_keys(parse_file(path, world), world) == set(), (path, world)


def test_a_team_root_is_checked_against_the_smallest_team() -> None:
    """root 2 over gpu fits a 2x3 mesh (3 gpus) but not 3x2; over node the other way
    round; without axis a root stays a rank of the group (4 fits 2x3, not 2x2)."""
    step = "  - red: {op: reduce, axis: AXIS, src: x, dst: r, root: 2}\n"
    on_gpu, on_node = (HEAD + step.replace("AXIS", a) for a in ("gpu", "node"))
    small, wide, tall = MeshWorld((2, 2)), MeshWorld((2, 3)), MeshWorld((3, 2))
    assert _errors(on_gpu, [wide]) == [] and _errors(on_node, [tall]) == []
    (err,) = _errors(on_gpu, [wide, tall])
    assert err.code == "root-out-of-range" and err.mark.line == on_gpu.count("\n")
    assert "its team has only 2 ranks at W=3x2" in err.message and "over gpu" in err.message
    (err,) = _errors(on_node, [wide, tall])
    assert "its team has only 2 ranks at W=2x3" in err.message and "over node" in err.message
    whole = HEAD + "  - bc: {op: broadcast, src: x, dst: b, root: 4}\n"
    assert _errors(whole, [wide]) == []
    (err,) = _errors(whole, [small, wide])
    assert err.code == "root-out-of-range" and "at W=2x2" in err.message  # the whole group
    assert "only 4 ranks at W=2x2" in err.message  # its rank count, not the shape
    (err,) = _errors(on_gpu, [MeshWorld((2, 1)), wide])
    assert "its team has only 1 rank at W=2x1" in err.message


def test_a_team_s_via_is_sized_by_the_team() -> None:
    """via: [G, *src] over gpu; over node it must be [N, *src]: a shape-mismatch."""
    assert _errors(HEAD + "  - t: {op: all_reduce, axis: gpu, src: x, dst: s, via: v}\n") == []
    (err,) = _errors(HEAD + "  - t: {op: all_reduce, axis: node, src: x, dst: s, via: v}\n")
    assert err.code == "shape-mismatch" and "'v'" in err.message


TWINS = {  # op: its steps, and the races (buffer, first, second) a credit over node leaves
    "all_reduce": ("  - total: {op: all_reduce, axis: gpu, reduce: max, src: x, dst: s, via: v}\n"
                   "  - use:   {op: external, reads: [v], writes: [y]}\n",
                   {("v", "use", "total"), ("v", "total", "total")}),
    "broadcast": ("  - bcast: {op: broadcast, axis: gpu, src: x, dst: b, root: 1}\n"
                  "  - use:   {op: external, reads: [b], writes: [y]}\n",
                  {("b", "use", "bcast"), ("b", "bcast", "bcast")}),  # the engine reads what
    # a step returns, at its return: the next call's pushes may land before it
    "all_to_all": ("  - a2a:   {op: all_to_all, axis: gpu, src: c, dst: ch, split_dim: 1, "
                   "concat_dim: 0}\n  - use:   {op: external, reads: [ch], writes: [y]}\n",
                   {("ch", "use", "a2a"), ("ch", "a2a", "a2a")}),
    "reduce": ("  - red:   {op: reduce, axis: gpu, src: x, dst: r, root: 1}\n",
               {("red_recv", "red", "red")}),  # the root's read of its via, the next push
}


@pytest.mark.parametrize("op", list(TWINS))
def test_a_team_buffer_reused_without_its_team_s_credit_is_a_race(op: str,
                                                                  tmp_path: Path) -> None:
    """What the team reads after the step (the via, the broadcast's dst, the root's
    receive buffer) must be read by every member before the next call's pushes into it: a
    barrier over gpu (the op's team) orders them; one over node orders other ranks, so
    the race stays, found by the checker, the brute force and the execution oracle
    alike, and `dcpc check` refuses the file with its class."""
    steps, races = TWINS[op]
    fixed, wrong = (parse_text(HEAD + steps + f"  - free:  {{op: barrier, axis: {a}}}\n",
                               "c.yaml") for a in ("gpu", "node"))
    for world in SHAPES:
        assert hb.check(fixed, [world], hints=False).findings == []
        assert oracle_keys(fixed, world) == set()
        keys = {f.key for f in hb.check(wrong, [world], hints=False).findings}
        assert keys == oracle_keys(wrong, world) == {
            ("race", "write-after-read", *race) for race in races}, world
    assert disagreements(wrong, SHAPES[:2]) == []
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + steps + "  - free:  {op: barrier, axis: node}\n")
    got = CliRunner().invoke(main, ["check", "--world", "2x2", str(path)])
    assert got.exit_code != 0 and "[race]" in got.output, got.output
    assert all(f"race on {buffer}:" in got.output for buffer, _, _ in races), got.output


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_brute_force_agree_on_random_mesh_schedules_with_reductions(
        data: st.DataObject) -> None:
    """all_reduce, broadcast (root 0 or 1) and reduce over axis a, b or both, among
    gathers, barriers and credits: the checker's team regions and root effects agree with
    the brute force, whose root is the team's member ``root`` written from the language."""
    text = random_mesh_schedule_text(data.draw, st, reductions=True)
    schedule = parse_text(text)
    assert [d for d in structural.check(schedule, SHAPES) if d.severity == "error"] == [], text
    for world in SHAPES:
        found = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert found == oracle_keys(schedule, world), (text, world)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_checker_and_execution_oracle_agree_on_random_mesh_schedules_with_reductions(
        data: st.DataObject) -> None:
    text = random_mesh_schedule_text(data.draw, st, reductions=True)
    schedule = parse_text(text)
    assert [d for d in structural.check(schedule, SHAPES) if d.severity == "error"] == [], text
    assert disagreements(schedule, SHAPES[:2]) == [], text


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "world", "backend"), [
    (p, w, b) for p in FILES for w, b in (((2, 2), "torch"), ((2, 3), "torch"),
                                          ((2, 2), "local"))],
    ids=lambda v: getattr(v, "stem", str(v)))
def test_the_team_files_match_float64(path: Path, world: tuple[int, int], backend: str) -> None:
    """On gloo (one process group per team) and on the local backend (the kernels,
    ranks as threads); the host backend runs them in tests/ops/test_op_schedules.py."""
    w = MeshWorld(world)
    report = run_schedule(RunConfig(schedule=str(path), world=w, backend=backend, calls=3,
                                    seed=5))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for names in returned_names(parse_file(path, w), w).values():
        for name in names:
            assert report.outputs[name].compared == 3 * int(w), (name, text)


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["local", "host"])
def test_a_team_merge_masked_by_local_seq_lens_runs(backend: str) -> None:
    """An lse all_reduce over one axis masked by `local_seq_lens` ([B, G]: one column per
    team member) could not be run: the synthetic inputs made it [B, W] and the engine
    step's garbage rows were chosen by global rank (an independent review, 2026-12-04).
    At 3x2 (G = 3 of W = 6 along node)."""
    path = Path(__file__).resolve().parents[1] / "mesh_cases" / "team_local_lens.yaml"
    report = run_schedule(RunConfig(schedule=str(path), world=MeshWorld((3, 2)),
                                    backend=backend, calls=3, seed=5))
    assert report.launch.ok and report.mismatches == 0, format_report(report)
    assert report.outputs["out"].compared == 3 * 6


@pytest.mark.e2e
def test_a_sum_that_a_move_carries_is_compared_as_a_sum() -> None:
    """The two-level all-reduce (reduce over gpu, all_reduce over node, broadcast over
    gpu): the broadcast moves a sum, whose fp32 order differs from float64's by an ulp.
    It was compared bit for bit as a move: 18 mismatches at 2x3 (max abs err 4.8e-7),
    on a schedule that is right; what a move carries is compared as its producer's."""
    path = Path(__file__).resolve().parents[1] / "mesh_cases" / "hier_allreduce.yaml"
    report = run_schedule(RunConfig(schedule=str(path), world=MeshWorld((2, 3)),
                                    backend="host", calls=4, seed=0))
    assert report.launch.ok and report.mismatches == 0, format_report(report)
    assert report.outputs["y"].compared == 4 * 6
