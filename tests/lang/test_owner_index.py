"""Owner-indexed slices (issue 33 items 4 and 7): an index that names the rank ``r``
(``o_parts[(r - h) % W]``) is unrolled per W into one guarded copy of its step per rank
(dcpc.lang.loops), an engine-owned buffer may be used whole and by slice (its slices are
views of it), and the per-rank data flow needs, on every rank, a write of each slice a
whole read takes; the checker, the brute force (tests/support/hb_oracle.py) and the
execution oracle (dcpc/check/oracle.py) agree on an owner-indexed race at W = 2, 3, 4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hb_oracle import oracle_keys
from support.schedules import mesh_owner

from dcpc.check import hb, structural
from dcpc.check.oracle import explore
from dcpc.codegen.lower import lower
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import synth
from dcpc.harness.simulate import simulate_call
from dcpc.lang import loops, yamlsrc
from dcpc.lang import when as wh
from dcpc.lang.mesh import MeshWorld
from dcpc.lang.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
PASS_KV = ROOT / "schedules" / "gallery" / "meta_cp_pass_kv.yaml"
PASS_Q = ROOT / "schedules" / "gallery" / "meta_cp_pass_q.yaml"

# the hops of a ring write the partial of block (r - h) mod W into its owner's slot;
# a merge reads every slot
RING = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  parts: {shape: [W, N, D], dtype: f32}
steps:
  - hops:
      repeat: TRIPS
      as: h
      steps:
        - attend: {op: external, reads: [x], writes: ["parts[INDEX]"]}
  - merge: {op: external, reads: [parts], writes: [y]}
"""


def _ring(trips: str = "W", index: str = "(r - h) % W") -> str:
    return RING.replace("TRIPS", trips).replace("INDEX", index)


def _errors(text: str, worlds: range = range(2, 5)) -> list:
    found = []
    for world in worlds:
        try:
            schedule = parse_text(text, "s.yaml", world)
        except DiagnosticError as err:
            found += err.diagnostics
            continue
        found += [d for d in structural.check(schedule, [world]) if d.severity == "error"]
    return found


def test_an_owner_index_unrolls_into_one_guarded_copy_per_rank() -> None:
    schedule = parse_text(_ring(), "s.yaml", 3)
    steps = schedule.step_list()
    assert [s.name for s in steps] == [f"attend_h{h}_r{p}" for h in range(3)
                                       for p in range(3)] + ["merge"]
    for step in steps[:-1]:
        h, p = int(step.name[8]), int(step.name[-1])
        assert step.op.when == f"rank == {p}"
        assert step.op.writes == [f"parts_{(p - h) % 3}"]
    # the merge reads the whole buffer; its slices are views of it
    assert steps[-1].op.reads == ["parts"]
    assert schedule.slices == {"parts": 3} and schedule.slice_of("parts_2") == ("parts", 2)
    assert schedule.cells("parts") == ["parts_0", "parts_1", "parts_2"]
    # an unrolled copy's errors point at the index it came from (the writes list)
    assert (steps[0].op.mark("when").line, steps[0].op.mark("when").col) == (12, 54)


def test_ranks_whose_slices_agree_share_one_copy() -> None:
    """``parts[r % 2]`` at W = 4: ranks 0 and 2, 1 and 3 take the same slice."""
    schedule = parse_text(_ring("1", "r % 2"), "s.yaml", 4)
    guarded = [(s.name, s.op.when, s.op.writes) for s in schedule.step_list()[:-1]]
    assert guarded == [("attend_h0_r0", "rank == 0 or rank == 2", ["parts_0"]),
                       ("attend_h0_r1", "rank == 1 or rank == 3", ["parts_1"])]


def test_an_index_that_names_the_rank_and_a_hop_index_named_r() -> None:
    """A hop index named r hides the rank (tests/lang/test_loops_nested.py names one)."""
    text = _ring("W", "r").replace("as: h", "as: r")
    schedule = parse_text(text, "s.yaml", 3)
    assert [s.op.writes for s in schedule.step_list()[:-1]] == [["parts_0"], ["parts_1"],
                                                                ["parts_2"]]
    assert all(s.op.when is None for s in schedule.step_list())


def test_the_hops_covering_every_slot_on_every_rank_are_proved() -> None:
    assert _errors(_ring()) == []


def test_a_missing_hop_is_read_before_write_naming_the_rank_and_the_slot() -> None:
    found = _errors(_ring("W - 1"))
    assert {d.code for d in found} == {"read-before-write"}, found
    first = found[0]
    assert (first.mark.line, first.mark.col) == (13, 35)  # the merge's reads list
    # W = 2, one hop: rank 0 wrote slot 0 only, so slot 1 is missing there
    assert ("step 'merge' reads 'parts[1]' ('parts_1') on rank 0 at W=2" in first.message
            ), first.message
    assert "attend_h0_r1" in first.message  # the copy that writes it runs elsewhere


def test_an_index_of_the_rank_out_of_range_names_the_rank() -> None:
    found = _errors(_ring("1", "r + 1"), range(3, 4))
    assert [d.code for d in found] == ["bad-index"], found
    assert "'parts[r + 1]' is slice 3 of 'parts'" in found[0].message
    assert "(at W=3, h=0, r=2)" in found[0].message


def test_an_index_of_the_rank_needs_a_world() -> None:
    with pytest.raises(DiagnosticError) as err:
        parse_text(_ring("1", "r"), "s.yaml", None)
    assert [d.code for d in err.value.diagnostics] == ["loop-world"]
    assert "names the rank 'r'" in err.value.diagnostics[0].message


@pytest.mark.parametrize("index,words", [
    ("(r - h) % (W + 1)", "here it is '(W + 1)'"),
    ("(r - h) % M", "here it is 'M'"),
    ("rank", "names 'rank', which is not the hop index"),
])
def test_a_bad_owner_index_is_bad_index(index: str, words: str) -> None:
    found = _errors(_ring("W", index), range(2, 3))
    assert [d.code for d in found] == ["bad-index"], found
    assert words in found[0].message, found[0].message


def test_an_index_written_with_rank_says_an_index_writes_it_r() -> None:
    """Review finding: 'parts[rank]' (the when: condition's name) said only that 'rank'
    is not the hop index, W or an integer size."""
    found = _errors(_ring("W", "(rank - h) % W"), range(2, 3))
    assert [d.code for d in found] == ["bad-index"], found
    assert "an index writes the rank as 'r' ('rank' is its name in a when: condition)" in (
        found[0].message), found[0].message
    assert found[0].hint == "write 'parts[(r - h) % W]'", found[0].hint


def test_an_owner_index_on_a_communication_step_is_refused_once() -> None:
    text = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  g: {shape: [W, N, D], dtype: f32, symmetric: true}
steps:
  - send: {op: shift, src: x, dst: "g[W - 1 - r]", offset: next}
  - done: {op: barrier}
"""
    found = _errors(text, range(3, 4))  # (a rotation, 'g[r]', is one step: test_rank_rotation)
    assert [d.code for d in found] == ["bad-index"], found
    assert "step 'send' (shift) has an index that names the rank" in found[0].message
    assert (found[0].mark.line, found[0].mark.col) == (7, 36)


def test_a_mesh_coordinate_index_on_a_communication_step_in_a_loop_is_named_once() -> None:
    """Review finding: the message said "names the rank 'r'" for ``g[gpu]`` and came once
    per hop copy ('send_h0', 'send_h1'); it names the coordinate and the step as written."""
    text = """\
schedule: s
mesh: {node: N, gpu: G}
sizes: {T: 4, D: 2}
buffers: {x: {shape: [T, D], dtype: f32}, g: {shape: [G, T, D], dtype: f32, symmetric: true}}
steps:
  - hops:
      repeat: 2
      as: h
      steps:
        - send: {op: shift, src: x, dst: "g[gpu]", offset: next, axis: gpu}
  - done: {op: barrier}
"""
    world = MeshWorld([2, 2])
    found = [d for d in structural.check(parse_text(text, "s.yaml", world), [world])
             if d.severity == "error"]
    assert [d.code for d in found] == ["bad-index"], found
    assert ("step 'send' (shift) has an index that names the rank's mesh coordinate "
            "'gpu', but it communicates") in found[0].message, found[0].message
    assert (found[0].mark.line, found[0].mark.col) == (10, 42)
    with pytest.raises(DiagnosticError) as err:  # no shape given: which name it needs
        parse_text(text, "s.yaml", None)
    assert "names the rank's mesh coordinate 'gpu'" in err.value.diagnostics[0].message


def test_a_symmetric_buffer_used_whole_and_by_slice_stays_mixed_index() -> None:
    text = _ring().replace("parts: {shape: [W, N, D], dtype: f32}",
                           "parts: {shape: [W, N, D], dtype: f32, symmetric: true}")
    with pytest.raises(DiagnosticError) as err:
        parse_text(text, "s.yaml", 3)
    assert [d.code for d in err.value.diagnostics] == ["mixed-index"]


# an owner-indexed reader of symmetric slices: even ranks read what prev sent, odd ranks
# what next sent; with nothing after it, the next call's shift into that slice races the
# read (on the ranks that read it); with the barrier after it, clean
GATHERED = """\
schedule: s
sizes: {N: 4, D: 2}
buffers:
  x: {shape: [N, D], dtype: f32}
  y: {shape: [N, D], dtype: f32}
  g: {shape: [2, N, D], dtype: f32, symmetric: true}
steps:
  - right: {op: shift, src: x, dst: "g[0]", offset: next}
  - left: {op: shift, src: x, dst: "g[1]", offset: prev}
  - use: {op: external, reads: ["g[r % 2]"], writes: [y]}
"""


@pytest.mark.parametrize("tail", ["", "  - done: {op: barrier}\n"], ids=["racy", "clean"])
def test_checker_brute_force_and_execution_oracle_agree_on_an_owner_indexed_race(
        tail: str) -> None:
    for world in (2, 3, 4):
        try:
            schedule = parse_text(GATHERED + tail, "s.yaml", world)
        except DiagnosticError as err:
            pytest.fail(str(err.diagnostics))
        assert [d for d in structural.check(schedule, [world]) if d.severity == "error"] == []
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        brute = oracle_keys(schedule, world)
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == brute == executed, (world, checker, brute, executed)
        assert bool(checker) is (tail == ""), (world, checker)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pass_kv_s_reference_holds_each_block_s_partial_in_its_owner_s_slot(
        world: int) -> None:
    """The float64 reference of the gallery's pass-KV ring: on rank r, slot j of the
    partials is what the hop that attended rank j's block wrote (its copy for rank r),
    and the whole buffer the merge reads is those slices, stacked."""
    schedule = parse_file(PASS_KV, world)
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world, None),
                             0, 0)
    inputs = synth.call_inputs(schedule, world, sizes, 0, 0)
    seen: dict[tuple[int, str], str] = {}  # (rank, slot buffer) -> the step that wrote it
    external = synth.make_external(schedule, world, sizes, 0, 0)

    def spy(step, rank, bufs):  # noqa: ANN001, ANN202
        out = external(step, rank, bufs)
        # the reference runs a guarded step on every rank, into throwaway buffers
        # where it does not run (simulate.Sim.guarded): count where it runs
        for name in out if wh.runs(schedule, step, rank, world) else ():
            if name.startswith("o_parts_"):
                seen[(rank, name)] = step.name
        return out

    final = simulate_call(schedule, world, sizes, inputs, spy)
    for rank in range(world):
        for j in range(world):
            s = (rank - j) % world  # ring step s holds the block of rank r - s
            want = ("attend_first" if s == 0 else "attend_last" if s == world - 1
                    else f"attend_h{s - 1}") + f"_r{rank}"
            assert seen[(rank, f"o_parts_{j}")] == want, (rank, j, seen)
            got = final[rank]["o_parts"][j]
            assert torch.equal(got.nan_to_num(7.0), final[rank][f"o_parts_{j}"].nan_to_num(7.0))


@pytest.mark.parametrize("path", [PASS_KV, PASS_Q], ids=lambda p: p.stem)
def test_the_meta_cp_layouts_are_proved_and_their_flow_is_exact(path: Path) -> None:
    for world in (2, 3, 4, 5):
        schedule = parse_file(path, world)
        assert [d for d in structural.check(schedule, [world]) if d.severity == "error"] == []
        assert schedule.slices == {"o_parts": world, "lse_parts": world}


def test_the_step_bound_counts_a_copy_per_rank_before_unrolling() -> None:
    """The bounds found from the trip counts alone (loop-too-long, the per-W budget)
    count an owner-indexed step once per rank: exact for pass-KV, whose ranks all take
    different slots, so W = 21 (525 steps) is refused before any step is rewritten."""
    raw = yamlsrc.load(PASS_KV.read_text(), str(PASS_KV))
    for world in (2, 3, 4, 5, 6, 14):
        assert loops.unrolled_length(raw, world) == len(parse_file(PASS_KV, world).step_list())
    assert loops.unrolled_length(raw, 20) == 480 <= loops.MAX_STEPS
    assert loops.unrolled_length(raw, 21) == 525 > loops.MAX_STEPS
    assert loops.first_too_long(raw, list(range(2, 41))) == 21


def test_an_input_used_whole_and_by_slice_is_one_memory_in_the_reference() -> None:
    """An engine input read whole and by the rank's slice: the call's inputs give the
    slice the whole's values (they were two independent random tensors)."""
    text = """\
schedule: s
sizes: {T: {max: 4}, D: 8}
buffers:
  x: {shape: [W, T, D], dtype: f32}
  y: {shape: [T, D], dtype: f32}
  z: {shape: [T, D], dtype: f32}
steps:
  - mine: {op: copy, src: "x[r]", dst: y}
  - all: {op: sum, src: x, dst: z}
"""
    world = 3
    schedule = parse_text(text, "s.yaml", world)
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world, None),
                             0, 0)
    inputs = synth.call_inputs(schedule, world, sizes, 0, 0)
    final = simulate_call(schedule, world, sizes, inputs,
                          synth.make_external(schedule, world, sizes, 0, 0))
    for rank in range(world):
        assert torch.equal(final[rank]["y"], final[rank]["x"][rank])


def test_a_step_s_own_when_joins_its_owner_guard_and_keeps_its_place() -> None:
    text = _ring().replace('- attend: {op: external, reads',
                           '- attend: {op: external, when: "rank > 0", reads')
    schedule = parse_text(text, "s.yaml", 2)
    first = schedule.step_list()[0]
    assert first.name == "attend_h0_r0" and first.op.when == "(rank > 0) and (rank == 0)"
    assert (first.op.mark("when").line, first.op.mark("when").col) == (12, 40)
    # rank 0 writes nothing at hop 0 now: slot 0 is missing there
    found = [d for d in structural.check(schedule, [2]) if d.severity == "error"]
    assert "reads 'parts[0]' ('parts_0') on rank 0 at W=2" in found[0].message
    bad = text.replace('"rank > 0"', '"rank >"')
    found = _errors(bad, range(2, 3))
    assert {d.code for d in found} == {"bad-when"}
    assert (found[0].mark.line, found[0].mark.col) == (12, 40)


def test_an_index_of_a_mesh_coordinate_unrolls_per_shape() -> None:
    schedule = parse_text(mesh_owner("G - 1"), "s.yaml", MeshWorld([2, 3]))
    assert schedule.loop_world == (2, 3)  # the coordinates are the shape's
    by_name = {s.name: s.op for s in schedule.step_list()}
    # rank = 3 * node + gpu: gpu 0 is ranks 0 and 3
    assert (by_name["put_r0"].when, by_name["put_r0"].writes) == ("rank == 0 or rank == 3",
                                                                  ["parts_0"])
    assert (by_name["other_h1_r2"].when, by_name["other_h1_r2"].writes) == (
        "rank == 2 or rank == 5", ["parts_1"])
    assert by_name["mine_r1"].src == "parts_1" and by_name["all"].src == "parts"
    found = [d for d in structural.check(schedule, [MeshWorld([2, 3])])
             if d.severity == "error"]
    assert found == []


def test_a_flat_world_for_a_mesh_file_says_the_file_declares_a_mesh() -> None:
    """Review finding: '--world 4' on this file said 'parts[gpu]' indexes a buffer "whose
    leading axis is not an integer" (G, unbound by a flat W)."""
    with pytest.raises(DiagnosticError) as err:
        parse_text(mesh_owner("G - 1"), "s.yaml", 4)
    found = err.value.diagnostics
    assert {d.code for d in found} == {"loop-world"}, found
    first = found[0]
    assert (first.mark.line, first.mark.col) == (10, 45)
    assert ("'parts[gpu]' indexes buffer 'parts', whose leading axis is G (the size of "
            "mesh axis 'gpu')") in first.message, first.message
    assert ("the file declares a mesh (node x gpu), and the group size 4 given is no mesh "
            "shape") in first.message
    assert all(d.hint == "give --world as a mesh shape, e.g. --world 2x2" for d in found)


def test_a_missing_coordinate_hop_is_read_before_write() -> None:
    schedule = parse_text(mesh_owner("G - 2"), "s.yaml", MeshWorld([2, 3]))
    found = [d for d in structural.check(schedule, [MeshWorld([2, 3])])
             if d.severity == "error"]
    assert {d.code for d in found} == {"read-before-write"}, found
    assert "step 'all' reads 'parts[2]' ('parts_2') on rank 0" in found[0].message


@pytest.mark.parametrize("step", [
    '  - fill: {op: copy, src: y, dst: "parts[r]"}\n',  # a slice, by the rank
    '  - fill: {op: copy, src: y, dst: "parts[0]"}\n',  # a slice, fixed
])
def test_a_method_that_writes_a_view_of_the_engine_s_tensor_is_mixed_index(step: str) -> None:
    """The module owns what a method writes (dcpc.codegen.lower), so a slice a method
    writes would be no view of the engine's whole tensor: refused, at the write."""
    text = _ring() + step
    found = _errors(text, range(2, 3))
    assert [d.code for d in found] == ["mixed-index"], found
    assert "writes slice 'parts[0]'" in found[0].message and "copy" in found[0].message
    assert found[0].mark.line == 14


META = sorted([PASS_KV, PASS_Q, *(ROOT / "tests" / "gallery_twins").glob("meta_cp_*.yaml")])


@pytest.mark.parametrize("path", META, ids=lambda p: p.stem)
def test_the_meta_cp_layouts_and_their_twins_agree_with_both_oracles(path: Path) -> None:
    """Clean, their twins without the hop credit racing from W = 4 on, as the checker,
    the brute force and the execution oracle all find; pass-Q's early give_back is the
    data flow's (read-before-write on every W), not a race."""
    for world in (2, 3, 4):
        schedule = parse_file(path, world)
        if "early_give_back" in path.stem:
            assert {d.code for d in structural.check(schedule, [world])
                    if d.severity == "error"} == {"read-before-write"}
            continue
        checker = {f.key for f in hb.check(schedule, [world], hints=False).findings}
        assert checker == oracle_keys(schedule, world), (path.name, world)
        executed = {f.key for f in explore(lower(schedule, [world]), world,
                                           randoms=2).findings}
        assert checker == executed, (path.name, world)
        assert bool(checker) is ("no_hop_credit" in path.stem and world >= 4)
