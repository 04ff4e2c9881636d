"""Mesh axes in the language (issue 21 item 1): `mesh:`, `axis:`, team shape rules,
located errors, `--world AxB`, and the one-axis equivalence (a schedule without
`mesh:`, or with a mesh of one axis, means exactly what it meant)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from dcpc import pipeline
from dcpc.check import hb, structural
from dcpc.cli import main, parse_worlds
from dcpc.diagnostics import DiagnosticError
from dcpc.lang.mesh import MeshWorld, Torus, WorldError, fit_worlds, mesh_of
from dcpc.lang.parse import parse_text
from dcpc.lang.semantics import table

ROOT = Path(__file__).resolve().parents[2]

HEAD = """\
schedule: m
mesh: {node: N, gpu: G}
sizes:
  N: {max: 4}
  T: {max: 8}
  D: 4
buffers:
  x:  {shape: [T, D], dtype: f32}
  gg: {shape: [G*T, D], dtype: f32, symmetric: true}
  gn: {shape: [N*T, D], dtype: f32, symmetric: true}
  gw: {shape: [W*T, D], dtype: f32, symmetric: true}
  y:  {shape: [T, D], dtype: f32}
steps:
"""


def shapes(*items: tuple[int, ...]) -> list[int]:
    return [MeshWorld(s) for s in items]


def errors(text: str, worlds: list[int] | None = None) -> list[tuple[str, int, int, str]]:
    """(code, line, col, message) of every structural error."""
    schedule = parse_text(text, "t.yaml")
    found = structural.check(schedule, worlds or shapes((2, 2), (2, 3)))
    return [(d.code, d.mark.line, d.mark.col, d.message) for d in found
            if d.severity == "error"]


def test_a_team_op_uses_its_team_size_in_the_shape_rules() -> None:
    ok = HEAD + ("  - a: {op: all_gather, axis: gpu, src: x, dst: gg}\n"
                 "  - b: {op: all_gather, axis: node, src: x, dst: gn}\n"
                 "  - c: {op: all_gather, src: x, dst: gw}\n"
                 "  - d: {op: all_gather, axis: [node, gpu], src: x, dst: gw}\n")
    assert errors(ok) == []
    wrong = HEAD + "  - a: {op: all_gather, axis: node, src: x, dst: gg}\n"
    (found,) = errors(wrong)
    assert found[:3] == ("shape-mismatch", 14, 50)  # dst of the step (1-based column)
    assert "gg" in found[3] and "W=2x3" in found[3]


def test_bad_axes_get_located_errors() -> None:
    text = HEAD + ("  - a: {op: all_gather, axis: [gpu, gpux], src: x, dst: gg}\n"
                   "  - b: {op: all_gather, axis: [gpu, gpu], src: x, dst: gg}\n"
                   "  - c: {op: copy, axis: gpu, src: x, dst: y}\n"
                   "  - d: {op: signal, to: next, channel: r}\n"
                   "  - e: {op: wait, from: prev, channel: r}\n")
    found = errors(text)
    codes = {(code, line) for code, line, _, _ in found}
    assert ("unknown-axis", 14) in codes and ("duplicate-axis", 15) in codes
    assert ("axis-on-local-op", 16) in codes
    assert ("axis-required", 17) in codes and ("axis-required", 18) in codes
    unknown = next(f for f in found if f[0] == "unknown-axis")
    assert unknown[2] == 37 and "'gpux'" in unknown[3] and "node, gpu" in unknown[3]
    plain = parse_text("schedule: p\nbuffers: {x: {shape: [4], dtype: f32},\n"
                       "  g: {shape: [4*W], dtype: f32, symmetric: true}}\n"
                       "steps:\n  - a: {op: all_gather, axis: gpu, src: x, dst: g}\n", "p.yaml")
    (d,) = [d for d in structural.check(plain, [2]) if d.severity == "error"]
    assert d.code == "unknown-axis" and "declares no 'mesh:'" in d.message


ONE_COORDINATE = """\
schedule: q
mesh: {node: N, gpu: G}
sizes: {N: {max: 4}, G: {max: 4}, C: {max: 5}, H: 72}
buffers:
  x_send: {shape: [T, C, H], dtype: bf16}
  n_send: {shape: [T],       dtype: i32}
  x_rail: {shape: [T, C, H], dtype: bf16, symmetric: true}
  n_rail: {shape: [T],       dtype: i32, symmetric: true}
steps:
"""


def test_guarded_next_prev_over_two_axes_is_said_once_as_axis_required() -> None:
    """next/prev over both axes have no peers (axis-required): a when: on them is not
    matched edge by edge too (no follow-on when-on-communication from peers the mesh
    does not define; linear r + 1 would pair rank 0's signal with rank 1's wait)."""
    text = ONE_COORDINATE.replace("T", "W") + (
        '  - s: {op: signal, to: next, channel: c, when: "rank == 0"}\n'
        '  - w: {op: wait, from: prev, channel: c, when: "rank == 0"}\n')
    assert [f[:3] for f in errors(text, shapes((2, 2)))] == [
        ("axis-required", 10, 25), ("axis-required", 11, 25)]
    one = text.replace("channel: c,", "channel: c, axis: gpu,")
    assert [f[0] for f in errors(one, shapes((2, 2)))] == ["when-on-communication"]


@pytest.mark.parametrize("axis", ["", ", axis: [node, gpu]"])
def test_a_ragged_offset_over_two_axes_needs_one(tmp_path: Path, axis: str) -> None:
    """A ragged_all_to_all by offset moves one coordinate, as a signal's offset: over both
    axes of the mesh it is axis-required at its offset key (was an internal
    AssertionError of the hb checker's deltas), and 'axis: gpu', the hint, is taken."""
    steps = ("  - put:    {op: ragged_all_to_all, src: x_send, dst: x_rail, counts: n_send,"
             f" recv_counts: n_rail, capacity: C, phase: put, offset: 1{axis}}}\n"
             "  - landed: {op: ragged_all_to_all, src: x_send, dst: x_rail, counts: n_send,"
             f" recv_counts: n_rail, capacity: C, phase: wait, offset: 1{axis}}}\n")
    path = tmp_path / "q.yaml"
    path.write_text(ONE_COORDINATE.replace("T", "W") + steps)
    result = CliRunner().invoke(main, ["check", str(path), "--world", "2x2"])
    assert result.exit_code == 1 and "internal error" not in result.output, result.output
    found = re.findall(r"q\.yaml:(\d+):(\d+): error: (.*) \[(.*)\]\n  hint: (.*)",
                       result.output)
    assert [(line, code) for line, _, _, code, _ in found] == [
        ("10", "axis-required"), ("11", "axis-required")], result.output
    assert "'offset 1' peers over 2 axes (node, gpu)" in found[0][2]
    assert found[0][4].startswith("add 'axis: gpu'")
    col = path.read_text().splitlines()[9].index("offset: 1") + len("offset: ") + 1
    assert found[0][1] == str(col)
    taken = ONE_COORDINATE.replace("T", "G") + steps.replace(f"1{axis}}}", "1, axis: gpu}")
    assert not [f for f in errors(taken, shapes((2, 2))) if f[0] == "axis-required"]


@pytest.mark.parametrize(("mesh", "sizes", "words"), [
    ("{node: W, gpu: G}", "", "not a size name"),
    ("{node: 0, gpu: G}", "", "size 0"),
    ("{node: G, gpu: G}", "", "both sized by 'G'"),
    ("{node: N, gpu: G}", "  G: 4\n", "bound by the mesh shape"),
    ("{}", "", "names no axis"),
    ("{node: N, r: G}", "", "a name expressions reserve"),  # r: the rank in an index
    ("{rank: N, gpu: G}", "", "a name expressions reserve"),  # rank: in a when:
])
def test_bad_meshes_are_refused(mesh: str, sizes: str, words: str) -> None:
    text = (f"schedule: m\nmesh: {mesh}\nsizes:\n  T: 2\n{sizes}buffers:\n"
            "  x: {shape: [T], dtype: f32}\nsteps:\n  - a: {op: copy, src: x, dst: x}\n")
    schedule = parse_text(text, "t.yaml")
    found = [d for d in structural.check(schedule, [MeshWorld((2, 2))] if mesh != "{}" else [2])
             if d.code == "bad-mesh"]
    assert found and any(words in d.message for d in found), found
    assert all(d.mark.line >= 2 for d in found)


TWO_LEVEL = HEAD + ("  - in_node: {op: all_gather, axis: gpu, src: x, dst: gg}\n"
                    "  - nodes:   {op: all_gather, axis: node, src: x, dst: gn}\n"
                    "  - all:     {op: all_gather, src: x, dst: gw}\n"
                    "  - use:     {op: external, reads: [gg, gn, gw], writes: [y]}\n"
                    "  - sync:    {op: barrier}\n")


def test_group_sizes_must_fit_the_mesh() -> None:
    schedule = parse_text(TWO_LEVEL, "t.yaml")
    (d,) = structural.check(schedule, [4])
    assert d.code == "bad-world" and "node x gpu" in d.message and d.mark.line == 2
    plain = parse_text((ROOT / "schedules" / "kimi_k3_dcp.yaml").read_text())
    (d,) = structural.check(plain, shapes((2, 2)))
    assert d.code == "bad-world" and "declares no 'mesh:'" in d.message
    # a mesh size past its max is located at the max
    found = structural.check(schedule, shapes((5, 2)))
    assert [(d.code, d.mark.line) for d in found if d.severity == "error"] == [
        ("empty-size-range", 4)]


def test_world_texts_give_mesh_shapes() -> None:
    assert [str(w) for w in parse_worlds("2..3x4")] == ["2x4", "3x4"]
    assert [str(w) for w in parse_worlds("2x2,2x4")] == ["2x2", "2x4"]
    assert parse_worlds("2..4") == [2, 3, 4]
    mesh = mesh_of(parse_text("schedule: s\nmesh: {cp: P}\nbuffers: {x: {shape: [P], "
                              "dtype: f32}}\nsteps:\n  - a: {op: copy, src: x, dst: x}\n"))
    assert fit_worlds(mesh, [3]) == [MeshWorld((3,))]  # one axis: a plain W fits
    fixed = mesh_of(parse_text("schedule: s\nmesh: {node: 2, gpu: G}\nbuffers: {x: {shape: "
                               "[G], dtype: f32}}\nsteps:\n  - a: {op: copy, src: x, dst: x}\n"))
    assert fit_worlds(fixed, [MeshWorld((2, 3))]) == [MeshWorld((2, 3))]
    with pytest.raises(WorldError, match="fixes it at 2"):
        fit_worlds(fixed, [MeshWorld((3, 3))])
    result = CliRunner().invoke(main, ["check", "x.yaml", "--world", "2x0"])
    assert result.exit_code == 2 and "positive" in result.output


def test_dcpc_check_takes_mesh_shapes(tmp_path: Path) -> None:
    path = tmp_path / "two_level.yaml"
    path.write_text(TWO_LEVEL)
    result = CliRunner().invoke(main, ["check", str(path), "--world", "2x2,2x3"])
    assert result.exit_code == 0, result.output
    assert "W 2x2..3" in result.output  # exactly the shapes asked, in --world syntax
    result = CliRunner().invoke(main, ["check", str(path), "--world", "4"])
    assert result.exit_code == 1 and "[bad-world]" in result.output
    assert f"{path}:2:" in result.output
    c = pipeline.run(path, pipeline.Options(), until="check")
    assert [str(w) for w in c.worlds][:2] == ["2x2", "2x3"] and len(c.worlds) == 9


def test_torus_ranks_are_row_major_and_teams_share_the_other_coordinates() -> None:
    t = Torus((2, 3))
    assert [t.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert t.team(4, (1,)) == [3, 4, 5] and t.team(4, (0,)) == [1, 4]
    assert t.member(4, (1,)) == 1 and t.member(4, (0,)) == 1 and t.member(4, None) == 4
    assert t.deltas("next", (1,)) == {1} and t.deltas("prev", (0,)) == {3}
    assert t.add(5, 1) == 3 and t.sub(3, 1) == 5  # the gpu coordinate wraps in its node


def test_semantics_carry_the_team() -> None:
    schedule = parse_text(TWO_LEVEL)
    sems = table(schedule)
    assert sems[0].sync.axes == (1,) and sems[1].sync.axes == (0,)
    assert sems[2].sync.axes is None  # every axis: exactly as without a mesh
    assert all(e.region is None or e.region.axes is None for e in sems[2].effects)
    assert {e.region.axes for e in sems[0].effects if e.region} == {(1,)}


# --- one axis means what it meant ----------------------------------------------------

CORPUS = sorted((ROOT / "tests" / "hb_corpus").glob("*.yaml"))[::3]


def _with_one_axis(text: str) -> str:
    return re.sub(r"^(schedule: .*)$", r"\1\nmesh: {cp: MESH_P}", text, count=1, flags=re.M)


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_a_mesh_of_one_axis_keeps_every_verdict(path: Path) -> None:
    plain = parse_text(path.read_text())
    meshed = parse_text(_with_one_axis(path.read_text()))
    assert meshed.mesh == {"cp": "MESH_P"}
    worlds = [2, 3, 4, 5]
    assert ([(d.code, d.message) for d in structural.check(plain, worlds)]
            == [(d.code, d.message.replace("W=", "W=")) for d in structural.check(meshed, worlds)])
    assert table(plain) == table(meshed)
    a = {f.key for f in hb.check(plain, worlds, hints=False).findings}
    b = {f.key for f in hb.check(meshed, worlds, hints=False).findings}
    assert a == b


def test_a_schedule_without_mesh_gets_plain_group_sizes() -> None:
    c = pipeline.run(ROOT / "schedules" / "kimi_k3_dcp.yaml", pipeline.Options(), until="check")
    assert c.worlds == list(range(2, 9)) and all(type(w) is int for w in c.worlds)

    with pytest.raises(DiagnosticError) as err:
        pipeline.run(ROOT / "schedules" / "kimi_k3_dcp.yaml",
                     pipeline.Options(worlds=[MeshWorld((2, 2))]), until="check")
    assert err.value.diagnostics[0].code == "bad-world"


def test_a_team_op_splits_its_parts_by_its_team_size() -> None:
    """The lowering's part sizes of a team all_to_all / reduce_scatter / fused exchange
    use G, not W (at W=2x2, parts of W would read half of every peer's rows)."""
    from dcpc.codegen.lower import lower

    path = ROOT / "schedules" / "gallery" / "helix.yaml"
    plan = lower(parse_text(path.read_text()), [MeshWorld((2, 2))])
    by_name = {s.name: dict(s.scalars) for s in plan.steps}
    assert by_name["out_exchange"]["part_rows"][2] == ("sym", "KVP")
    assert by_name["proj_scatter"]["part"][2] == ("sym", "W")  # every axis: W
