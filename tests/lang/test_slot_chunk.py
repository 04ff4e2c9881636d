"""A chunk of a slot of the module's memory (``recv[h % 2][:, 0]``): slot e1 of the
leading axis of a symmetric or shared buffer (persist or not; of a persist-only one it
is refused), then one later axis of the slot,
taken by external steps (dcpc.lang.loops ``_Unroller._chunk``). The slot stays what
shifts move (a contiguous buffer of its own); its chunks are views of it
(Schedule.view): disjoint in the data flow, the slot in the race models, the rows of
the module's memory in `dcpc run`. Every other form is refused where it is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc.check import hb, structural
from dcpc.codegen.lower import lower
from dcpc.codegen.plan import views
from dcpc.diagnostics import DiagnosticError
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import alias_views
from dcpc.lang.parse import parse_text

# a ring of W - 1 hops: the own block goes into slot 0 of the next rank, each hop passes
# the slot in hand on and reads its first chunk (k0) and its whole
TEXT = """\
schedule: s
sizes: {B: {max: 2}, C: 3, D: 4}
buffers:
  k: {shape: [B, 2, C, D], dtype: f32}
  recv: {shape: [2, B, 2, C, D], dtype: f32, symmetric: true}
  y: {shape: [B, C, D], dtype: f32}
  z: {shape: [B, 2, C, D], dtype: f32}
steps:
  - send_first: {op: shift, src: k, dst: "recv[0]", offset: next, phase: put}
  - arrive_first: {op: shift, src: k, dst: "recv[0]", offset: next, phase: wait}
  - ring:
      repeat: W - 1
      as: h
      steps:
        - low: {op: external, reads: ["recv[h % 2][:, 0]"], writes: [y]}
        - all: {op: external, reads: ["recv[h % 2]"], writes: [z]}
        - credit: {op: signal, to: prev, channel: free}
        - wait: {op: wait, from: next, channel: free}
        - send: {op: shift, src: "recv[h % 2]", dst: "recv[(h + 1) % 2]", offset: next,
                 phase: put}
        - arrive: {op: shift, src: "recv[h % 2]", dst: "recv[(h + 1) % 2]", offset: next,
                   phase: wait}
  - done: {op: signal, to: prev, channel: free}
  - end: {op: wait, from: next, channel: free}
"""


def check_errors(text: str, worlds: range) -> list:
    """The parser's or the structural check's errors of ``text`` at each W of ``worlds``
    (the ring names W: unrolled per W)."""
    found = []
    for world in worlds:
        try:
            found += [d for d in structural.check(parse_text(text, "s.yaml", world), [world])
                      if d.severity == "error"]
        except DiagnosticError as error:
            found += list(error.diagnostics)
    return found


def _where(diag) -> tuple[int, int]:  # noqa: ANN001
    return diag.mark.line, diag.mark.col


def test_a_slot_s_chunk_is_a_view_of_the_slot() -> None:
    schedule = parse_text(TEXT, "s.yaml", 3)
    buffers = schedule.buffers
    # the slots are buffers of their own (what shifts move); the chunks views of a slot
    assert "recv" not in buffers and buffers["recv_0"].shape == ["B", 2, "C", "D"]
    assert buffers["recv_0_1"].shape == ["B", "C", "D"] and buffers["recv_1_0"].symmetric
    assert schedule.slices == {"recv_0": 2, "recv_1": 2}
    assert schedule.slice_text("recv_1_0") == "recv[1][:, 0]"  # as the file writes it
    assert [s.op.reads for s in schedule.step_list() if s.name.startswith("low")] == [
        ["recv_0_0"], ["recv_1_0"]]
    # the view is the slot's rows along its axis 1 (not its leading axis)
    slot = torch.arange(2 * 2 * 3 * 4, dtype=torch.float64).view(2, 2, 3, 4)
    assert torch.equal(schedule.view("recv_0", slot, 1), slot[:, 1])
    # the module allocates no chunk: the engine's view of the slot, which the race
    # models take its accesses as
    plan = lower(schedule, [3])
    assert views(plan.buffers) == {f"recv_{s}_{i}": f"recv_{s}" for s in (0, 1) for i in (0, 1)}
    assert {b.name: b.kind for b in plan.buffers}["recv_0_0"] == "engine"
    # the emitted contract names the view the engine takes (axis 1 of the slot)
    assert ("recv_1_0 is module.buffer('recv_1').select(1, 0): a view of the module's "
            "memory") in "\n".join(plan.contract), plan.contract
    assert check_errors(TEXT, range(2, 5)) == []


def test_two_chunks_of_a_slot_are_disjoint_and_the_slot_covers_both() -> None:
    """A chunk written by the engine is not the other chunk (read-before-write names it
    as written); a whole write of the slot (a shift's landing) writes both."""
    text = TEXT.replace('  - arrive_first: {op: shift, src: k, dst: "recv[0]", offset: '
                        'next, phase: wait}\n', "").replace(
        '  - send_first: {op: shift, src: k, dst: "recv[0]", offset: next, phase: put}\n',
        '  - fill: {op: external, reads: ["k[:, 0]"], writes: ["recv[0][:, 0]"]}\n')
    found = check_errors(text, range(2, 3))
    assert [d.code for d in found] == ["read-before-write"], found
    # the whole slot, read by 'all' and sent on: chunk 1 was never written
    assert "reads symmetric buffer 'recv[0][:, 1]' ('recv_0_1')" in found[0].message, found[0]
    assert _where(found[0]) == (15, 39), found[0]
    schedule = parse_text(TEXT, "s.yaml", 2)
    bufs = {"recv_0": torch.randn(2, 2, 3, 4, dtype=torch.float64)}
    assert alias_views(schedule, bufs, "recv_0", lambda _: None) == ["recv_0_0", "recv_0_1"]
    assert torch.equal(bufs["recv_0_1"], bufs["recv_0"][:, 1])


def test_a_chunk_read_races_with_the_next_put_into_its_slot() -> None:
    """Without the credit, hop h + 1's put into the next rank's slot can land while that
    rank still reads the slot's first chunk of hop h - 1 (the race models take a chunk's
    access as one of its slot)."""
    text = TEXT.replace("        - wait: {op: wait, from: next, channel: free}\n", "").replace(
        "        - credit: {op: signal, to: prev, channel: free}\n", "")
    schedule = parse_text(text, "s.yaml", 4)
    keys = {f.key[:4] for f in hb.check(schedule, [4], hints=False).findings}
    assert ("race", "write-after-read", "recv_0", "low_h0") in keys, keys
    assert not hb.check(parse_text(TEXT, "s.yaml", 4), [4], hints=False).findings


@pytest.mark.parametrize(("change", "code", "where", "words"), [
    # the slot, then its axis: one later-axis index after the slot's
    (('"recv[h % 2][:, 0]"', '"recv[h % 2, :, 0]"'), "bad-index", (15, 38),
     "write a slot's chunk as 'recv[h % 2][:, 0]'"),
    # a method takes no chunk (a strided view)
    (('- low: {op: external, reads: ["recv[h % 2][:, 0]"], writes: [y]}',
      '- low: {op: copy, src: "recv[h % 2][:, 0]", dst: y}'), "bad-index", (15, 32),
     "slices axis 1 of 'recv' in a step of op 'copy'"),
    # an engine-owned buffer's slot has no chunk: one index
    (('"recv[h % 2][:, 0]"', '"z[h % 2][:, 0]"'), "bad-index", (15, 38),
     "'z[h % 2][:, 0]' is no chunk of a slot"),
    (('"recv[h % 2][:, 0]"', '"recv[h % 2][:, 2]"'), "bad-index", (15, 38),
     "is chunk 2 of a slot of 'recv', whose axis 2 has 2 slices (0..1)"),
    (('"recv[h % 2][:, 0]"', '"recv[h % 2][:, :, :, 0]"'), "bad-index", (15, 38),
     "whose axis 4 is not an integer"),
    (('"recv[h % 2][:, 0]"', '"recv[h % 2][:, 0][1]"'), "bad-index", (15, 38),
     "has more than one index"),
    # one slot sliced along two axes
    (('reads: ["recv[h % 2]"], writes: [z]', 'reads: ["recv[h % 2][:, :, 0]"], writes: [y]',
      "recv: {shape: [2, B, 2, C, D]", "recv: {shape: [2, B, 2, 3, D]"), "mixed-index",
     (16, 38), "slices axis 2 of slot 'recv_0', which 'recv[h % 2][:, 0]' at s.yaml:15:"),
])
def test_a_refused_chunk_is_located(change: tuple[str, ...], code: str,
                                    where: tuple[int, int], words: str) -> None:
    text = TEXT
    for old, new in zip(change[::2], change[1::2], strict=True):
        text = text.replace(old, new)
    assert text != TEXT
    found = check_errors(text, range(3, 4))
    assert found and found[0].code == code, found
    assert words in found[0].message + (found[0].hint or ""), found[0]
    assert found[0].mark.file == "s.yaml" and _where(found[0]) == where, found[0]


@pytest.mark.e2e
def test_a_run_gives_the_engine_the_rows_of_the_module_s_memory(tmp_path: Path) -> None:
    """`dcpc run` (host backend): the engine's read of a chunk is the view of the slot in
    the module's symmetric memory (poisoned at the start; a put fills the slot), compared
    against the float64 reference on every rank and hop: a view of other rows (the
    leading axis', the other chunk) would not be those values."""
    path = tmp_path / "s.yaml"
    path.write_text(TEXT)
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="host", calls=2,
                                    seed=5))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    for chunk in ("recv_0_0", "recv_1_0"):  # each hop's chunk, on all 3 ranks, 2 calls
        assert report.outputs[chunk].compared == 2 * 3, text


# a local persist buffer (the module's own, not symmetric), read by slice or by a slot's
# chunk in an external step: no view of the module's symmetric memory exists for it
PERSIST = """\
schedule: p
slots: 2
streams: single
sizes: {N: 16, D: 40}
buffers:
  x: {shape: [N, 2, D], dtype: bf16}
  last: {shape: [N, 2, D], dtype: bf16, persist: true}
  mine: {shape: [N, D], dtype: bf16}
steps:
  - recall: {op: external, reads: ["last[:, 1]"], writes: [mine]}
  - keep: {op: copy, src: x, dst: last}
"""


@pytest.mark.parametrize(("change", "words"), [
    ((), "'last[:, 1]' slices axis 1 of 'last', a persist buffer that is not symmetric"),
    (("[N, 2, D], dtype: bf16, persist", "[2, N, 2, D], dtype: bf16, persist",
      '"last[:, 1]"', '"last[0][:, 1]"', "dst: last}", 'dst: "last[0]"}'),
     "'last[0][:, 1]' slices axis 2 of 'last', a persist buffer that is not symmetric"),
])
def test_a_slice_of_a_local_persist_buffer_is_refused(change: tuple[str, ...],
                                                      words: str) -> None:
    text = PERSIST
    for old, new in zip(change[::2], change[1::2], strict=True):
        text = text.replace(old, new)
    found = check_errors(text, range(2, 3))
    assert found and found[0].code == "bad-index", found
    assert words in found[0].message, found[0]
    assert "declare 'last' 'symmetric: true'" in found[0].hint, found[0]
    assert _where(found[0]) == (10, 35), found[0]  # the read's text
    # the hint followed: symmetric (and persist), its slice is a view of the module's memory
    text = text.replace("persist: true}", "persist: true, symmetric: true}")
    assert not check_errors(text, range(2, 3))


@pytest.mark.parametrize(("change", "hint", "followed"), [
    # a chunk's unrolled name in a method: the hint names the chunk as the file writes it
    ((("- done: {op: signal", '- bare: {op: copy, src: recv_0_1, dst: y}\n  - done: {op: signal'),),
     "read 'recv[0][:, 1]' in an external step",
     ('- bare: {op: external, reads: ["recv[0][:, 1]"], writes: [y]}\n  - done: {op: signal',)),
    # a slot with an empty second index: the hint names the slot's chunk
    ((('"recv[h % 2][:, 0]"', '"recv[h % 2][:]"'),), "'recv[h % 2][:, e2]'",
     ('"recv[h % 2][:, 0]"',)),
    # an engine-owned buffer's slot: one buffer per slot, and its later-axis slice
    ((('"recv[h % 2][:, 0]"', '"z[h % 2][:, 0]"'),
      ("z: {shape: [B, 2, C, D]", "z: {shape: [2, B, 2, C, D]"),
      ('reads: ["recv[h % 2]"], writes: [z]', 'reads: ["recv[h % 2]"], writes: [y]')),
     "one buffer per slot (shape [B, 2, C, D]) and write '<that buffer>[:, e2]'",
     None),
])
def test_a_refused_chunk_s_hint_is_a_form_that_is_taken(
        change: tuple[tuple[str, str], ...], hint: str, followed: tuple[str] | None) -> None:
    text = TEXT
    for old, new in change:
        assert old in text
        text = text.replace(old, new)
    found = check_errors(text, range(3, 4))
    assert found and found[0].code == "bad-index", found
    assert hint in found[0].hint, found[0]
    if followed is not None:
        assert not check_errors(text.replace(change[0][1], followed[0]), range(3, 4))


def test_the_hint_for_an_engine_owned_slot_s_chunk_followed_is_taken() -> None:
    """One buffer per slot (z0, z1 of the slot's shape), each read by its later-axis
    slice in an external step: what the hint names, taken."""
    text = TEXT.replace("  z: {shape: [B, 2, C, D], dtype: f32}\n",
                        "  z0: {shape: [B, 2, C, D], dtype: f32}\n"
                        "  z1: {shape: [B, 2, C, D], dtype: f32}\n").replace(
        '        - low: {op: external, reads: ["recv[h % 2][:, 0]"], writes: [y]}\n'
        '        - all: {op: external, reads: ["recv[h % 2]"], writes: [z]}\n',
        '        - all: {op: external, reads: ["recv[h % 2]"], writes: [z0, z1]}\n'
        '        - low: {op: external, reads: ["z0[:, 0]", "z1[:, 0]"], writes: [y]}\n')
    assert "z0[:, 0]" in text
    assert not check_errors(text, range(3, 4))


def test_a_shared_slot_s_chunks_are_warned_of_once_per_slot() -> None:
    """A shared buffer with one slot: the slots-streams warning names each slot (a
    buffer of its own), never a chunk (a view of it)."""
    text = TEXT.replace("symmetric: true", "shared: true")
    warned = [d for d in structural.check(parse_text(text, "s.yaml", 3), [3])
              if d.code == "slots-streams"]
    assert sorted(d.message.split("'")[1] for d in warned) == ["recv_0", "recv_1"], warned
