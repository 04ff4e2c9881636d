"""An integer buffer's value range (`values: {min, max}`, docs/language.md "Buffers"):
its ends are size expressions, parsed and checked with located errors, and `dcpc run`'s
synthetic inputs and engine steps draw the buffer within it, both ends and values
between over a run (one mechanism with the row counts an op reads: 0..capacity)."""

from __future__ import annotations

import re
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
    ("values: {min: W - 3, max: W*L - 1}", "bad-values", "min: ",
     "(W-3) is -1 at W=2, below 0 (-1 is the poison"),
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


def test_the_draws_stay_in_the_range_with_both_ends_in_a_run() -> None:
    """Integer payloads beside the tokens were drawn over the whole i32 range: now over
    their declared values (the moe gallery's i_send, token indices in [0, min(T, C)),
    each once per slot: the combine's index); the counts an op reads by the same
    mechanism, 0..capacity, within their declared 0..T (T <= C: DeepEP's num_tokens <=
    num_max_dispatch_tokens_per_rank). At W=2 over 8 calls: both ends appear, a count
    strictly between (a partly filled slot), and a call where no count is 0 (every slot
    gets rows)."""
    schedule = parse_file(GALLERY / "moe_dispatch_combine.yaml", 2)
    ctor = synth.constructor_sizes(schedule, 2)
    ids: set[int] = set()
    seen: list[tuple[int, list[int]]] = []  # (top count, every rank's counts) per call
    drawn: list[tuple[int, int]] = []  # (T, C) per call
    for call in range(8):
        sizes = synth.call_sizes(schedule, 2, ctor, 0, call)
        drawn.append((sizes["T"], sizes["C"]))
        cap, tokens = sizes["C"], min(sizes["T"], sizes["C"])
        calls = synth.call_inputs(schedule, 2, sizes, 0, call)
        for bufs in calls:
            got = bufs["i_send"].flatten().tolist()
            assert all(0 <= v < tokens for v in got), (sizes, got)
            assert all(len(set(got[i:i + cap])) == tokens for i in range(0, len(got), cap))
            ids.update(got)
        seen.append((min(sizes["T"], cap),
                     [v for bufs in calls for v in bufs["counts"].flatten().tolist()]))
    assert ctor["T"] == ctor["C"] == 4
    assert ids == set(range(ctor["C"]))  # call 0 at the maxima: every index, none outside
    assert any(sizes_t < cap for sizes_t, cap in drawn), drawn  # a call with T < C
    assert all(0 <= n <= cap for cap, counts in seen for n in counts), seen
    assert any(0 in counts for _, counts in seen) and any(cap in counts for cap, counts in seen)
    assert any(0 < n < cap for cap, counts in seen for n in counts), seen
    assert any(0 not in counts for _, counts in seen), seen


def test_the_ends_move_across_ranks_and_calls() -> None:
    """An even call puts the low end on rank (call / 2) % W and the high end on the next;
    an odd call none at the low end."""
    for call in range(4):
        drawn = [synth.in_range(0, 9, (3,), torch.Generator().manual_seed(rank), call, rank, 3)
                 for rank in range(3)]
        lead = (call // 2) % 3
        for rank, value in enumerate(drawn):
            assert 0 <= value.min() and value.max() <= 9
            assert (0 in value.tolist()) >= (not call % 2 and rank == lead), (call, drawn)
            assert (9 in value.tolist()) >= (not call % 2 and rank == (lead + 1) % 3)
            assert call % 2 == 0 or 0 not in value.tolist(), (call, drawn)


def test_the_largest_i64_is_drawn() -> None:
    """A range ending at 2**63 - 1 (randint's exclusive end would overflow)."""
    top = 2**63 - 1
    value = synth.in_range(top - 2, top, (64,), torch.Generator().manual_seed(0), 0, 0, 2)
    assert value.max() == top and value.min() >= top - 2
    assert synth.in_range(0, top, (64,), torch.Generator(), 1, 0, 2).min() >= 1


def test_an_engine_step_writes_ids_in_their_range() -> None:
    """deepep_normal's forwarder (external steps per chunk k: its own block first, then
    each source's) writes ids_fwd[k]: within [0, N*G*L), the low end on rank 0 and the
    high end on rank 1 in call 0, as the NVLink counts the forwarder derives from the
    rail meta (nvl_counts, once per call) stay within their capacity.
    The own block's step of each chunk, rank 0's copy (it names the node: one copy per
    node, each drawing as any rank's)."""
    world = MeshWorld((2, 3))
    schedule = parse_file(GALLERY / "deepep_normal.yaml", world)
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world), 0, 0)
    external = synth.make_external(schedule, world, sizes, 0, 0)
    inputs = synth.call_inputs(schedule, world, sizes, 0, 0)
    top = 2 * 3 * sizes["L"] - 1
    chunks = [s for s in schedule.step_list()  # chunk k, in order: those that refill the
              # RDMA ring, the last R
              if re.fullmatch(r"(last_)?forward_own_h\d+_r0", s.name)]
    assert len(chunks) == sizes["P"] >= 2
    for k, forward in enumerate(chunks):
        for rank, bufs in enumerate(inputs):
            sent = bufs[f"ids_send_{k}"]
            # what the step reads of the module's memory (its blocks of the ring slot,
            # their counts: views the worker gives it), zeros here: the ids it writes
            # are drawn within their range, whatever it read
            reads = {n: torch.zeros(synth.buffer_shape(schedule, n, sizes),
                                    dtype=torch.float64 if schedule.buffers[n].dtype.is_float
                                    else torch.int32)
                     for n in forward.op.reads if n not in bufs}
            wrote = external(forward, rank, {**bufs, **reads})
            ids = wrote[f"ids_fwd_{k}"]
            for value in (sent, ids):
                assert 0 <= value.min() and value.max() <= top, value
                assert (value.min() == 0) >= (rank == 0) and (value.max() == top) >= (rank == 1)
    # the NVLink counts of chunk k: written once per call from the rail meta (nvl_counts,
    # before any chunk moves), within their capacity as the ids within their range
    counts = [s for s in schedule.step_list() if re.fullmatch(r"nvl_counts_h\d+", s.name)]
    assert len(counts) == sizes["P"]
    for k, step in enumerate(counts):
        for rank, bufs in enumerate(inputs):
            reads = {n: torch.zeros(synth.buffer_shape(schedule, n, sizes), dtype=torch.int32)
                     for n in step.op.reads}
            n_fwd = external(step, rank, {**bufs, **reads})[f"n_fwd_{k}"]
            assert 0 <= int(n_fwd.min()) and int(n_fwd.max()) <= sizes["N"] * sizes["C"]


def test_a_range_narrows_the_counts_it_bounds() -> None:
    """A count buffer with its own range: both hold (the intersection)."""
    text = TEXT.replace("n:     {shape: [W], dtype: i32}",
                        "n:     {shape: [W], dtype: i32, values: {min: 1, max: 9}}")
    schedule = parse_text(text, "v.yaml")
    assert synth.value_ranges(schedule, {"W": 2, "C": 4, "L": 2, "H": 8}) == {
        "n": (1, 4), "ids": (0, 3)}
    assert torch.equal(synth.in_range(2, 2, (3,), torch.Generator()), torch.tensor([2, 2, 2]))


def test_an_index_takes_no_range() -> None:
    """A range on what an op reads as row numbers would replace the in-bounds rule
    (`dcpc run` drew rows past the end): refused on the key, naming the op."""
    text = (GALLERY / "moe_dispatch_combine.yaml").read_text()
    spot = "slot_of:  {shape: [T, K], dtype: i32"
    text = text.replace(spot, spot + ", values: {min: 0, max: 1000}")
    (found,) = check_errors(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if spot in t)
    col = text.splitlines()[line - 1].index("values:") + 1
    assert (found.code, found.mark.line, found.mark.col) == ("bad-values", line, col)
    assert "'slot_of' is read as row numbers by step 'combine' (weighted_combine)" \
        in found.message, found.message


@pytest.mark.parametrize(("spelling", "words"), [
    ("{min: 5, max: 9}", "(5) is 5 at W=2, C=1, above the capacity C = 1"),
    ("{min: C + 1, max: 2*C}", "(C+1) is 2 at W=2, C=1, above the capacity C = 1"),
])
def test_a_range_with_no_count_in_it_is_refused(spelling: str, words: str) -> None:
    """Counts are 0..capacity: a declared min above the capacity for some binding leaves
    no value (`dcpc run` failed in torch); located on min, naming W and the sizes."""
    text = TEXT.replace("n:     {shape: [W], dtype: i32}",
                        f"n:     {{shape: [W], dtype: i32, values: {spelling}}}")
    (found,) = check_errors(text)
    col = text.splitlines()[7].index("min: ") + len("min: ") + 1
    assert (found.code, found.mark.line, found.mark.col) == ("bad-values", 8, col)
    assert words in found.message and "step 'go' (ragged_all_to_all)" in found.message, \
        found.message
    assert check_errors(text.replace(spelling, "{min: 1, max: 2*C}")) == []


@pytest.mark.parametrize(("spot", "spelling", "name"), [
    ("i_send:   {shape: [W, L*C], dtype: i32, values: {min: 0, max: T - 1}}",
     "i_send:   {shape: [W, L*C], dtype: i32, values: {min: C, max: C + 3}}", "i_send"),
    ("src_info: {shape: [L, W*C], dtype: i32, symmetric: true}",
     "src_info: {shape: [L, W*C], dtype: i32, symmetric: true, values: {min: C, max: 2*C}}",
     "src_info"),
])
def test_a_placement_range_with_no_row_of_the_slot_is_refused(spot: str, spelling: str,
                                                              name: str) -> None:
    """A ragged move's index (src_info) and the src that lands in it (i_send) name rows
    of a slot of C: a range from C up leaves no row (`dcpc run` failed drawing them);
    located on min, naming the capacity. A range that reaches past C from below (the
    gallery's T - 1, T > C in some binding) keeps rows: accepted."""
    text = (GALLERY / "moe_dispatch_combine.yaml").read_text()
    assert spot in text
    text = text.replace(spot, spelling)
    (found,) = check_errors(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if spelling in t)
    col = text.splitlines()[line - 1].index("min: ") + len("min: ") + 1
    assert (found.code, found.mark.line, found.mark.col) == ("bad-values", line, col)
    assert f"'values: min' of buffer '{name}' (C) is 1 at W=2, C=1, not below the " \
        "capacity C = 1 of the slot" in found.message, found.message
    assert check_errors(text.replace("{min: C,", "{min: 0,")) == []


TWO_CAPS = """schedule: two_caps
sizes: {C: {max: 3}, H: 8}
buffers:
  x_small: {shape: [W, C, H], dtype: bf16}
  x_big:   {shape: [W, 2*C, H], dtype: bf16}
  n:       {shape: [W], dtype: i32}
  r_small: {shape: [W, C, H], dtype: bf16, symmetric: true}
  n_small: {shape: [W], dtype: i32, symmetric: true}
  r_big:   {shape: [W, 2*C, H], dtype: bf16, symmetric: true}
  n_big:   {shape: [W], dtype: i32, symmetric: true}
steps:
  - small: {op: ragged_all_to_all, src: x_small, dst: r_small, counts: n,
            recv_counts: n_small, capacity: C}
  - big:   {op: ragged_all_to_all, src: x_big, dst: r_big, counts: n,
            recv_counts: n_big, capacity: 2*C}
  - use:   {op: external, reads: [r_small, n_small, r_big, n_big]}
  - release: {op: barrier}
"""


# n read whole by a grouped move of capacity 2*C and by slice (n[c], one memory with n)
# by moves of capacity C (the review's case: the slices' bound was not the whole's)
WHOLE_AND_SLICES = """schedule: whole_slice
sizes: {C: {max: 3}, H: 8}
buffers:
  n:  {shape: [W, W], dtype: i32}
  xg: {shape: [W, W*2*C, H], dtype: bf16}
  rg: {shape: [W, W*2*C, H], dtype: bf16, symmetric: true}
  ng: {shape: [W, W], dtype: i32, symmetric: true}
  xs: {shape: [W, W, C, H], dtype: bf16}
  rs: {shape: [W, W, C, H], dtype: bf16, symmetric: true}
  ns: {shape: [W, W], dtype: i32, symmetric: true}
steps:
  - whole: {op: ragged_all_to_all, src: xg, dst: rg, counts: n, recv_counts: ng, capacity: 2*C,
            groups: W}
  - per:
      repeat: W
      as: c
      steps:
        - s: {op: ragged_all_to_all, src: "xs[c]", dst: "rs[c]", counts: "n[c]",
              recv_counts: "ns[c]", capacity: C}
        - u: {op: external, reads: ["rs[c]", "ns[c]"]}
  - use: {op: external, reads: [rg, ng]}
  - release: {op: barrier}
"""


@pytest.mark.e2e
@pytest.mark.parametrize("text", [TWO_CAPS, WHOLE_AND_SLICES],
                         ids=["two_steps", "whole_and_slices"])
def test_counts_read_at_two_capacities_are_drawn_within_the_least(text: str,
                                                                   tmp_path: Path) -> None:
    """Counts two steps read, at capacities C and 2*C, were drawn up to the last step's
    (2*C): the first step's simulation refused the call ("rank 1's counts[0] = 6 is
    outside [0, capacity 3]"); a buffer read whole at 2*C and by slice at C, within the
    whole's. Now within the least, both ends reached, and the run matches float64."""
    from dcpc.harness.run import RunConfig, run_schedule

    path = tmp_path / "two_caps.yaml"
    path.write_text(text)
    schedule = parse_file(path, 2)
    assert synth.value_ranges(schedule, {"W": 2, "C": 3, "H": 8})["n"] == (0, 3)
    ctor = synth.constructor_sizes(schedule, 2)
    seen = [v for call in range(4)
            for bufs in synth.call_inputs(schedule, 2, synth.call_sizes(schedule, 2, ctor, 0, call),
                                          0, call)
            for v in bufs["n"].flatten().tolist()]
    assert max(seen) == 3 and min(seen) == 0, seen
    report = run_schedule(RunConfig(schedule=str(path), world=2, backend="host", calls=4))
    assert report.ok and report.mismatches == 0, report.errors()
    assert sum(s.compared for s in report.outputs.values()) > 0
