"""A buffer index on a later axis (``q[:, 1]``, ``b[:, :, e]``): slice e of axis 1 (2) of
an engine-owned buffer, taken by external steps (dcpc.lang.loops.index_axis); the slices
of a buffer used whole too are views of it along that axis (Schedule.view), in the data
flow (Schedule.cells) and in `dcpc run`'s reference; every other use is refused where it
is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.schedules import check_errors

from dcpc import pipeline
from dcpc.harness import synth
from dcpc.harness.simulate import alias_views, simulate_call
from dcpc.lang import loops
from dcpc.lang.parse import parse_text
from dcpc.topology import shape_of
from dcpc.worlds import parse_worlds

# the zigzag layout's q: [B, 2, C, D], its two chunks q[:, 0] and q[:, 1]; a whole read
# of q after both chunks are written
TEXT = """\
schedule: s
sizes: {B: {max: 2}, C: 3, D: 4}
buffers:
  x: {shape: [B, 2, C, D], dtype: f32}
  q: {shape: [B, 2, C, D], dtype: f32}
  lse: {shape: [B, D, 2, C], dtype: f32}
  y: {shape: [B, C, D], dtype: f32}
  z: {shape: [B, 2, C, D], dtype: f32}
steps:
  - lower: {op: external, reads: ["x[:, 0]"], writes: ["q[:, 0]", "lse[:, :, 0]"]}
  - upper: {op: external, reads: ["x[:, 1]"], writes: ["q[:, 1]", "lse[:, :, 1]"]}
  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}
  - all: {op: external, reads: [q, lse], writes: [z]}
"""


def _errors(text: str, worlds: range = range(2, 4)) -> list:
    return check_errors(text, worlds)  # the file names no W: parsed once


def _where(diag) -> tuple[int, int]:  # noqa: ANN001
    return diag.mark.line, diag.mark.col


def test_an_index_after_colons_slices_that_axis() -> None:
    assert loops.index_axis("h % 2") == (0, "h % 2")
    assert loops.index_axis(":, 1") == (1, "1")
    assert loops.index_axis(" : , :, (h + 1) % 2") == (2, "(h + 1) % 2")
    assert loops.index_axis("1, :") is None
    assert loops.index_axis(":, :") is None
    schedule = parse_text(TEXT, "s.yaml", 2)
    buffers = schedule.buffers
    # x is read by slice only: split into its slices, axis 1 dropped
    assert "x" not in buffers and buffers["x_1"].shape == ["B", "C", "D"]
    # q and lse are used whole too: they stay, their slices are views along their axis
    assert buffers["q"].shape == ["B", 2, "C", "D"] and buffers["q_1"].shape == ["B", "C", "D"]
    assert buffers["lse_0"].shape == ["B", "D", "C"]
    assert schedule.slices == {"q": 2, "lse": 2}
    assert schedule.slice_text("q_1") == "q[:, 1]" and schedule.slice_text("lse_0") == \
        "lse[:, :, 0]"
    assert [s.op.writes for s in schedule.step_list()][:2] == [["q_0", "lse_0"],
                                                               ["q_1", "lse_1"]]


def test_an_axis_index_in_a_loop_takes_the_hop_index() -> None:
    text = TEXT.replace('  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}\n', """\
  - hops:
      repeat: 2
      as: h
      steps:
        - one: {op: external, reads: ["q[:, (h + 1) % 2]"], writes: [y]}
""")
    schedule = parse_text(text, "s.yaml", 2)
    assert [s.op.reads for s in schedule.step_list() if s.name.startswith("one")] == [
        ["q_1"], ["q_0"]]


def test_chunks_written_apart_cover_a_whole_read_and_a_missing_one_is_named() -> None:
    # the two chunks are disjoint cells of q: both written, the whole read is proved
    assert _errors(TEXT) == []
    # the whole read before one chunk is written: that chunk is named, the other is not
    late = TEXT.replace('  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}\n', "")
    late = late.replace(
        '  - upper: {op: external, reads: ["x[:, 1]"], writes: ["q[:, 1]", "lse[:, :, 1]"]}\n',
        "") + '  - upper: {op: external, reads: ["x[:, 1]"], writes: ["q[:, 1]"]}\n'
    found = _errors(late, range(2, 3))
    assert [d.code for d in found] == ["read-before-write"], found  # not lse: written
    assert "reads 'q_1' before step 'upper' writes it" in found[0].message, found[0]
    assert _where(found[0]) == (11, 33)  # the whole read of q


def test_a_guarded_chunk_missing_on_a_rank_is_named_as_written() -> None:
    text = TEXT.replace('"x[:, 1]"], writes', '"x[:, 1]"], when: "rank == 0", writes')
    found = _errors(text, range(2, 3))
    assert found and {d.code for d in found} == {"read-before-write"}, found
    assert "'q[:, 1]' ('q_1') on rank 1" in found[0].message, found[0].message


@pytest.mark.parametrize(("change", "code", "where", "words"), [
    # a method (a communication op, a copy) takes no strided view
    (('  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}',
      '  - one: {op: copy, src: "q[:, 1]", dst: y}'), "bad-index", (12, 26),
     "slices axis 1 of 'q' in a step of op 'copy'"),
    (('  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}',
      '  - one: {op: shift, src: "q[:, 1]", dst: y}'), "bad-index", (12, 27),
     "slices axis 1 of 'q' in a step of op 'shift'"),
    # nor the slice's unrolled name, written bare (the module took q_1 and refused the
    # engine's strided view at run time)
    (('  - one: {op: external, reads: ["q[:, 1]"], writes: [y]}',
      '  - one: {op: copy, src: q_1, dst: y}'), "bad-index", (12, 26),
     "'q_1' is slice 1 of 'q' along axis 1 ('q[:, 1]'), named in a step of op 'copy'"),
    # a symmetric, shared or persist buffer's slice along a later axis: a method's
    # (an external step takes it: tests/lang/test_slot_chunk.py)
    *[(("  z: {shape: [B, 2, C, D], dtype: f32}",
        "  z: {shape: [B, 2, C, D], dtype: f32}\n  g: {shape: [B, 2, C, D], dtype: f32, "
        f"{kind}: true}}"), "bad-index", None, "'g[:, 0]' slices axis 1 of 'g' in a step "
       "of op 'copy'") for kind in ("symmetric", "shared", "persist")],
    # one buffer sliced along two axes
    (('reads: ["q[:, 1]"], writes: [y]', 'reads: ["lse[1]"], writes: [y]',
      "lse: {shape: [B, D, 2, C]", "lse: {shape: [2, D, 2, C]"), "mixed-index",
     (12, 32), "'lse[1]' slices axis 0 of 'lse', which 'lse[:, :, 0]' at s.yaml:10:"),
    (('reads: ["q[:, 1]"]', 'reads: ["q[1, :]"]'), "bad-index", (12, 32),
     "'q[1, :]' is no slice of one axis"),
    (('reads: ["q[:, 1]"]', 'reads: ["q[:, 1][0]"]'), "bad-index", (12, 32),
     "'q[:, 1][0]' has more than one index; a name takes one index, of one axis"),
    (('reads: ["q[:, 1]"]', 'reads: ["q[:, 1:2]"]'), "bad-index", (12, 32),
     "index '1:2' of 'q[:, 1:2]'"),
    (('reads: ["q[:, 1]"]', 'reads: ["q[:, 2]"]'), "bad-index", (12, 32),
     "'q[:, 2]' is slice 2 of 'q', whose axis 1 has 2 slices (0..1)"),
    (('reads: ["q[:, 1]"]', 'reads: ["q[:, :, :, 1]"]'), "bad-index", (12, 32),
     "whose axis 3 is not an integer (or which is not a buffer of 5 or more "
     "axes)"),
])
def test_a_refused_axis_index_is_located(change: tuple[str, ...], code: str,
                                         where: tuple[int, int] | None, words: str) -> None:
    text = TEXT
    for old, new in zip(change[::2], change[1::2], strict=True):
        text = text.replace(old, new)
    if code == "bad-index" and "'g[:, 0]'" in words:
        text += '  - sym: {op: copy, src: "g[:, 0]", dst: y}\n'
    assert text != TEXT
    found = _errors(text, range(2, 3))
    assert found and found[0].code == code, found
    assert words in found[0].message, found[0].message
    assert found[0].mark.file == "s.yaml"
    if where is not None:
        assert _where(found[0]) == where, found[0]
    else:
        assert found[0].mark.line == 15


def test_the_reference_s_views_are_the_rows_of_their_axis() -> None:
    """Slice k of q along axis 1 is q[:, k] in `dcpc run`'s reference: a write of the
    slice lands in those rows only (the rest keeps its poison), a write of the whole
    gives each slice its rows."""
    schedule = parse_text(TEXT, "s.yaml", 2)
    poisoned = torch.full((2, 2, 3, 4), float("nan"), dtype=torch.float64)
    bufs = {"q": poisoned.clone(), "q_1": torch.arange(24.0, dtype=torch.float64).view(2, 3, 4)}
    assert alias_views(schedule, bufs, "q_1", lambda _: poisoned) == ["q"]
    assert torch.equal(bufs["q"][:, 1], bufs["q_1"])
    assert bool(bufs["q"][:, 0].isnan().all())
    whole = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    bufs = {"q": whole}
    assert alias_views(schedule, bufs, "q", lambda _: poisoned) == ["q_0", "q_1"]
    assert torch.equal(bufs["q_0"], whole[:, 0]) and torch.equal(bufs["q_1"], whole[:, 1])
    assert not torch.equal(bufs["q_0"], whole[0])  # not the leading axis' slice


def test_a_run_of_the_reference_keeps_the_whole_and_its_chunks_one_memory() -> None:
    world = 2
    schedule = parse_text(TEXT, "s.yaml", world)
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world, None),
                             0, 0)
    assert sizes["B"] == 2
    inputs = synth.call_inputs(schedule, world, sizes, 0, 0)
    final = simulate_call(schedule, world, sizes, inputs,
                          synth.make_external(schedule, world, sizes, 0, 0))
    for rank in range(world):
        bufs = final[rank]
        for k in range(2):
            assert torch.equal(bufs["q"][:, k], bufs[f"q_{k}"])
            assert torch.equal(bufs["lse"][:, :, k], bufs[f"lse_{k}"])
        assert not torch.equal(bufs["q_0"], bufs["q_1"])


def test_an_axis_index_of_the_rank_is_a_copy_per_rank() -> None:
    text = TEXT.replace('reads: ["q[:, 1]"]', 'reads: ["q[:, (r + 1) % 2]"]')
    schedule = parse_text(text, "s.yaml", 2)
    copies = {s.name: s.op.reads for s in schedule.step_list() if s.name.startswith("one")}
    assert copies == {"one_r0": ["q_1"], "one_r1": ["q_0"]}


@pytest.mark.parametrize(("shape", "worlds", "size"), [
    ("[B, W, C, D]", "2..4", "W"),
    ("[B, G, C, D]", "2x2,2x3", "G"),  # a mesh axis' size
])
def test_an_axis_index_of_an_axis_sized_by_w_is_unrolled_per_w(
        shape: str, worlds: str, size: str, tmp_path: Path) -> None:
    """The file is unrolled once per W (mesh shape) when the axis the index slices is
    sized by W or an axis size, not only the leading one: 'q[:, 0]' of [B, W, C, D] was
    refused loop-world at --world 2..4."""
    text = ("schedule: s\n" + ("mesh: {node: N, gpu: G}\n" if size == "G" else "")
            + "sizes: {B: {max: 2}, C: 3, D: 4}\nbuffers:\n"
            f"  x: {{shape: [B, C, D], dtype: f32}}\n  q: {{shape: {shape}, dtype: f32}}\n"
            "  y: {shape: [B, C, D], dtype: f32}\nsteps:\n"
            "  - a: {op: external, reads: [x], writes: [q]}\n"
            '  - b: {op: external, reads: ["q[:, 0]"], writes: [y]}\n')
    path = tmp_path / "s.yaml"
    path.write_text(text)
    parsed = parse_worlds(worlds)
    c = pipeline.run(path, pipeline.Options(worlds=parsed), until="graph")
    assert c.per_world == parsed, c.per_world
    for world in parsed:
        schedule = parse_text(text, "s.yaml", world)
        assert schedule.slices == {"q": shape_of(world)[-1]}
        assert schedule.buffers["q_0"].shape == ["B", "C", "D"]
