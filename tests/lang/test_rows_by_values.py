"""Rows by values (``q[idx]``, ``recv[h % 2][idx]``): the rows of axis 0 of a buffer (of a
slot) that the values of a 1-d integer buffer name, as torch's ``q[idx]``, in an external
step's reads and writes only (dcpc.lang.loops ``_Unroller._rows``). The step reads the
index too; a rows write reads the buffer (the other rows keep their values); the race
models take the access as the whole buffer (slot). The index's ``values`` are checked for
every binding (dcpc.check.names): max below the rows, distinct where rows are written.
`dcpc run`'s synthetic step reads and writes those rows only, and the worker compares
those rows of what it reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc import pipeline
from dcpc.check import hb, structural
from dcpc.diagnostics import DiagnosticError
from dcpc.harness import synth
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.lang.parse import parse_text

# a ring of W - 1 hops: each hop reads the rows 'lo' names of the slot in hand, and the
# rows 'hi' names of q, merged into the rows 'hi' names of the symmetric 'acc'; 'acc'
# then travels whole to the next rank, where the engine reads it (compared there)
TEXT = """\
schedule: s
sizes: {N: {max: 3}, D: 4}
buffers:
  q: {shape: [2 * N, D], dtype: f32}
  k: {shape: [2 * N, D], dtype: f32}
  lens: {shape: [2], dtype: i32, values: {min: 0, max: 2 * N}}
  lo: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}
  hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}
  recv: {shape: [2, 2 * N, D], dtype: f32, symmetric: true}
  acc: {shape: [2 * N, D], dtype: f32, symmetric: true}
  got: {shape: [2 * N, D], dtype: f32, symmetric: true}
  y: {shape: [N, D], dtype: f32}
  z: {shape: [N, D], dtype: f32}
  w: {shape: [2 * N, D], dtype: f32}
steps:
  - halves: {op: external, reads: [lens], writes: [lo, hi]}
  - start: {op: external, reads: [k], writes: [acc]}
  - send_first: {op: shift, src: k, dst: "recv[0]", offset: next, phase: put}
  - arrive_first: {op: shift, src: k, dst: "recv[0]", offset: next, phase: wait}
  - ring:
      repeat: W - 1
      as: h
      steps:
        - low: {op: external, reads: ["recv[h % 2][lo]"], writes: [y]}
        - up: {op: external, reads: ["q[hi]", y], writes: [z]}
        - merge: {op: external, reads: ["acc[hi]", z], writes: ["acc[hi]"]}
        - credit: {op: signal, to: prev, channel: free}
        - wait: {op: wait, from: next, channel: free}
        - send: {op: shift, src: "recv[h % 2]", dst: "recv[(h + 1) % 2]", offset: next,
                 phase: put}
        - arrive: {op: shift, src: "recv[h % 2]", dst: "recv[(h + 1) % 2]", offset: next,
                   phase: wait}
  - pass_acc: {op: shift, src: acc, dst: got, offset: next}
  - use: {op: external, reads: [got], writes: [w]}
  - done: {op: signal, to: prev, channel: free}
  - end: {op: wait, from: next, channel: free}
"""


def errors(text: str, worlds: range = range(2, 5)) -> list:
    """The parser's or the structural check's errors of ``text`` at each W of ``worlds``."""
    found = []
    for world in worlds:
        try:
            found += [d for d in structural.check(parse_text(text, "s.yaml", world), [world])
                      if d.severity == "error"]
        except DiagnosticError as error:
            found += list(error.diagnostics)
    return found


def changed(*pairs: str) -> str:
    text = TEXT
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_a_rows_access_reads_its_index_and_the_whole_buffer() -> None:
    schedule = parse_text(TEXT, "s.yaml", 3)
    steps = {s.name: s.op for s in schedule.step_list()}
    assert not errors(TEXT)
    # the slot, then its rows; the index read too; no buffer per row (not a slice)
    assert steps["low_h0"].reads == ["recv_0", "lo"] and steps["low_h0"].rows == {"recv_0": "lo"}
    assert steps["low_h1"].rows == {"recv_1": "lo"}
    assert steps["up_h0"].reads == ["q", "y", "hi"] and steps["up_h0"].rows == {"q": "hi"}
    # a rows write reads the buffer (the other rows keep their values)
    assert steps["merge_h0"].reads == ["acc", "z", "hi"] and steps["merge_h0"].writes == ["acc"]
    assert steps["merge_h0"].rows == {"acc": "hi"}
    assert "q" in schedule.buffers and not schedule.slices


def test_a_rows_read_of_a_slot_races_with_the_next_put_into_it() -> None:
    """Without the credit, a put into the next rank's slot can land while that rank reads
    rows of it (the race models take a rows access as the whole slot)."""
    text = changed("        - wait: {op: wait, from: next, channel: free}\n", "",
                   "        - credit: {op: signal, to: prev, channel: free}\n", "")
    keys = {f.key[:4] for f in hb.check(parse_text(text, "s.yaml", 4), [4],
                                        hints=False).findings}
    assert ("race", "write-after-read", "recv_0", "low_h0") in keys, keys
    assert not hb.check(parse_text(TEXT, "s.yaml", 4), [4], hints=False).findings


def test_the_index_is_read_so_it_must_be_written_first(tmp_path: Path) -> None:
    text = changed("  - halves: {op: external, reads: [lens], writes: [lo, hi]}\n", "",
                   "  - use: {op: external", "  - halves: {op: external, reads: [lens], "
                   "writes: [lo, hi]}\n  - use: {op: external")
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(DiagnosticError) as refused:
        pipeline.run(path, pipeline.Options(worlds=[3]), until="emit")
    found = [d for d in refused.value.diagnostics if d.code == "read-before-write"]
    assert found and "'lo'" in found[0].message and "low_h0" in found[0].message, found
    path.write_text(TEXT)
    assert pipeline.run(path, pipeline.Options(worlds=[3]), until="emit").module_text


# each refusal: the change, its class, where (line, col), words of message or hint, and
# the change its hint asks for (accepted)
REFUSED = [
    # a method takes no rows by values
    (('dst: "recv[0]", offset: next, phase: put}', 'dst: "recv[0][lo]", offset: next, '
      'phase: put}'), "bad-index", (18, 42), "in a step of op 'shift'",
     ('dst: "recv[0]", offset: next, phase: put}', 'dst: "recv[0]", offset: next, '
      'phase: put}')),
    # the index: 1-d integer with values
    (("lo: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}",
      "lo: {shape: [N], dtype: f32}"), "bad-index", (24, 38),
     "declare 'lo: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}'",
     ("lo: {shape: [N], dtype: f32}", "lo: {shape: [N], dtype: i32, values: {min: 0, "
      "max: 2 * N - 1, distinct: true}}")),
    # max past the rows, for some binding
    (("hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}",
      "hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N, distinct: true}}"),
     "bad-values", (8, 54), "not below the 2*N = 2 rows of 'q'",
     ("max: 2 * N, distinct", "max: 2*N - 1, distinct")),
    # rows written by an index that may repeat a row
    (("hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}",
      "hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1}}"),
     "bad-values", (8, 40), "declare its values distinct",
     ("max: 2 * N - 1}}\n  recv", "max: 2 * N - 1, distinct: true}}\n  recv")),
    # distinct values the range cannot hold
    (("hi: {shape: [N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}",
      "hi: {shape: [N], dtype: i32, values: {min: N, max: N, distinct: true}}"),
     "bad-values", (8, 54), "which 'distinct: true' keeps apart",
     ("min: N, max: N,", "min: 0, max: 2 * N - 1,")),
    # one index per buffer in a step
    (('reads: ["acc[hi]", z]', 'reads: ["acc[lo]", z]'), "bad-index", (26, 64),
     "a step takes a buffer's rows by one index",
     ('writes: ["acc[hi]"]', 'writes: ["acc[lo]"]')),
    # a buffer whole and by its rows in one step (which would the harness give it?)
    (('reads: ["acc[hi]", z]', 'reads: [acc, z]'), "bad-index", (26, 58),
     "also names whole (or twice) in its reads", ('reads: [acc, z]', 'reads: ["acc[hi]", z]')),
]


@pytest.mark.parametrize(("change", "code", "where", "words", "fix"), REFUSED)
def test_a_refused_rows_access_is_located_and_its_hint_is_taken(
        change: tuple[str, ...], code: str, where: tuple[int, int], words: str,
        fix: tuple[str, ...]) -> None:
    text = changed(*change)
    found = errors(text)
    assert found and found[0].code == code, found
    assert words in found[0].message + (found[0].hint or ""), found[0]
    assert found[0].mark.file == "s.yaml", found[0]
    assert (found[0].mark.line, found[0].mark.col) == where, found[0]
    fixed = text.replace(*fix) if fix[0] != fix[1] else TEXT
    assert not errors(fixed), errors(fixed)


def test_the_synthetic_step_reads_and_writes_the_named_rows_only() -> None:
    """make_external: what a rows read computes depends on the named rows only; a rows
    write changes the named rows and keeps every other row."""
    schedule = parse_text(TEXT, "s.yaml", 3)
    sizes = synth.call_sizes(schedule, 3, {"N": 3}, 0, 0)
    steps = {s.name: s for s in schedule.step_list()}
    external = synth.make_external(schedule, 3, sizes, 0, 0)
    gen = torch.Generator().manual_seed(1)
    n = sizes["N"]
    index = synth.int_value(schedule, "hi", sizes, {}, gen)
    assert sorted(set(index.tolist())) == sorted(index.tolist())  # distinct, as declared
    assert 0 <= int(index.min()) and int(index.max()) < 2 * n
    bufs = {"hi": index, "acc": torch.randn(2 * n, 4, dtype=torch.float64, generator=gen),
            "z": torch.randn(n, 4, dtype=torch.float64, generator=gen),
            "q": torch.randn(2 * n, 4, dtype=torch.float64, generator=gen),
            "y": torch.randn(n, 4, dtype=torch.float64, generator=gen)}
    written = external(steps["merge_h0"], 0, bufs)["acc"]
    named = torch.zeros(2 * n, dtype=torch.bool)
    named[index] = True
    assert torch.equal(written[~named], bufs["acc"][~named])  # the others kept
    assert not torch.equal(written[named], bufs["acc"][named])
    # the read of q[hi]: other rows of q change nothing
    other = dict(bufs, q=torch.where(named.unsqueeze(1), bufs["q"], bufs["q"] + 5.0))
    assert torch.equal(external(steps["up_h0"], 0, bufs)["z"],
                       external(steps["up_h0"], 0, other)["z"])
    moved = dict(bufs, q=torch.where(named.unsqueeze(1), bufs["q"] + 5.0, bufs["q"]))
    assert not torch.equal(external(steps["up_h0"], 0, bufs)["z"],
                           external(steps["up_h0"], 0, moved)["z"])


@pytest.mark.e2e
def test_a_run_reads_and_writes_the_named_rows(tmp_path: Path) -> None:
    """`dcpc run` (host backend): the rows of the slot the engine reads (compared there,
    those rows), and 'acc', written by rows into the module's memory and moved whole to
    the next rank (compared there, every row), match the float64 reference."""
    path = tmp_path / "s.yaml"
    path.write_text(TEXT)
    report = run_schedule(RunConfig(schedule=str(path), world=3, backend="host", calls=2,
                                    seed=5))
    text = format_report(report)
    assert report.launch.ok and report.mismatches == 0, text
    assert report.outputs["got"].compared >= 2 * 3, text
    assert report.outputs["recv_0"].compared and report.outputs["recv_1"].compared, text


VARLEN = Path(__file__).resolve().parents[2] / "schedules/gallery/zigzag_ring_attention_varlen.yaml"


def test_a_rows_write_of_an_integer_buffer_keeps_its_other_rows() -> None:
    """An integer buffer written by rows (``cnt[half1]``): the synthetic step draws the
    named rows only, the others keep what the buffer held (as a float buffer's do)."""
    text = VARLEN.read_text()
    text = text.replace("  out: {shape:", "  cnt: {shape: [2 * N], dtype: i32, values: "
                        "{min: 0, max: 5}}\n  out: {shape:", 1)
    text = text.replace("      writes: [out, lse]", '      writes: [out, lse, "cnt[half1]"]', 1)
    schedule = parse_text(text, "v.yaml", 2)
    finish = next(s for s in schedule.step_list() if s.name == "finish")
    assert finish.op.rows == {"cnt": "half1"}
    sizes = synth.call_sizes(schedule, 2, {"N": 4, "R": 2, "M": 8}, 0, 0)
    n = sizes["N"]
    gen = torch.Generator().manual_seed(3)
    half1 = torch.tensor([1, 3, 5, 7][:n], dtype=torch.float64)
    bufs = {"half1": half1, "cnt": torch.full((2 * n,), -7.0, dtype=torch.float64),
            "o_acc": torch.randn(2 * n, 4, 16, dtype=torch.float64, generator=gen),
            "lse_acc": torch.randn(2 * n, 4, 1, dtype=torch.float64, generator=gen)}
    for rank in range(2):
        cnt = synth.make_external(schedule, 2, sizes, 0, 0)(finish, rank, dict(bufs))["cnt"]
        named = torch.zeros(2 * n, dtype=torch.bool)
        named[half1.long()] = True
        assert (cnt[~named] == -7).all(), cnt  # the others kept
        assert ((cnt[named] >= 0) & (cnt[named] <= 5)).all(), cnt  # the named drawn


def test_distinct_values_over_many_seeds() -> None:
    """``distinct: true``: no value twice, for every seed (not by luck of one)."""
    schedule = parse_text(TEXT, "s.yaml", 3)
    for n in (1, 2, 3):
        sizes = synth.call_sizes(schedule, 3, {"N": n}, 0, 0)
        for seed in range(300):
            gen = torch.Generator().manual_seed(seed)
            for name in ("lo", "hi"):
                index = synth.int_value(schedule, name, sizes, {}, gen, (seed % 5, seed % 3, 3))
                values = index.tolist()
                assert len(set(values)) == len(values) == sizes["N"], (seed, name, values)
                assert 0 <= min(values) and max(values) < 2 * sizes["N"], (seed, values)


@pytest.mark.parametrize("dtype", ["f32", "i32"])
def test_the_worker_compares_exactly_the_named_rows(dtype: str) -> None:
    """What an engine step reads by rows is compared on those rows, every one of them:
    a module buffer whose other rows differ from the reference passes; one whose named
    row (any of them, the last included) differs mismatches."""
    from dcpc.harness.worker import OutputStats, compare_rows

    index = torch.tensor([5, 0, 3], dtype=torch.float64)  # the named rows, out of order
    want = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
    others = want.clone()
    others[[1, 2, 4]] += 100.0  # the rows the index does not name
    stats = OutputStats()
    compare_rows("acc", "move", dtype, others, want, stats, "here", index)
    assert stats.mismatches == 0, stats.first_mismatch
    stats = OutputStats()
    compare_rows("acc", "move", dtype, others, want, stats, "here", None)  # the whole buffer
    assert stats.mismatches == 1
    for row in (5, 0, 3):
        bad = want.clone()
        bad[row, 2] += 1.0
        stats = OutputStats()
        compare_rows("acc", "move", dtype, bad, want, stats, "here", index)
        assert stats.mismatches == 1, row


# rows by values meant, written otherwise: the bracket holds an expression of a buffer, a
# second index, an undeclared name; the hint's form (and declaration) followed is accepted
DECLARE = "  y: {shape: [N, D], dtype: f32}\n"


@pytest.mark.parametrize(("bad", "hint", "fix"), [
    ('"q[hi][0]"', "write 'q[hi]'", ('"q[hi][0]"', '"q[hi]"')),
    ('"q[-hi]"', "write 'q[hi]'", ('"q[-hi]"', '"q[hi]"')),
    ('"q[hi + 1]"', "write 'q[hi]'", ('"q[hi + 1]"', '"q[hi]"')),
    ('"q[hix]"', "declare 'hix: {shape: [2 * N], dtype: i32, values: {min: 0, max: 2 * N - 1, "
     "distinct: true}}'", (DECLARE, DECLARE + "  hix: {shape: [2 * N], dtype: i32, values: "
                           "{min: 0, max: 2 * N - 1, distinct: true}}\n")),
    ('"q[hh[0]]"', "and write 'q[hh]'", ('"q[hh[0]]"', '"q[hh]"', DECLARE, DECLARE + "  hh: "
     "{shape: [2 * N], dtype: i32, values: {min: 0, max: 2 * N - 1, distinct: true}}\n")),
])
def test_a_rows_access_written_otherwise_gets_the_rows_form(bad: str, hint: str,
                                                             fix: tuple[str, ...]) -> None:
    text = changed('reads: ["q[hi]", y]', f"reads: [{bad}, y]")
    found = errors(text)
    assert found and found[0].code == "bad-index", found
    assert (found[0].mark.line, found[0].mark.col) == (25, 37), found[0]
    assert "rows by values name the rows of axis 0" in found[0].message, found[0]
    assert "leading axis is not an integer" not in found[0].message, found[0]
    assert hint in (found[0].hint or ""), found[0]
    for old, new in zip(fix[::2], fix[1::2], strict=True):
        text = text.replace(old, new)
    assert not errors(text), errors(text)


def test_an_undeclared_write_index_s_declaration_hint_is_accepted() -> None:
    """An index first read then written in one step: the declared form carries
    ``distinct: true`` (a write needs it), so following the hint gives no second refusal."""
    text = changed('reads: ["acc[hi]", z], writes: ["acc[hi]"]',
                   'reads: ["acc[hx]", z], writes: ["acc[hx]"]')
    found = errors(text)
    assert found and found[0].code == "bad-index", found
    hint = found[0].hint or ""
    decl = hint[hint.index("'") + 1: hint.index("'", hint.index("'") + 1)]
    assert decl == "hx: {shape: [2 * N], dtype: i32, values: {min: 0, max: 2 * N - 1, " \
        "distinct: true}}", hint
    fixed = text.replace(DECLARE, DECLARE + f"  {decl}\n")
    assert not errors(fixed), errors(fixed)
