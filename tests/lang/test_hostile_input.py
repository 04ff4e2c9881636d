"""Issue 31, crashes and unbounded work: hostile inputs to `dcpc check`, `compile` and
`graph` exit 0, 1 or 2 with a located message (file:line:col), never 3 and never a
traceback, and every bound is enforced before the work it bounds."""

from __future__ import annotations

import ast
import itertools
import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from dcpc import pipeline
from dcpc.check import hb
from dcpc.cli import main, parse_worlds
from dcpc.lang import mesh as mesh_lang
from dcpc.lang.loops import MAX_STEPS
from dcpc.lang.mesh import MeshWorld, worlds_text

ROOT = Path(__file__).resolve().parents[2]
RING = ROOT / "schedules" / "gallery" / "ring_attention.yaml"
TWO_LEVEL = ROOT / "schedules" / "gallery" / "hierarchical_two_level.yaml"
KIMI = ROOT / "schedules" / "kimi_k3_dcp.yaml"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _clean(result, code: int) -> str:
    """The output of a run that exited ``code`` without an internal error."""
    assert result.exit_code == code, result.output
    assert "internal error" not in result.output and "Traceback" not in result.output
    return result.output


def _located(result, path: Path, line: int, klass: str) -> str:
    """Exit 1 with an error of ``klass`` at ``path:line:``."""
    out = _clean(result, 1)
    hits = [x for x in out.splitlines() if x.startswith(f"{path}:{line}:") and f"[{klass}]" in x]
    assert hits, out
    return hits[0]


# --- what `dcpc check` says it checked -----------------------------------------------


def test_a_per_w_file_without_world_is_checked_at_the_default_and_says_so() -> None:
    """ring_attention (its trip count names W), no --world: 'ok (W=8 ...)' and then an
    internal TypeError (exit 3), JSON 'worlds': [8, 8], before."""
    out = _clean(invoke("check", str(RING)), 0)
    assert f"{RING}: ok (W 2..8, " in out and "each of W 2..8 was unrolled" in out
    data = json.loads(_clean(invoke("check", "--format", "json", str(RING)), 0))
    assert data["results"][0]["worlds"] == list(range(2, 9))


def test_a_world_list_is_reported_as_the_list_not_a_range() -> None:
    """--world 4,8 printed 'W 4..8' and 'each W of W 4..8 was unrolled' (5..7 were not)."""
    out = _clean(invoke("check", "--world", "4,8", str(RING)), 0)
    assert f"{RING}: ok (W 4,8, " in out and "each of W 4,8 was unrolled" in out
    assert "4..8" not in out
    data = json.loads(_clean(invoke("check", "--format", "json", "--world", "4,8", str(KIMI)),
                             0))
    assert data["results"][0]["worlds"] == [4, 8]
    assert f"{KIMI}: ok (W 4,8, " in _clean(invoke("check", "--world", "4,8", str(KIMI)), 0)


@pytest.mark.parametrize("text", ["2..8", "4,8", "2..4,8", "7", "2..4x2..4", "2x2,2x4",
                                  "2x2..3", "1..3x2", "2x2x2", "2x3,3x2"])
def test_worlds_text_reads_back_to_the_same_worlds(text: str) -> None:
    worlds = parse_worlds(text)
    assert parse_worlds(worlds_text(worlds)) == worlds
    assert [w.shape if isinstance(w, MeshWorld) else w for w in
            parse_worlds(worlds_text(worlds))] == [
        w.shape if isinstance(w, MeshWorld) else w for w in worlds]


# --- a mesh whose loop names W ----------------------------------------------------------

MESH_LOOP = """\
schedule: mesh_loop
mesh: {node: N, gpu: G}
sizes:
  N: {max: 4}
  G: {max: 4}
  D: 16
buffers:
  x: {shape: [D], dtype: f32}
  g: {shape: [G*D], dtype: f32, symmetric: true}
  y: {shape: [D], dtype: f32}
steps:
  - ring:
      repeat: W - 1
      as: h
      steps:
        - s: {op: all_gather, axis: gpu, src: x, dst: g}
        - u: {op: external, reads: [g], writes: [y]}
        - b: {op: barrier}
"""


def test_a_mesh_loop_compiles_for_a_shape_to_valid_python(tmp_path: Path) -> None:
    """`compile --world 2x3` wrote 'LOOP_WORLD = 2x3' (invalid Python) and exited 0."""
    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH_LOOP)
    _clean(invoke("compile", "--world", "2x3", "-o", str(tmp_path / "out"), str(path)), 0)
    text = (tmp_path / "out" / "mesh_loop.py").read_text()
    ast.parse(text)
    assert "    LOOP_WORLD = 6\n" in text  # the loop was unrolled for W = 6


def test_a_mesh_loop_is_checked_at_the_mesh_default_shapes(tmp_path: Path) -> None:
    """Its default check unrolled plain W 2..8 on a mesh: bad-world."""
    path = tmp_path / "mesh_loop.yaml"
    path.write_text(MESH_LOOP)
    out = _clean(invoke("check", str(path)), 0)
    assert f"{path}: ok (W 2..4x2..4, " in out


# --- repeat and index expressions ---------------------------------------------------------

LOOP = """\
schedule: hostile
sizes: {D: 16}
buffers:
  x: {shape: [D], dtype: f32}
  r: {shape: [LEAD, D], dtype: f32, symmetric: true}
steps:
  - ring:
      repeat: REPEAT
      as: h
      steps:
        - c: {op: copy, src: x, dst: "r[INDEX]"}
        - b: {op: barrier}
"""


def _loop(tmp_path: Path, repeat: str = "2", index: str = "h % 2", lead: str = "2") -> Path:
    path = tmp_path / "hostile.yaml"
    path.write_text(LOOP.replace("REPEAT", repeat).replace("INDEX", index)
                    .replace("LEAD", lead))
    return path


@pytest.mark.parametrize("repeat, words", [
    ("1.5", "found a number with a fraction"), ("null", "found empty"),
    ("[1]", "found a list"), ("{a: 1}", "found a mapping"),
    ('"' + "(" * 400 + "1" + ")" * 400 + '"', "longer than 512 characters"),
    ('"' + "(" * 100 + "1" + ")" * 100 + '"', "nest deeper than 64"),
    ('"' + "+".join(["1"] * 2500) + '"', "longer than 512 characters"),
    ('"' + "+".join(["1"] * 100) + '"', "nested deeper than 64"),
    ('"' + "9" * 4400 + '"', "longer than 512 characters"),
    ('"' + "9" * 31 + '"', "more than 30 digits"),
    ('"２"', "unexpected character '２'"),
])
def test_a_bad_repeat_is_a_located_error(tmp_path: Path, repeat: str, words: str) -> None:
    """Each was an internal AttributeError, RecursionError or ValueError (exit 3)."""
    path = _loop(tmp_path, repeat=repeat)
    line = _located(invoke("check", str(path)), path, 8, "bad-repeat")
    assert words in line and len(line) < 400, line


@pytest.mark.parametrize("index, words", [
    ("(" * 400 + "h" + ")" * 400, "longer than 512 characters"),
    ("+".join(["h"] * 2500), "longer than 512 characters"),
    ("h % " + "7" * 4400, "longer than 512 characters"),
    ("h % " + "7" * 40, "more than 30 digits"),
    ("7" * 40, "more than 30 digits"),
    ("h % ２", "unexpected character '２'"),
    # of a symmetric buffer a slot's chunk along its axis 0, taken by external steps only
    ("h % 2][0", "takes a chunk of a slot of 'r' along the slot's axis 0 in a step of op"),
    ("h % (W + 1)", "must be an integer constant or one name (W, an integer size); "
     "here it is '(W + 1)'"),
])
def test_a_bad_index_is_a_located_error(tmp_path: Path, index: str, words: str) -> None:
    path = _loop(tmp_path, index=index)
    line = _located(invoke("check", str(path)), path, 11, "bad-index")
    assert words in line and len(line) < 400, line


def test_a_double_index_names_the_problem_not_the_modulus(tmp_path: Path) -> None:
    """`r[h % 2][0]` said "'%' takes an integer constant, not '2][0'". Of the symmetric
    `r` it is slot h % 2's chunk 0 along the slot's axis 0, which a copy does not take."""
    path = _loop(tmp_path, index="h % 2][0")
    line = _located(invoke("check", str(path)), path, 11, "bad-index")
    assert "'r[h % 2][0]' takes a chunk of a slot of 'r'" in line and "constant" not in line
    engine = tmp_path / "engine.yaml"  # of an engine-owned buffer: one index, as before
    engine.write_text(path.read_text().replace(", symmetric: true", ""))
    line = _located(invoke("check", str(engine)), engine, 11, "bad-index")
    assert "'r[h % 2][0]' has more than one index" in line and "constant" not in line


@pytest.mark.parametrize("lead", ["2147483647", "100000", "65"])
def test_an_indexed_buffer_of_too_many_slices_is_refused_before_splitting(
        tmp_path: Path, lead: str) -> None:
    """A leading axis of 2**31-1 was split into 2**31-1 buffers (MemoryError after a
    minute); 100,000 slices took 10 s and printed 99,999 unused-buffer warnings."""
    path = _loop(tmp_path, lead=lead)
    line = _located(invoke("check", str(path)), path, 11, "bad-index")
    assert f"has {lead} slices" in line and "at most 64" in line


SLICED = """\
schedule: sliced
sizes: {D: 16}
buffers:
  x: {shape: [D], dtype: f32}
  s: {shape: [4, D], dtype: f32}
  t: {shape: [3, D], dtype: f32}
steps:
  - a: {op: copy, src: x, dst: "s[1]"}
  - b: {op: external, reads: [USED], writes: ["s[2]"]}
"""


def test_the_slices_of_an_indexed_buffer_are_used_together(tmp_path: Path) -> None:
    """ring_attention at W=2 warned that 'recv_1' is unused: its loop runs no hop there,
    but the buffer is sliced for every other W. A buffer none of whose slices is used
    is still warned about, once."""
    out = _clean(invoke("check", "--world", "2", str(RING)), 0)
    assert "warning" not in out
    path = tmp_path / "sliced.yaml"
    path.write_text(SLICED.replace("USED", '"t[0]"'))
    out = _clean(invoke("check", str(path)), 0)
    assert "unused-buffer" not in out, out  # s_0, s_3, t_1, t_2 are slices of used buffers
    path.write_text(SLICED.replace("USED", "x"))
    out = _clean(invoke("check", str(path)), 0)
    warnings = [x for x in out.splitlines() if "[unused-buffer]" in x]
    assert warnings == [f"{path}:6:3: warning: buffer 't' is not used by any step "
                        "[unused-buffer]"], out


HOPS = """\
schedule: hops
sizes: {D: 16}
buffers:
  x: {shape: [D], dtype: f32}
  r: {shape: [D], dtype: f32, symmetric: true}
  y: {shape: [D], dtype: f32}
steps:
  - ring:
      repeat: REPEAT
      as: h
      steps:
        - c: {op: all_gather, src: x, dst: r, dim: 0}
        - u: {op: external, reads: [r], writes: [y]}
        - b: {op: barrier}
"""


def test_the_longest_ring_of_3_step_hops_is_analysed_and_one_hop_more_is_too_long(
        tmp_path: Path) -> None:
    """docs/hb-checker.md said 86 hops of 3 steps is the longest analysed (258 steps, at
    the bound of 256): the longest ring is MAX_STEPS // 3 hops, whatever the bound."""
    hops = MAX_STEPS // 3
    path = tmp_path / "hops.yaml"
    path.write_text(HOPS.replace("REPEAT", str(hops)).replace("shape: [D], dtype: f32, sym",
                                                              "shape: [W*D], dtype: f32, sym"))
    _clean(invoke("check", "--world", "2..4", str(path)), 0)
    path.write_text(path.read_text().replace(f"repeat: {hops}", f"repeat: {hops + 1}"))
    line = _located(invoke("check", "--world", "2..4", str(path)), path, 9, "loop-too-long")
    assert f"{hops + 1} hops x 3 steps = {3 * hops + 3} steps" in line


# --- --world ---------------------------------------------------------------------------


@pytest.mark.parametrize("world, words", [
    ("1x1", "mesh 1x1 has 1 rank"), ("1..4x1", "mesh 1x1 has 1 rank"),
    ("2x2,4", "mixes mesh shapes (2x2) and group sizes (4)"),
    ("4,2x2", "mixes mesh shapes (2x2) and group sizes (4)"),
    ("２", "is not a group size"), ("２x2", "is not a group size or range"),
    ("1_0", "is not a group size"), ("+4", "is not a group size"),
    ("2x2x2x2x2", "at most 4 axes"),
    ("2..1024x2..1024", "mesh 1024x1024 has 1048576 ranks"),
])
def test_a_bad_world_is_a_usage_error(world: str, words: str) -> None:
    """1x1 was accepted although 1 is refused, '2x2,4' dropped the 4 (2x2 equals 4 as an
    int), fullwidth digits were read as ASCII ones."""
    out = _clean(invoke("check", "--world", world, str(TWO_LEVEL)), 2)
    assert words in out, out


def test_a_huge_mesh_range_is_refused_before_its_shapes_are_listed(monkeypatch) -> None:
    """--world 2..1024x2..1024 listed a million shapes (9.7 s) before refusing."""
    def product(*args, **kwargs):
        raise AssertionError("the shapes were listed")

    monkeypatch.setattr(mesh_lang.itertools, "product", product)
    with pytest.raises(mesh_lang.WorldError, match="1048576 ranks"):
        mesh_lang.parse_shapes("2..1024x2..1024", 1024)
    with pytest.raises(mesh_lang.WorldError, match="at most 4 axes"):
        mesh_lang.parse_shapes("x".join(["2..4"] * 12), 1024)


# --- meshes -----------------------------------------------------------------------------

MESH = """\
schedule: meshy
mesh: MESH
sizes:
  N: {max: 4}
  G: {max: 4}
  D: 16
buffers:
  x: {shape: [D], dtype: f32}
  g: {shape: [G*D], dtype: f32, symmetric: true}
  y: {shape: [D], dtype: f32}
steps:
  - s: {op: all_gather, axis: gpu, src: x, dst: g}
  - u: {op: external, reads: [g], writes: [y]}
  - b: {op: barrier}
"""


@pytest.mark.parametrize("mesh, col, words", [
    ("{}", 7, "'mesh:' names no axis"),
    ("{node: 0, gpu: G}", 14, "mesh axis 'node' has size 0"),
    ("{node: -1, gpu: G}", 14, "mesh axis 'node' has size -1"),
    ("{node: N, gpu: G, a: A, b: B, c: C}", 7, "'mesh:' has 5 axes, above the limit of 4"),
    ("{" + ", ".join(f"a{i}: A{i}" for i in range(20)) + ", gpu: G}", 7, "21 axes"),
    ("{node: 2000, gpu: 3}", 7, "integer axes alone make 6000 ranks"),
])
def test_a_bad_mesh_is_reported_alone(tmp_path: Path, mesh: str, col: int, words: str) -> None:
    """'{}' was an internal IndexError; a size of 0 gave 'bad-world' at 0:0 ('group sizes
    must be positive integers, not 0x2'); 7 axes were checked for minutes (3**7 default
    shapes), 20 axes never finished listing 3**20 shapes."""
    path = tmp_path / "m.yaml"
    path.write_text(MESH.replace("MESH", mesh))
    result = invoke("check", str(path))
    line = _located(result, path, 2, "bad-mesh")
    assert f"{path}:2:{col}:" in line and words in line
    errors = [x for x in result.output.splitlines() if ": error:" in x]
    assert errors == [line], result.output  # no follow-on errors of the broken mesh


def test_a_mesh_of_one_axis_is_checked_within_its_max(tmp_path: Path) -> None:
    """`mesh: {node: N}` with N {max: 4}: the default W 2..8 gave 'mesh size N is 5 in
    mesh 5, above its max 4' (empty-size-range)."""
    path = tmp_path / "m.yaml"
    path.write_text(MESH.replace("MESH", "{gpu: G}"))
    assert f"{path}: ok (W 2..4, " in _clean(invoke("check", str(path)), 0)


def test_a_mesh_of_four_axes_at_a_wide_range_is_refused_before_any_analysis(
        tmp_path: Path, monkeypatch) -> None:
    """The happens-before work of a mesh counts its shapes' ranks (each MESH_COST
    times): 2..5 per axis of 4 axes (2..6 on one) was analysed for minutes."""
    axes = ["p", "q", "t", "s"]  # not r: an axis may not be named r
    lines = ["schedule: wide", "mesh: {" + ", ".join(f"{a}: {a.upper()}" for a in axes) + "}",
             "sizes: {D: 16}", "buffers:", "  x: {shape: [D], dtype: f32}",
             "  y: {shape: [D], dtype: f32}"]
    lines += [f"  g{a}: {{shape: [{a.upper()}*D], dtype: f32, symmetric: true}}" for a in axes]
    lines.append("steps:")
    for a in axes:
        lines += [f"  - s{a}: {{op: all_gather, axis: {a}, src: x, dst: g{a}}}",
                  f"  - u{a}: {{op: external, reads: [g{a}], writes: [y]}}",
                  f"  - b{a}: {{op: barrier, axis: {a}}}"]
    path = tmp_path / "wide.yaml"
    path.write_text("\n".join(lines) + "\n")

    def analysed(*args, **kwargs):
        raise AssertionError("the happens-before checker ran")

    monkeypatch.setattr(hb, "check", analysed)
    line = _located(invoke("check", "--world", "2..5x2..5x2..5x2..6", str(path)), path, 12,
                    "schedule-too-large")
    assert "every axis size up to 8x8x8x8" in line


def test_two_teams_may_share_a_channel_name() -> None:
    """m14: a node-team and a gpu-team signal/wait pair on one channel was reported as
    'unmatched-wait' (the waits were counted per channel, not per team)."""
    path = ROOT / "tests" / "mesh_cases" / "two_teams_one_channel.yaml"
    assert f"{path}: ok (W 2..4x2..4, " in _clean(invoke("check", str(path)), 0)
    c = pipeline.run(path, pipeline.Options(worlds=[MeshWorld((2, 2))]), until="lower")
    from dcpc.ops.common import channels

    polls = {w: s.name for w, s in channels(c.schedule).polls.items()}
    assert polls == {"wn": "sn", "wg": "sg"}


# --- dcpc graph -------------------------------------------------------------------------


def test_graph_draws_a_mesh_schedule() -> None:
    """`dcpc graph` and `graph --hb` on any mesh schedule: bad-world (a plain W=2)."""
    out = _clean(invoke("graph", str(TWO_LEVEL)), 0)
    assert out.startswith('digraph "hierarchical_two_level"')
    out = _clean(invoke("graph", "--hb", str(TWO_LEVEL)), 0)
    assert out.startswith('digraph "hb_hierarchical_two_level"')
    assert "r3_" in out and "r4_" not in out  # the 4 ranks of the default shape 2x2
    assert _clean(invoke("graph", "--hb", "--world", "2x3", str(TWO_LEVEL)), 0)


def test_the_default_mesh_shapes_are_never_listed_past_the_axis_limit() -> None:
    mesh = mesh_lang.Mesh(tuple(f"a{i}" for i in range(20)), tuple(f"A{i}" for i in range(20)),
                          True)
    with pytest.raises(mesh_lang.WorldError, match="at most 4 axes"):
        mesh_lang.default_shapes(mesh, {})
    small = mesh_lang.Mesh(("a", "b"), ("A", 3), True)
    assert [w.shape for w in mesh_lang.default_shapes(small, {"A": 3})] == [(2, 3), (3, 3)]
    assert len(list(itertools.islice(mesh_lang.default_shapes(
        mesh_lang.Mesh(("a", "b", "c", "d"), ("A", "B", "C", "D"), True), {}), 100))) == 81


# --- check time: every bound before the work -----------------------------------------------


def _no_analysis(monkeypatch) -> None:
    def analysed(*args, **kwargs):
        raise AssertionError("the happens-before checker ran")

    monkeypatch.setattr(hb, "check", analysed)


def _shared_reads(reads: int, slots: int, index: str = "y") -> str:
    """A shared symmetric buffer gathered into, then read by ``reads`` steps, over
    ``slots`` slots of one stream: the race search compares every pair of its accesses."""
    lines = ["schedule: pairs", f"slots: {slots}", "streams: single", "sizes: {D: 16}",
             "buffers:", "  x: {shape: [D], dtype: f32}",
             "  g: {shape: [W*D], dtype: f32, symmetric: true, shared: true}",
             "  y: {shape: [2, D], dtype: f32}", "steps:",
             "  - gather: {op: all_gather, src: x, dst: g}"]
    lines += [f'  - e{i}: {{op: external, reads: [g], writes: ["{index}"]}}'
              for i in range(reads)]
    return "\n".join([*lines, "  - fin: {op: barrier}"]) + "\n"


def test_a_race_search_of_too_many_pairs_is_refused_before_it_runs(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """250 reads of a shared buffer over 64 slots of one stream: half a billion pairs per
    W; the check took 27 s at W=2 (minutes for its default W 2..8), within every limit."""
    path = tmp_path / "pairs.yaml"
    path.write_text(_shared_reads(250, 64).replace('"y"', "y").replace("[2, D]", "[D]"))
    _no_analysis(monkeypatch)
    line = _located(invoke("check", "--world", "2", str(path)), path, 10, "schedule-too-large")
    assert "race-search pairs, most on buffer 'g'" in line


def test_a_per_w_file_is_bounded_over_all_its_w_before_any_is_analysed(
        tmp_path: Path, monkeypatch) -> None:
    """Each W of a file whose index names W was within the limit alone, so 2..31 of them
    together ran for every W (100 reads of a shared buffer over 8 slots at 2..31: 2.9 s
    of CPU; more steps or W, more)."""
    path = tmp_path / "per_w.yaml"
    path.write_text(_shared_reads(100, 8, index="y[W % 2]"))
    _no_analysis(monkeypatch)
    line = _located(invoke("check", "--world", "2..31", str(path)), path, 11,
                    "schedule-too-large")
    assert "so each W is analysed on its own: W 2..31 make" in line
    assert "check W 2.." in line  # the widest range that fits


def test_a_plain_ring_at_the_work_limit_is_refused_before_its_analysis(
        tmp_path: Path, monkeypatch) -> None:
    """A ring of 40 next waits in 256 steps at --world 2..1024 was analysed (every W up to
    163: 1.9 s of CPU, 4.5 s on the shared machine); its refusal says what it would
    cost."""
    lines = ["schedule: ring", "sizes: {D: 16}", "buffers:", "  x: {shape: [D], dtype: f32}",
             "  g: {shape: [W*D], dtype: f32, symmetric: true}",
             "  y: {shape: [D], dtype: f32}", "steps:",
             "  - gather: {op: all_gather, src: x, dst: g}"]
    for i in range(40):
        lines += [f"  - s{i}: {{op: signal, to: next, channel: c{i}}}",
                  f"  - w{i}: {{op: wait, from: prev, channel: c{i}}}"]
    lines += [f"  - e{i}: {{op: external, reads: [g], writes: [y]}}" for i in range(174)]
    path = tmp_path / "ring.yaml"
    path.write_text("\n".join([*lines, "  - fin: {op: barrier}"]) + "\n")
    _no_analysis(monkeypatch)
    line = _located(invoke("check", "--world", "2..1024", str(path)), path, 8,
                    "schedule-too-large")
    assert "every W up to 163, raised by 40 next/prev waits per call" in line


def test_a_huge_yaml_is_refused_before_it_is_composed(tmp_path: Path, monkeypatch) -> None:
    """A 1 MiB list of 500,000 numbers was composed (35 s of CPU, twice) before the node
    limit refused it; its parser events are counted first."""
    import yaml

    path = tmp_path / "big.yaml"
    path.write_text("schedule: s\nbuffers: {}\nsteps: []\nx: [" + ",".join(["1"] * 500_000)
                    + "]\n")

    def composed(*args, **kwargs):
        raise AssertionError("composed")

    monkeypatch.setattr(yaml, "compose", composed)
    line = _located(invoke("check", str(path)), path, 4, "yaml-too-large")
    assert "more than 50000 YAML nodes" in line


def test_too_many_buffers_are_refused_before_the_model(tmp_path: Path) -> None:
    """14,000 buffers (within the old node limit) took 7 s and printed 13,999 warnings."""
    lines = ["schedule: s", "sizes: {D: 16}", "buffers:"]
    lines += [f"  b{i}: {{shape: [D], dtype: f32}}" for i in range(300)]
    lines += ["steps:", "  - e: {op: external, reads: [b0], writes: [b1]}"]
    path = tmp_path / "bufs.yaml"
    path.write_text("\n".join(lines) + "\n")
    line = _located(invoke("check", str(path)), path, 4, "schedule-too-large")
    assert "the schedule has 300 buffers" in line and "above the limit of 256" in line


def test_shape_questions_share_one_budget(tmp_path: Path) -> None:
    """255 buffers whose dimensions square a difference of two large sizes each spent the
    budget of one question (about 0.1 s): minutes at W 2..1024. Together they have one
    budget; the questions past it are refused (shape-undecided), never passed."""
    from dcpc.lang import exact

    lines = ["schedule: poly", "sizes:", "  A: {max: 1000}", "  B: {max: 1000}", "buffers:"]
    lines += [f'  b{i}: {{shape: ["(A - B + {i}) * (A - B + {i}) + {i + 1}"], dtype: f32}}'
              for i in range(40)]
    lines += ["  x: {shape: [A], dtype: f32}", "steps:",
              "  - e: {op: external, reads: [" + ", ".join(f"b{i}" for i in range(40))
              + "], writes: [x]}"]
    path = tmp_path / "poly.yaml"
    path.write_text("\n".join(lines) + "\n")
    spaces: list = []
    real = exact.Space.__init__

    def tracked(self, *args, **kwargs):
        real(self, *args, **kwargs)
        spaces.append(self)

    exact.Space.__init__ = tracked
    try:
        out = _clean(invoke("check", str(path)), 1)
    finally:
        exact.Space.__init__ = real
    assert max(s.spent for s in spaces) <= exact.MAX_TOTAL_POINTS + exact.MAX_POINTS
    undecided = [x for x in out.splitlines() if "[shape-undecided]" in x]
    assert undecided and "shape questions together need more than" in undecided[-1]


def test_torus_tables_give_the_coordinate_arithmetic() -> None:
    """topology.Torus answers from cached tables (the checker asks millions of times on a
    mesh): the same as coordinates computed and wrapped one by one."""
    from dcpc.topology import Torus

    for shape in [(5,), (2, 3), (3, 1, 2), (2, 2, 3, 2)]:
        t = Torus(shape)
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]

        def coords(r, shape=shape, strides=strides):
            return tuple((r // st) % s for st, s in zip(strides, shape, strict=True))

        def index(c, shape=shape, strides=strides):
            return sum((x % s) * st for x, s, st in zip(c, shape, strides, strict=True))

        for a in range(-2, t.size + 2):
            assert t.coords(a) == coords(a)
            for b in range(t.size):
                pairs = list(zip(coords(a), coords(b), strict=True))
                assert t.add(a, b) == index(x + y for x, y in pairs)
                assert t.sub(a, b) == index(x - y for x, y in pairs)
        for d in range(t.size):
            assert t.shift(d) == [t.sub(q, d) for q in range(t.size)]
        for rank in range(t.size):
            for k in range(1, len(shape) + 1):
                for axes in itertools.combinations(range(len(shape)), k):
                    want = [index([*(v if i in axes else c for i, (c, v) in enumerate(
                        zip(coords(rank), full, strict=True)))])
                        for full in itertools.product(*(range(s) for s in shape))
                        if all(full[i] == 0 for i in range(len(shape)) if i not in axes)]
                    assert t.team(rank, axes) == want, (shape, rank, axes)
