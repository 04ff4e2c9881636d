"""Hop loops that compose (issue 33 item 3, dcpc.lang.loops): a loop inside a loop, trip
counts, indices and offsets over a mesh's axis sizes (one schedule per mesh shape, a
module that serves that shape only), and an all_gather ``interleave`` given as a size
expression. Each is checked, its located errors asserted, and the nest and the mesh
loop run end to end on CPU against float64."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.kernels import run_ranks

from dcpc import pipeline
from dcpc.diagnostics import DiagnosticError
from dcpc.lang import loops
from dcpc.lang.parse import parse_text
from dcpc.worlds import parse_worlds

ROOT = Path(__file__).resolve().parents[2]

# two rounds, each a gather by W - 1 blocking shifts of growing offset; both hop indices
# pick the receive slice, the inner one the offset
NESTED = """\
schedule: nested_gather
slots: 1
sizes:
  N: {max: 8}
  D: 8
buffers:
  x:    {shape: [2, N, D], dtype: f32}
  recv: {shape: [8, N, D], dtype: f32, symmetric: true}
  acc:  {shape: [N, D], dtype: f32}
steps:
  - rounds:
      repeat: 2
      as: r
      steps:
        - hops:
            repeat: W - 1
            as: g
            steps:
              - send: {op: shift, src: "x[r]", dst: "recv[(W - 1) * r + g]", offset: g + 1}
              - use:  {op: external, reads: ["recv[(W - 1) * r + g]", acc], writes: [acc]}
  - done: {op: barrier}
"""

# G - 1 gathers inside the node, one slice each: the unrolled steps depend on G, not W
MESH = """\
schedule: mesh_loop
slots: 1
mesh: {node: N, gpu: G}
sizes:
  N: {max: 4}
  G: {max: 4}
  T: {max: 4}
  D: 8
buffers:
  q:   {shape: [T, D], dtype: f32}
  out: {shape: [3, G * T, D], dtype: f32, symmetric: true}
  acc: {shape: [G * T, D], dtype: f32}
steps:
  - hops:
      repeat: G - 1
      as: h
      steps:
        - gather: {op: all_gather, axis: gpu, src: q, dst: "out[h]"}
        - use: {op: external, reads: ["out[h]", acc], writes: [acc]}
  - done: {op: barrier}
"""

TRIANGLE = """\
schedule: s
sizes: {N: 4}
buffers:
  kv: {shape: [2, N], dtype: f32, symmetric: true}
  y: {shape: [N], dtype: f32}
steps:
  - outer:
      repeat: REPEAT
      as: h
      steps:
        - inner:
            repeat: h + 1
            as: g
            steps:
              - use: {op: external, reads: ["kv[(h + g) % 2]"], writes: [y]}
"""


def _error(text: str, world: int | None = 3) -> list:
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", world)
    return err.value.diagnostics


def test_an_inner_trip_count_and_index_read_both_hop_indices() -> None:
    schedule = parse_text(TRIANGLE.replace("REPEAT", "3"), "s.yaml")
    steps = schedule.step_list()
    assert [s.name for s in steps] == ["use_h0_0", "use_h1_0", "use_h1_1", "use_h2_0",
                                       "use_h2_1", "use_h2_2"]
    assert [s.op.reads[0] for s in steps] == ["kv_0", "kv_1", "kv_0", "kv_0", "kv_1", "kv_0"]
    # an unrolled inner step's errors point at its line in the inner loop's body
    assert steps[0].mark().line == 15
    assert schedule.loop_world is None  # no trip count names W


def test_the_nest_unrolls_per_w_with_inner_offsets_and_slices() -> None:
    schedule = parse_text(NESTED, "s.yaml", 3)
    sends = [s for s in schedule.step_list() if s.name.startswith("send")]
    assert [s.name for s in sends] == ["send_h0_0", "send_h0_1", "send_h1_0", "send_h1_1"]
    assert [(s.op.src, s.op.dst, s.op.offset) for s in sends] == [
        ("x_0", "recv_0", 1), ("x_0", "recv_1", 2), ("x_1", "recv_2", 1), ("x_1", "recv_3", 2)]
    assert schedule.loop_world == 3
    found = _error(NESTED, world=None)  # the inner trip count names W
    assert [d.code for d in found] == ["loop-world"], found
    assert (found[0].mark.line, found[0].mark.col) == (16, 21)


def test_two_loops_of_one_nest_with_one_index_are_refused_at_the_inner_one() -> None:
    found = _error(TRIANGLE.replace("REPEAT", "3").replace("as: g", "as: h"))
    assert [d.code for d in found] == ["bad-loop"], found
    assert (found[0].mark.line, found[0].mark.col) == (13, 17)  # the inner 'as'
    assert "'h', as loop 'outer' around it does" in found[0].message


def test_loops_nest_at_most_max_nest_deep() -> None:
    deep = "            steps:\n              - use:"
    third = ("            steps:\n              - l3:\n                  repeat: 2\n"
             "                  as: k\n                  steps:\n"
             "                    - l4: {repeat: 2, as: m, steps: [{z: {op: barrier}}]}\n"
             "              - use:")
    found = _error(TRIANGLE.replace("REPEAT", "2").replace(deep, third))
    assert loops.MAX_NEST == 3
    assert [d.code for d in found] == ["bad-loop"], found
    assert found[0].mark.line == 19 and "4 loops deep; loops nest at most 3 deep" in (
        found[0].message)
    three = TRIANGLE.replace("REPEAT", "2").replace(deep, third.replace(
        "- l4: {repeat: 2, as: m, steps: [{z: {op: barrier}}]}", "- z: {op: barrier}"))
    names = [s.name for s in parse_text(three, "s.yaml").step_list()]
    assert names[:3] == ["z_h0_0_0", "z_h0_0_1", "use_h0_0"]


def test_a_nest_past_the_step_bound_is_refused_from_its_trip_counts(monkeypatch) -> None:
    """The bound holds over the nest, found from the trip counts: no step of the nest is
    rewritten before it is refused (also where the hops unroll to no step at all)."""
    rewritten: list[str] = []
    real = loops._Unroller.op
    monkeypatch.setattr(loops._Unroller, "op",
                        lambda self, name, *a: rewritten.append(name) or real(self, name, *a))
    parse_text(TRIANGLE.replace("REPEAT", "31"), "s.yaml")  # 31 * 32 / 2 = 496 steps: within
    assert len(rewritten) == 496 <= loops.MAX_STEPS
    rewritten.clear()
    found = _error(TRIANGLE.replace("REPEAT", "W * W"), world=6)  # 36 * 37 / 2 = 666
    assert [d.code for d in found] == ["loop-too-long"], found
    assert (found[0].mark.line, found[0].mark.col) == (8, 15)
    assert "loop 'outer' unrolls to 666 steps over the loops inside it (at W=6)" in (
        found[0].message)
    empty = TRIANGLE.replace("REPEAT", "1000000000").replace(
        "repeat: h + 1", "repeat: 0")  # a billion outer hops of no step
    found = _error(empty)
    assert [d.code for d in found] == ["loop-too-long"], found
    assert f"above the {loops.MAX_HOPS} the unroller walks" in found[0].message
    assert rewritten == []


def test_a_range_whose_nest_passes_the_bound_at_one_w_is_refused_before_any_w(
        tmp_path: Path, monkeypatch) -> None:
    seen: list = []
    real = loops.expand
    monkeypatch.setattr(loops, "expand", lambda data, file, world: seen.append(world)
                        or real(data, file, world))
    path = tmp_path / "s.yaml"
    path.write_text(TRIANGLE.replace("REPEAT", "W * W"))
    with pytest.raises(DiagnosticError) as err:
        pipeline.run(path, pipeline.Options(worlds=list(range(2, 65))), until="hb")
    assert [d.code for d in err.value.diagnostics] == ["loop-too-long"]
    assert "(at W=6)" in err.value.diagnostics[0].message and seen == [6]
    assert loops.first_too_long(loops_data(path), list(range(2, 65))) == 6


def test_the_length_from_the_trip_counts_is_the_unrolled_nest_s() -> None:
    from dcpc.lang import yamlsrc

    for text in (NESTED, TRIANGLE.replace("REPEAT", "W + 1"), MESH):
        worlds = parse_worlds("2x2,2x3,3x4") if "mesh:" in text else [2, 3, 5]
        for world in worlds:
            length = loops.unrolled_length(yamlsrc.load(text, "s.yaml"), world)
            assert length == len(parse_text(text, "s.yaml", world).step_list()), (text, world)


def loops_data(path: Path):
    from dcpc.lang import yamlsrc

    return yamlsrc.load(path.read_text(), str(path))


def test_a_mesh_loop_is_unrolled_per_shape_and_its_module_serves_that_shape(
        tmp_path: Path) -> None:
    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH)
    shapes = parse_worlds("2x2,2x3")
    c = pipeline.run(path, pipeline.Options(worlds=shapes), until="hb")
    assert c.per_world == shapes and c.warnings == []
    two = [s.name for s in parse_text(MESH, "m.yaml", shapes[0]).step_list()]
    three = [s.name for s in parse_text(MESH, "m.yaml", shapes[1]).step_list()]
    assert (two, three) == (["gather_h0", "use_h0", "done"],
                            ["gather_h0", "use_h0", "gather_h1", "use_h1", "done"])
    one = pipeline.run(path, pipeline.Options(worlds=parse_worlds("2x3")), until="emit")
    assert "    LOOP_WORLD = (2, 3)\n" in one.module_text
    # a loop over W only on a mesh still serves every shape of its W
    by_w = MESH.replace("repeat: G - 1", "repeat: W - 3")
    assert parse_text(by_w, "m.yaml", parse_worlds("2x2")[0]).loop_world == 4


def test_the_cli_checks_a_mesh_loop_per_shape_and_compiles_one(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from dcpc.cli import main

    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH)
    got = CliRunner().invoke(main, ["check", str(path), "--world", "2x2,2x3"])
    assert got.exit_code == 0, got.output
    head, claim = got.output.splitlines()[:2]
    assert head.startswith(f"{path}: ok (W 2x2..3, "), head
    assert claim == ("  a trip count, an index, an offset or an interleave names a mesh axis' "
                     "size: each of W 2x2..3 was unrolled and checked on its own; no claim "
                     "for any other shape")
    out = tmp_path / "out"
    got = CliRunner().invoke(main, ["compile", str(path), "--world", "2x2,2x3", "-o", str(out)])
    assert got.exit_code == 1 and "[loop-world]" in got.output, got.output
    assert "a module needs one --world shape such as 2x2" in got.output
    got = CliRunner().invoke(main, ["compile", str(path), "--world", "2x3", "-o", str(out)])
    assert got.exit_code == 0, got.output
    assert "    LOOP_WORLD = (2, 3)\n" in (out / "mesh_loop.py").read_text()


def test_a_module_unrolled_for_one_shape_refuses_another_of_the_same_w(
        tmp_path: Path) -> None:
    from dcpc.harness.worker import load_module_class

    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH)
    module = tmp_path / "mesh_loop.py"
    module.write_text(pipeline.run(path, pipeline.Options(worlds=parse_worlds("2x3"))
                                   ).module_text)
    cls = load_module_class(str(module), "mesh_loop")

    def build(rank) -> str:
        try:
            cls(rank, sizes={"N": 3, "G": 2}, device="cpu", backend="local")
        except ValueError as err:
            return str(err)
        return "built"

    said = run_ranks(6, build)
    assert len(said) == 6 and all(s == said[0] for s in said), said
    assert "unrolled for the mesh 2x3" in said[0] and "compile it with --world 3x2" in said[0]


def test_mesh_loop_errors_name_the_shape_and_the_axis() -> None:
    found = _error(MESH, world=6)  # a plain W binds no axis size
    assert [d.code for d in found] == ["loop-world"], found
    assert (found[0].mark.line, found[0].mark.col) == (15, 15)
    assert "depends on G (the size of mesh axis 'gpu')" in found[0].message
    assert "one mesh shape at a time" in found[0].message and "2x2" in found[0].hint
    small = MESH.replace("[3, G * T, D]", "[2, G * T, D]")
    parse_text(small, "m.yaml", parse_worlds("3x3")[0])
    found = _error(small, world=parse_worlds("2x4")[0])
    assert {d.code for d in found} == {"bad-index"}, found  # the gather's and the use's
    assert found[0].mark.line == 18 and "(at W=2x4, h=2)" in found[0].message
    ring = ("schedule: s\nmesh: {cp: C}\nsizes: {C: {max: 8}, N: 2}\nbuffers:\n"
            "  a: {shape: [N], dtype: f32}\n  b: {shape: [N], dtype: f32, symmetric: true}\n"
            "steps:\n  - half: {op: shift, src: a, dst: b, offset: C / 2}\n")
    assert parse_text(ring, "r.yaml", 4).step_list()[0].op.offset == 2
    found = _error(ring, world=3)
    assert [d.code for d in found] == ["bad-offset"] and "C/2 is 3/2" in found[0].message
    found = _error(ring.replace("C / 2", "C"), world=4)
    assert [d.code for d in found] == ["bad-offset"] and "to itself" in found[0].message


GATHER = (ROOT / "schedules" / "ops" / "all_gather_interleave.yaml").read_text()


def test_an_interleave_expression_is_its_value() -> None:
    text = GATHER.replace("  D: 72", "  D: 72\n  H: 6\n  HK: 2").replace(
        "dim: 0, interleave: 3}", "dim: 0, interleave: H / HK}")
    assert "H / HK" in text
    schedule = parse_text(text, "g.yaml")
    assert [s.op.interleave for s in schedule.step_list()[:2]] == [1, 3]
    assert schedule.loop_world is None
    per_w = parse_text(text.replace("H / HK", "W + 1"), "g.yaml", 2)
    assert per_w.step_list()[1].op.interleave == 3 and per_w.loop_world == 2


@pytest.mark.parametrize("value,code,words", [
    ("H / 4", "bad-interleave", "H/4 is 6/4, which is not a whole number"),
    ("Q", "bad-interleave", "names 'Q': not W"),
    ("H - 6", "bad-interleave", "= 0; an interleave is a positive number of rows"),
    ("W", "loop-world", "names W"),
])
def test_a_bad_interleave_expression_is_a_located_error(value: str, code: str,
                                                        words: str) -> None:
    text = GATHER.replace("  D: 72", "  D: 72\n  H: 6").replace(
        "dim: 0, interleave: 3}", f"dim: 0, interleave: {value}}}")
    found = _error(text, world=None)
    assert [d.code for d in found] == [code], found
    assert (found[0].mark.line, found[0].mark.col) == (23, 75) and words in found[0].message


@pytest.mark.e2e
def test_the_nest_checks_and_runs_against_float64(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from dcpc.demo import main as run_main

    path = tmp_path / "nested.yaml"
    path.write_text(NESTED)
    c = pipeline.run(path, pipeline.Options(worlds=[2, 3, 4, 5]), until="hb")
    assert c.per_world == [2, 3, 4, 5] and c.warnings == []
    code = run_main([str(path), "--world", "4", "--calls", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: every output matches (0 mismatches)" in out, out


@pytest.mark.e2e
def test_the_mesh_loop_runs_at_2x3_against_float64(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from dcpc.demo import main as run_main

    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH)
    code = run_main([str(path), "--world", "2x3", "--calls", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: every output matches (0 mismatches)" in out, out
