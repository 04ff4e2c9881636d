"""An integer buffer's value range (`values: {min, max}`, docs/language.md "Buffers"):
its ends are size expressions, parsed and checked with located errors, and `dcpc run`'s
synthetic inputs and engine steps draw the buffer within it, both ends in every call
(one mechanism with the row counts an op reads: 0..capacity)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.schedules import check_errors

from dcpc.harness import synth
from dcpc.lang.parse import parse_file, parse_text
from dcpc.topology import MeshWorld

ROOT = Path(__file__).resolve().parents[2]
GALLERY = ROOT / "schedules" / "gallery"

TEXT = """schedule: v
sizes: {C: {max: 4}, L: 2, H: 8}
buffers:
  x:     {shape: [W, C, H], dtype: bf16}
  ids:   {shape: [W, C], dtype: i32, values: {min: 0, max: W*L - 1}}
  x_r:   {shape: [W, C, H], dtype: bf16, symmetric: true}
  ids_r: {shape: [W, C], dtype: i32, symmetric: true}
  n:     {shape: [W], dtype: i32}
  n_r:   {shape: [W], dtype: i32, symmetric: true}
steps:
  - go: {op: ragged_all_to_all, src: [x, ids], dst: [x_r, ids_r], counts: n,
         recv_counts: n_r, capacity: C}
"""
GOOD = "values: {min: 0, max: W*L - 1}"


def test_a_declared_range_is_accepted() -> None:
    assert check_errors(TEXT) == []


# (what replaces GOOD on line 5, the class, where it points: the text after which the
# column is, words of the message)
BAD = [
    ("values: {min: 0, max: W*L - }", "shape-syntax", "max: W*L -",
     "'values: max' of buffer 'ids'"),
    ("values: {min: E, max: W}", "unknown-size", "min: ", "size 'E'"),
    ("values: {min: C, max: W - 1}", "bad-values", "max: ", "is empty at W=2, C=2: min C = 2"),
    ("values: {min: 0, max: W*L/3}", "inexact-division", "max: ", "(W*L/3) is not a whole"),
    ("values: {min: 0, max: 2147483647*W}", "bad-values", "max: ", "above the largest i32"),
    ("values: {min: 0, max: -1}", "shape-syntax", "max: ", "sizes cannot be negative"),
    ("values: {min: 0}", "missing-key", "values: ", "values.max"),
    ("values: [0, 4]", "wrong-type", "values: ", "mapping"),
]


@pytest.mark.parametrize(("spelling", "code", "after", "words"), BAD,
                         ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_a_bad_range_is_located(spelling: str, code: str, after: str, words: str) -> None:
    text = TEXT.replace(GOOD, spelling)
    line = text.splitlines()[4]
    col = line.index(after) + len(after) + 1
    found = check_errors(text)
    assert [(d.code, d.mark.line, d.mark.col) for d in found][:1] == [(code, 5, col)], \
        [d.render() for d in found]
    assert words in found[0].message, found[0].message


def test_a_float_buffer_takes_no_range() -> None:
    text = TEXT.replace("dtype: bf16}\n  ids:", "dtype: bf16, values: {min: 0, max: 3}}\n  ids:")
    (found,) = check_errors(text)
    col = text.splitlines()[3].index("values: ") + len("values: ") + 1
    assert (found.code, found.mark.line, found.mark.col) == ("bad-values", 4, col)
    assert "'x' is bf16" in found.message and found.hint


def test_the_draws_stay_in_the_range_with_both_ends_in_every_call() -> None:
    """Expert ids beside the tokens were drawn over the whole i32 range: now over
    [0, W*L) (the moe gallery's e_send), 0 and W*L - 1 in every call; the counts an op
    reads by the same mechanism, 0 and the capacity in every call."""
    schedule = parse_file(GALLERY / "moe_dispatch_combine.yaml", 3)
    ctor = synth.constructor_sizes(schedule, 3)
    for call in range(6):
        sizes = synth.call_sizes(schedule, 3, ctor, 0, call)
        top = 3 * sizes["L"] - 1
        for bufs in synth.call_inputs(schedule, 3, sizes, 0, call):
            ids, counts = bufs["e_send"], bufs["counts"]
            assert ids.min() == 0 and ids.max() == top, (call, ids)
            assert counts.min() == 0 and counts.max() == sizes["L"] * sizes["C"], call


def test_an_engine_step_writes_ids_in_their_range() -> None:
    """deepep_normal's forwarder (an external step, once per chunk k) writes ids_fwd[k]:
    within [0, N*G*L), both ends, as the counts it writes stay within their capacity."""
    world = MeshWorld((2, 3))
    schedule = parse_file(GALLERY / "deepep_normal.yaml", world)
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world), 0, 0)
    external = synth.make_external(schedule, world, sizes, 0, 0)
    inputs = synth.call_inputs(schedule, world, sizes, 0, 0)
    top = 2 * 3 * sizes["L"] - 1
    chunks = [s for s in schedule.step_list() if s.name.startswith("forward_h")]
    assert len(chunks) == sizes["P"] >= 2
    for k, forward in enumerate(chunks):
        for rank, bufs in enumerate(inputs):
            sent = bufs[f"ids_send_{k}"]
            assert sent.min() == 0 and sent.max() == top
            wrote = external(forward, rank, bufs)
            ids = wrote[f"ids_fwd_{k}"]
            assert ids.min() == 0 and ids.max() == top, ids
            assert int(wrote[f"n_fwd_{k}"].max()) <= sizes["N"] * sizes["C"]


def test_a_range_narrows_the_counts_it_bounds() -> None:
    """A count buffer with its own range: both hold (the intersection)."""
    text = TEXT.replace("n:     {shape: [W], dtype: i32}",
                        "n:     {shape: [W], dtype: i32, values: {min: 1, max: 9}}")
    schedule = parse_text(text, "v.yaml")
    assert synth.value_ranges(schedule, {"W": 2, "C": 4, "L": 2, "H": 8}) == {
        "n": (1, 4), "ids": (0, 3)}
    assert torch.equal(synth.in_range(2, 2, (3,), torch.Generator()), torch.tensor([2, 2, 2]))
