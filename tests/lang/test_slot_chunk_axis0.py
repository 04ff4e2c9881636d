"""A chunk of a slot along the slot's axis 0 (``ring[c % S][(r - k) % W]``): block m of
a ring slot [W, C, D] of the module's symmetric memory, what source m's ragged put
(``offset``) stores there, read by an external step per source (dcpc.lang.loops
``_Unroller._chunk``). The race models are chunk-precise for it: a local access of chunk
j and a store of scheme ``index`` along that axis whose part (the writer's member
index) is not j are apart, in the checker (dcpc.check.hb.races ``_meets``), the
execution oracle (dcpc.check.oracle) and the brute force (tests/support/hb_oracle.py);
every other pair is taken whole, as before.

tests/lang/slot_chunk_axis0.yaml: per source the reader lands its block, reads that
block alone and frees that source's head; a sender waits for its destination's head
right before it refills its block (DeepEP's forwarder, round-robin over the sources)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.exec_oracle_agree import disagreements
from support.exec_oracle_gen import RING_FREE, RING_LAND, RING_OWN, RING_TAKE
from support.hb_oracle import oracle_keys

from dcpc.check import hb, structural
from dcpc.codegen.lower import lower
from dcpc.codegen.plan import chunks, views
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_text

ROOT = Path(__file__).resolve().parents[2]
FILE = Path(__file__).with_name("slot_chunk_axis0.yaml")
TEXT = FILE.read_text()
# the ring's texts the random changes of the agreement tests edit too
LAND, TAKE, OWN, FREE = RING_LAND, RING_TAKE, RING_OWN, RING_FREE


def twin(*changes: str) -> str:
    text = TEXT
    for old, new in zip(changes[::2], changes[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new)
    return text


# the wrong twins: (a) source k's chunk read before its landing wait; (b) the head
# signalled to the wrong source (offset h + 1, not -(h + 1)); (c) the whole slot read
# after the own block's landing only
EARLY = twin(LAND + TAKE, TAKE + LAND)
WRONG_HEAD = twin(FREE, '- free: {op: signal, offset: "h + 1", channel: head}')
WHOLE = twin(OWN, '        - take_own: {op: external, reads: ["ring[c % S]"], writes: ["z[c]"]}',
             "  y: {shape", "  z: {shape: [P, W, C, D], dtype: f32}\n  y: {shape")


def errors(text: str, world: int = 3) -> list:
    try:
        return [d for d in structural.check(parse_text(text, "s.yaml", world), [world])
                if d.severity == "error"]
    except DiagnosticError as error:
        return list(error.diagnostics)


def test_a_slot_s_chunk_along_its_axis_0_is_a_view_of_the_slot() -> None:
    schedule = parse_text(TEXT, "s.yaml", 3)
    buffers = schedule.buffers
    assert "ring" not in buffers and buffers["ring_0"].shape == ["W", "C", "D"]
    assert buffers["ring_1_2"].shape == ["C", "D"] and buffers["ring_1_2"].symmetric
    assert schedule.slice_text("ring_0_1") == "ring[0][1]"  # as the file writes it
    # per rank copies (the index names the rank): rank 1 reads block (1 - 1) % 3 = 0
    take = {s.name: s.op.reads for s in schedule.step_list() if s.name.startswith("take_h0_0")}
    assert take == {"take_h0_0_r0": ["ring_0_2"], "take_h0_0_r1": ["ring_0_0"],
                    "take_h0_0_r2": ["ring_0_1"]}, take
    slot = torch.arange(3 * 2 * 4, dtype=torch.float64).view(3, 2, 4)
    assert torch.equal(schedule.view("ring_0", slot, 2), slot[2])
    plan = lower(schedule, [3])
    assert views(plan.buffers)["ring_0_2"] == "ring_0"
    assert chunks(plan.buffers)["ring_1_2"] == (0, 2)
    assert {b.name: b.kind for b in plan.buffers}["ring_0_0"] == "engine"
    assert ("ring_0_2 is module.buffer('ring_0').select(0, 2): a view of the module's "
            "memory") in "\n".join(plan.contract), plan.contract


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_three_race_models_prove_it_and_agree(world: int) -> None:
    """Proved (no race, no deadlock) by the checker, the brute force and the execution
    oracle: source m's put into block m of a slot while this rank reads block m' != m
    is apart (the coarse model, the slot whole, refused it: a write-after-read race)."""
    schedule = parse_text(TEXT, str(FILE), world)
    assert errors(TEXT, world) == []
    assert hb.check(schedule, [world], hints=False).findings == []
    assert oracle_keys(schedule, world) == set()
    assert disagreements(schedule, [world]) == []


@pytest.mark.parametrize(("text", "world", "step", "chunk"), [
    (EARLY, 3, "take_h0_0_r0", "ring[0][2]"),       # source 2's block, before its landing
    (WRONG_HEAD, 3, "take_h0_1_r0", "ring[0][1]"),  # source 1 refills: head went to 2
    (WHOLE, 3, "take_own_h0", None),                # the whole slot, one landing in
])
def test_a_wrong_twin_is_refused_with_the_chunk_it_reads(text: str, world: int, step: str,
                                                         chunk: str | None) -> None:
    """Each twin is a write-after-read race on the slot ring_0 whose counterexample names
    the reading step on rank 0 and the chunk as the file writes it; the three models
    agree on it (every race key, at W = 2, 3, 4; the checker and the brute force at W = 8
    too, where the file unrolls to 310 steps: past the step bound of 256 before session
    34)."""
    schedule = parse_text(text, "s.yaml", world)
    found = hb.check(schedule, [world], hints=False).findings
    race = next(f for f in found if f.key[:2] == ("race", "write-after-read")
                and f.key[2] == "ring_0" and step in f.key[3:])
    text_of = race.diagnostic().message + "\n".join(race.diagnostic().notes)
    assert f"{step} on rank 0" in text_of, text_of
    read = (race.first if race.first.access == "read" else race.second).text()
    if chunk is not None:
        assert f"(its chunk {chunk})" in read, read
    else:
        assert "its chunk" not in read and "ring_0[rank 0, slot 0]" in read, read
    for w in (2, 3, 4, 8):
        at = parse_text(text, "s.yaml", w)
        assert w < 8 or len(at.step_list()) > 256, len(at.step_list())
        keys = {f.key for f in hb.check(at, [w], hints=False).findings}
        assert (w < 8 or keys) and keys == oracle_keys(at, w), w
        if w < 4:
            assert disagreements(at, [w]) == [], w


@pytest.mark.parametrize(("change", "code", "where", "words", "hint"), [
    # an engine-owned buffer: a name takes one index (today's refusal and hint)
    ((OWN, OWN.replace('"ring[c % S][r]"', '"x[c][r]"')), "bad-index", (43, 43),
     "'x[c][r]' has more than one index", "and write 'x[3 * (c) + r]'"),
    # a method's operand: the slot whole, or the chunk in an external step
    ((OWN, OWN + '\n        - keep: {op: copy, src: "ring[c % S][r]", dst: "y[W * c + r]"}'),
     "bad-index", (44, 33), "along the slot's axis 0 in a step of op 'copy'",
     "name the whole slot 'ring[c % S]' here"),
    # out of range: names W, the hop and the rank
    ((OWN, OWN.replace('"ring[c % S][r]"', '"ring[c % S][r + W]"')), "bad-index", (43, 43),
     "is chunk 3 of a slot of 'ring', whose axis 1 has 3 slices (0..2) (at W=3, c=0, r=0)",
     None),
    # one slot sliced along two axes
    (("C: {max: 3}", "C: 3", OWN,
      OWN + '\n        - half: {op: external, reads: ["ring[0][:, 1]"], writes: ["y[0]"]}'),
     "mixed-index", (44, 39), "'ring[0][:, 1]' slices axis 1 of slot 'ring_0', which "
     "'ring[c % S][r]' at s.yaml:43:43 slices along axis 0", None),
    # a 1-d slot's chunk (a 0-d view) in a method's operand: the external step only
    (("  y: {shape", "  cnt: {shape: [S, W], dtype: i32, symmetric: true}\n  c1: {shape: "
      "[12, W], dtype: i32}\n  y: {shape", OWN,
      OWN + '\n        - keep: {op: copy, src: "cnt[c % S][r]", dst: "c1[W * c + r]"}'),
     "bad-index", (46, 33), "along the slot's axis 0 in a step of op 'copy'",
     "name the whole slot 'cnt[c % S]' here"),
    # a 1-d slot's chunk out of range: its axis is the slot's last
    (("  y: {shape", "  cnt: {shape: [S, W], dtype: i32, symmetric: true}\n  y: {shape",
      OWN, OWN.replace('"ring[c % S][r]"', '"ring[c % S][r]", "cnt[c % S][r + W]"')),
     "bad-index", (44, 43), "is chunk 3 of a slot of 'cnt', whose axis 1 has 3 slices", None),
    # a declared buffer of no axis stays refused (the 0-d view is the unroller's only)
    (("  y: {shape", "  e: {shape: [], dtype: i32}\n  y: {shape"), "wrong-length", (13, 14),
     "'buffers.e.shape': list should have at least 1 item after validation, not 0", None),
])
def test_a_refused_axis_0_chunk_is_located(change: tuple[str, ...], code: str,
                                           where: tuple[int, int], words: str,
                                           hint: str | None) -> None:
    found = errors(twin(*change))
    assert found and found[0].code == code, found
    assert words in found[0].message, found[0]
    assert hint is None or hint in (found[0].hint or ""), found[0]
    assert (found[0].mark.file, found[0].mark.line, found[0].mark.col) == ("s.yaml", *where)


def test_the_trailing_axis_of_1_form_is_still_taken() -> None:
    """A trailing axis of 1: the slot's chunk is [1] (an element of each source)."""
    text = twin("  y: {shape", "  cnt: {shape: [S, W, 1], dtype: i32, symmetric: true}\n"
                "  c1: {shape: [12, 1], dtype: i32}\n  y: {shape",
                OWN, OWN + '\n        - count: {op: external, reads: ["cnt[c % S][r]"], '
                'writes: ["c1[W * c + r]"]}')
    schedule = parse_text(text, "s.yaml", 3)  # unrolled: the index is taken
    assert schedule.buffers["cnt_0_1"].shape == [1]
    assert schedule.slice_text("cnt_0_1") == "cnt[0][1]"


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3])
def test_a_run_gives_the_engine_each_source_s_block(world: int) -> None:
    """`dcpc run` (host backend): each read of a source's block is the view of the slot
    in the module's memory, compared against the float64 reference (rows past a count
    are the view of the landing's unsent rows), 0 mismatches."""
    report = run_schedule(RunConfig(schedule=str(FILE), world=world, backend="host",
                                    calls=2, seed=3))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["ring_0_0"].compared > 0, text


MESH = FILE.with_name("slot_chunk_axis0_mesh.yaml")


@pytest.mark.parametrize("shape", [(2, 2), (3, 2)])
def test_a_mesh_coordinate_names_the_chunk(shape: tuple[int, int]) -> None:
    """The same ring along the node axis of a node x gpu mesh, the chunk named by the
    node coordinate (``ring[c % S][(node - (h + 1)) % N]``, as deepep_normal's
    ``x_rail[c % R][(node - k) % N]`` would): proved by the checker and the brute force;
    the wrong head (offset h + 1) refused by both alike, naming the chunk."""
    from dcpc.lang.mesh import MeshWorld

    world = MeshWorld(shape)
    text = MESH.read_text()
    good = parse_text(text, str(MESH), world)
    assert hb.check(good, [world], hints=False).findings == []
    assert oracle_keys(good, world) == set()
    wrong = parse_text(text.replace(
        '- free: {op: signal, axis: node, offset: "0 - (h + 1)", channel: head}',
        '- free: {op: signal, axis: node, offset: "h + 1", channel: head}'), "w.yaml", world)
    found = hb.check(wrong, [world], hints=False).findings
    assert {f.key for f in found} == oracle_keys(wrong, world)
    if shape[0] == 3:  # at two nodes -(h + 1) and h + 1 are one peer
        race = next(f for f in found if "take_h0_1_r0" in f.key[3:])
        assert "(its chunk ring[0][1])" in "\n".join(race.diagnostic().notes), race
    else:
        assert found == []


# a 1-d slot's chunk: source m's count alone, cnt[c % S][m] of cnt [S, W] (the recv_counts
# of the ragged puts, [W] per slot), a 0-d view of the module's memory
COUNTS = FILE.with_name("slot_chunk_axis0_counts.yaml")
COUNTS_TEXT = COUNTS.read_text()
OWN_COUNT = '"ring[c % S][r]", "cnt[c % S][r]"'


def counts_twin(old: str, new: str) -> str:
    assert old in COUNTS_TEXT, old
    return COUNTS_TEXT.replace(old, new)


# the count read whole (every source's) after the own landing only: the others' counts
# are in flight
WHOLE_COUNT = counts_twin(OWN_COUNT, '"ring[c % S][r]", "cnt[c % S]"')


def test_a_1d_slot_s_chunk_is_a_0d_view_of_the_slot() -> None:
    schedule = parse_text(COUNTS_TEXT, str(COUNTS), 3)
    buffers = schedule.buffers
    assert "cnt" not in buffers and buffers["cnt_0"].shape == ["W"]
    assert buffers["cnt_1_2"].shape == [] and buffers["cnt_1_2"].symmetric
    assert schedule.slice_text("cnt_0_1") == "cnt[0][1]"
    take = {s.name: s.op.reads for s in schedule.step_list() if s.name.startswith("take_h0_0")}
    assert take["take_h0_0_r1"] == ["ring_0_0", "cnt_0_0"], take
    slot = torch.tensor([5, 6, 7], dtype=torch.int32)
    one = schedule.view("cnt_0", slot, 2)  # torch's n[c][m]: 0-d, writes through
    assert one.dim() == 0 and int(one) == 7
    one.fill_(9)
    assert slot.tolist() == [5, 6, 9]
    plan = lower(schedule, [3])
    assert views(plan.buffers)["cnt_0_2"] == "cnt_0"
    assert chunks(plan.buffers)["cnt_1_2"] == (0, 2)
    entry = {b.name: b for b in plan.buffers}["cnt_0_1"]
    assert entry.kind == "engine" and list(entry.shape) == [], entry
    assert ("cnt_0_1 is module.buffer('cnt_0').select(0, 1): a view of the module's "
            "memory") in "\n".join(plan.contract), plan.contract


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_source_s_count_alone_is_proved(world: int) -> None:
    """Source m's count lands with its block (recv_counts index m of the slot), so
    reading count m after source m's landing only is apart from the other sources' puts
    of counts: proved by the three race models alike."""
    schedule = parse_text(COUNTS_TEXT, str(COUNTS), world)
    assert errors(COUNTS_TEXT, world) == []
    assert hb.check(schedule, [world], hints=False).findings == []
    assert oracle_keys(schedule, world) == set()
    assert disagreements(schedule, [world]) == []


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_count_read_whole_races_on_cnt(world: int) -> None:
    """The whole count slot read after the own landing only: a write-after-read race
    on the slot cnt_0 (another source's count in flight), the three models agreeing."""
    schedule = parse_text(WHOLE_COUNT, "s.yaml", world)
    found = hb.check(schedule, [world], hints=False).findings
    races = [f for f in found if f.key[:3] == ("race", "write-after-read", "cnt_0")]
    assert races, [f.key for f in found]
    text_of = races[0].diagnostic().message
    assert "race on cnt_0: take_own_h0_r" in text_of, text_of
    assert {f.key for f in found} == oracle_keys(schedule, world)
    if world < 4:
        assert disagreements(schedule, [world]) == [], world


def test_the_wrong_head_names_the_count_it_reads() -> None:
    """The head signalled to the wrong source: source 1 refills its count while rank 0
    reads it; the counterexample names the chunk as the file writes it, cnt[0][1]."""
    text = counts_twin(FREE, '- free: {op: signal, offset: "h + 1", channel: head}')
    schedule = parse_text(text, "s.yaml", 3)
    found = hb.check(schedule, [3], hints=False).findings
    race = next(f for f in found if f.key[:3] == ("race", "write-after-read", "cnt_0")
                and "take_h0_1_r0" in f.key[3:])
    read = (race.first if race.first.access == "read" else race.second).text()
    assert "(its chunk cnt[0][1])" in read, read
    assert {f.key for f in found} == oracle_keys(schedule, 3)


@pytest.mark.e2e
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_run_gives_the_engine_each_source_s_count(world: int) -> None:
    """`dcpc run` (host backend): each count read is the 0-d view of the slot in the
    module's memory, compared against the float64 reference, 0 mismatches."""
    report = run_schedule(RunConfig(schedule=str(COUNTS), world=world, backend="host",
                                    calls=2, seed=3))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["cnt_0_0"].compared > 0, text
    assert report.outputs["cnt_0_1"].compared > 0, text


@pytest.mark.e2e
def test_an_external_step_writes_a_0d_view(tmp_path: Path) -> None:
    """An external step that writes source r's count back (cnt[c % S][r] read and
    written): the synthetic step's 0-d value lands in the module's memory through the
    view, and the run matches the float64 reference."""
    own = ('        - take_own: {op: external, reads: [' + OWN_COUNT
           + '], writes: ["y[W * c + r]"]}\n')
    text = counts_twin(own, own + '        - keep_own: {op: external, reads: ["cnt[c % S][r]"], '
                       'writes: ["cnt[c % S][r]"]}\n')
    path = tmp_path / "keep.yaml"
    path.write_text(text)
    assert hb.check(parse_text(text, str(path), 3), [3], hints=False).findings == []
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="host", calls=2,
                                    seed=3))
    assert report.launch.ok and report.mismatches == 0, format_report(report)


@pytest.mark.e2e
def test_the_wrong_head_replayed_reads_the_next_count(tmp_path: Path) -> None:
    """The wrong head's race on the count (cnt_0, its chunk cnt[0][1]), replayed: rank
    0's read of source 1's count is held until source 1's refill of the slot ran, and
    the 0-d view then holds the next chunk's count, not the reference's."""
    import json

    from dcpc.harness.replay import plan

    text = counts_twin(FREE, '- free: {op: signal, offset: "h + 1", channel: head}')
    twin_file = tmp_path / "wrong_head.yaml"
    twin_file.write_text(text)
    done = subprocess.run([sys.executable, "-m", "dcpc", "check", str(twin_file), "--world",
                           "3", "--format", "json"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    first = json.loads(done.stdout)["results"][0]["diagnostics"][0]["message"]
    assert first.startswith("write-after-read race on cnt_0: take_h0_1_r0 on rank 0"), first
    (tmp_path / "race.json").write_text(done.stdout)
    replay = plan(str(tmp_path / "race.json"), str(twin_file), None)
    report = run_schedule(RunConfig(schedule=str(twin_file), world=3, backend="host",
                                    calls=replay.calls, wait_timeout_s=240, replay=replay))
    shown = format_report(report)
    assert report.replay_outcome.startswith("released"), shown
    assert report.outputs["cnt_0_1"].first_mismatch.startswith(
        "call 0 slot 0 rank 0 (take_h0_1_r0 reads): cnt_0_1[]"), shown


FIXED = """\
schedule: fixed_chunks
doc: every rank reads block h of its slot, h a hop index (no rank in the index)
sizes: {C: 2, D: 4}
buffers:
  x: {shape: [W, C, D], dtype: f32}
  n: {shape: [W], dtype: i32}
  ring: {shape: [1, W, C, D], dtype: f32, symmetric: true}
  y: {shape: [W, C, D], dtype: f32}
steps:
  - put: {op: ragged_all_to_all, phase: put, src: x, dst: "ring[0]", counts: n, capacity: C}
  - got: {op: ragged_all_to_all, phase: wait, src: x, dst: "ring[0]", counts: n, capacity: C}
  - take:
      repeat: W
      as: h
      steps:
        - t: {op: external, reads: ["ring[0][h]"], writes: ["y[h]"]}
"""


def test_a_chunk_race_s_counterexample_names_a_pair_that_meets() -> None:
    """A chunk index that does not name the rank (no guarded copies): the race of t_h0
    (block 0) with the next call's put is shown on the rank whose block 0 that put
    writes, rank 1 reading against rank 0's put (block 0 of rank 1's slot), not rank 0's
    read against rank 1's put (block 1: apart), so that its replay shows the race."""
    schedule = parse_text(FIXED, "s.yaml", 2)
    found = hb.check(schedule, [2], hints=False).findings
    race = next(f for f in found if "t_h0" in f.key[3:])
    read = race.first if race.first.access == "read" else race.second
    store = race.second if read is race.first else race.first
    # block 0 of a slot is what rank 0 puts there: the pair meets only if the store is
    # rank 0's, into another rank's slot
    assert "(its chunk ring[0][0])" in read.text(), read.text()
    assert (store.rank, read.rank) == (0, 1), race.message
    assert "index 0 of dim 0" in store.text(), store.text()
    assert {f.key for f in found} == oracle_keys(schedule, 2)
