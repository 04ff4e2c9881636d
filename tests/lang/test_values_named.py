"""An end of `values` that names an integer buffer (`values: {min: 0, max: n}`,
docs/language.md "Buffers"): read elementwise, the named buffer's shape the first dims of
the bounded one's (broadcast over the rest); `dcpc run` draws the named buffer first and
each element within [min, its max], both ends over a run. What the checker refuses is
located, with its class and a hint that, followed, is accepted (DeepEP's per-gpu counts,
n_send_gpu[c, m, g] <= n_send[c, m]: schedules/gallery/deepep_normal.yaml)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.schedules import check_errors

from dcpc.harness import synth
from dcpc.lang.parse import parse_file, parse_text
from dcpc.topology import MeshWorld

ROOT = Path(__file__).resolve().parents[2]

# n: row counts a ragged move reads (0 .. C), per: of those, how many each of G takes
TEXT = """schedule: vn
sizes: {C: {max: 4}, G: 3, H: 8}
buffers:
  x:    {shape: [W, C, H], dtype: bf16}
  n:    {shape: [W], dtype: i32}
  per:  {shape: [W, G], dtype: i32, values: {min: 0, max: n}}
  x_r:  {shape: [W, C, H], dtype: bf16, symmetric: true}
  n_r:  {shape: [W], dtype: i32, symmetric: true}
  o:    {shape: [W, C, H], dtype: bf16}
  f:    {shape: [W], dtype: f32}
  wide: {shape: [W], dtype: i64, values: {min: 0, max: C}}
  by_g: {shape: [G], dtype: i32, values: {min: 0, max: C}}
  free: {shape: [W], dtype: i32}
  made: {shape: [W], dtype: i32}
steps:
  - go:  {op: ragged_all_to_all, src: x, dst: x_r, counts: n, recv_counts: n_r, capacity: C}
  - use: {op: external, reads: [x_r, per, f, wide, by_g, free], writes: [o, made]}
"""
GOOD = "values: {min: 0, max: n}"
LINE = 6  # per's declaration


def test_a_bound_named_by_a_buffer_is_accepted() -> None:
    assert check_errors(TEXT) == []
    assert check_errors(TEXT.replace(GOOD, "values: {min: n, max: C}")) == []


# (what replaces GOOD, the class, the text after which the column is, words of the
# message, what the hint says to write instead: accepted)
BAD = [
    ("values: {min: 0, max: per}", "bad-values", "max: ", "names buffer 'per', itself",
     "values: {min: 0, max: C}"),
    ("values: {min: 0, max: f}", "bad-values", "max: ", "a f32 buffer", GOOD),
    ("values: {min: 0, max: wide}", "bad-values", "max: ", "an i64 buffer, wider",
     "values: {min: 0, max: wide}}  #"),  # the hint: declare per i64 (below)
    ("values: {min: 0, max: by_g}", "bad-values", "max: ", "not the first dims of its [W, G]",
     GOOD),
    ("values: {min: 0, max: n_r}", "bad-values", "max: ", "'n_r' is the module's memory",
     "values: {min: 0, max: C}"),
    ("values: {min: 0, max: made}", "bad-values", "max: ", "step 'use' (external) writes 'made'",
     "values: {min: 0, max: C}"),
    ("values: {min: 0, max: free}", "bad-values", "max: ",
     "declares no 'values' and no op reads it as counts", "values: {min: 0, max: free}"),
    ("values: {min: 0, max: nn}", "unknown-size", "max: ", "(nor is it an integer buffer)",
     GOOD),
    ("values: {min: n, max: 1}", "bad-values", "max: ", "is empty at W=2, C=2", GOOD),
    ("values: {min: 0, max: n, distinct: true}", "bad-values", "max: ", "distinct rows",
     GOOD),
]


@pytest.mark.parametrize(("spelling", "code", "after", "words", "fixed"), BAD,
                         ids=[b[3].split()[0] + "-" + str(i) for i, b in enumerate(BAD)])
def test_a_bad_named_bound_is_located(spelling: str, code: str, after: str, words: str,
                                      fixed: str) -> None:
    text = TEXT.replace(GOOD, spelling)
    line = text.splitlines()[LINE - 1]
    col = line.index(after) + len(after) + 1
    found = check_errors(text)
    assert [(d.code, d.mark.line, d.mark.col) for d in found][:1] == [(code, LINE, col)], \
        [d.render() for d in found]
    assert words in found[0].message, found[0].message
    assert found[0].hint
    if "i64" in words:  # the hint: declare the bounded buffer i64
        assert "declare 'per' i64" in found[0].hint
        fixed_text = text.replace("per:  {shape: [W, G], dtype: i32", "per:  {shape: [W, G], "
                                  "dtype: i64")
    elif "no 'values'" in words:  # the hint: declare the named buffer's values
        assert "declare 'free' 'values: {min: 0, max: C}'" in found[0].hint
        fixed_text = text.replace("free: {shape: [W], dtype: i32}",
                                  "free: {shape: [W], dtype: i32, values: {min: 0, max: C}}")
    elif "nn" in spelling:
        assert "did you mean 'n'?" in found[0].hint
        fixed_text = TEXT
    else:
        assert "'max: C'" in found[0].hint or "'n'" in found[0].hint or "integer" in \
            found[0].hint or "both ends" in found[0].hint, found[0].hint
        fixed_text = text.replace(spelling, fixed)
    assert check_errors(fixed_text) == [], [d.render() for d in check_errors(fixed_text)]


def test_a_chain_or_a_cycle_of_bounds_is_refused() -> None:
    """A named buffer's own range is size expressions: bounds are one level deep (no
    chain, no cycle); the hint (bound it by sizes) is accepted."""
    chain = TEXT.replace(GOOD, "values: {min: 0, max: free}").replace(
        "free: {shape: [W], dtype: i32}",
        "free: {shape: [W], dtype: i32, values: {min: 0, max: n}}")
    cycle = chain.replace("values: {min: 0, max: n}}", "values: {min: 0, max: per}}")
    for text in (chain, cycle):
        found = check_errors(text)
        assert found and all(d.code == "bad-values" for d in found), [d.render() for d in found]
        first = next(d for d in found if d.mark.line == LINE)
        assert "its 'values' names a buffer" in first.message, first.message
        assert "declare 'free' 'values: {min: 0, max: C}'" in first.hint
        fixed = text.replace("free: {shape: [W], dtype: i32, values: {min: 0, max: n}}",
                             "free: {shape: [W], dtype: i32, values: {min: 0, max: C}}")
        fixed = fixed.replace("free: {shape: [W], dtype: i32, values: {min: 0, max: per}}",
                              "free: {shape: [W], dtype: i32, values: {min: 0, max: C}}")
        assert check_errors(fixed) == [], [d.render() for d in check_errors(fixed)]


# a hop loop over chunks: the bound of per[c] is n[c] (its slices renamed per slice)
LOOPED = """schedule: vl
sizes: {C: {max: 4}, G: 3, H: 8, P: 2}
buffers:
  x:    {shape: [P, W, C, H], dtype: bf16}
  n:    {shape: [P, W], dtype: i32}
  per:  {shape: [P, W, G], dtype: i32, values: {min: 0, max: n}}
  x_r:  {shape: [W, C, H], dtype: bf16, symmetric: true}
  n_r:  {shape: [W], dtype: i32, symmetric: true}
  o:    {shape: [P, W, C, H], dtype: bf16}
steps:
  - chunks:
      repeat: P
      as: c
      steps:
        - go:  {op: ragged_all_to_all, src: "x[c]", dst: x_r, counts: "n[c]",
                recv_counts: n_r, capacity: C}
        - use: {op: external, reads: [x_r, "per[c]"], writes: ["o[c]"]}
        - free: {op: barrier}
"""


def test_a_bound_follows_the_slices_of_a_loop() -> None:
    schedule = parse_text(LOOPED, "s.yaml")
    assert {k: schedule.buffers[f"per_{k}"].values.max for k in range(2)} == {
        0: "n_0", 1: "n_1"}
    assert check_errors(LOOPED) == [], [d.render() for d in check_errors(LOOPED)]
    whole = LOOPED.replace('"per[c]"', "per")  # per used whole, n by slice: located
    found = check_errors(whole)
    line = whole.splitlines()[5]
    assert [(d.code, d.mark.line, d.mark.col) for d in found][:1] == [
        ("bad-values", 6, line.index("max: ") + 6)], [d.render() for d in found]
    assert "which the steps use by slice" in found[0].message
    assert "use 'per' by slice too" in found[0].hint


def _ranks_inputs(schedule: Any, world: Any, seeds: range, calls: int = 4
                  ) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Every rank's drawn inputs of every call of every seed, with the call's sizes."""
    ctor = synth.constructor_sizes(schedule, world)
    for seed in seeds:
        for call in range(calls):
            sizes = synth.call_sizes(schedule, world, ctor, seed, call)
            for bufs in synth.call_inputs(schedule, world, sizes, seed, call):
                yield sizes, bufs


def _drawn(text: str, world: int, seeds: range, calls: int = 4
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(bufs["n"], bufs["per"]) for _, bufs in
            _ranks_inputs(parse_text(text, "s.yaml"), world, seeds, calls)]


def test_the_draws_stay_within_each_elements_bound_and_reach_both_ends() -> None:
    """Over 20 seeds of 4 calls at W=3: every per[r, g] in 0 .. n[r]; some at n[r] > 0,
    some at 0 below an n[r] > 0, some strictly between; where n[r] is 0, per[r] is 0."""
    pairs = _drawn(TEXT, 3, range(20))
    top = low = between = 0
    for n, per in pairs:
        bound = n.to(torch.int64).unsqueeze(1).expand_as(per)
        assert bool(((per >= 0) & (per <= bound)).all()), (n, per)
        live = bound > 0
        top += int(((per == bound) & live).sum())
        low += int(((per == 0) & live).sum())
        between += int(((per > 0) & (per < bound)).sum())
    assert top and low and between, (top, low, between)
    # the min end named: n[r] .. C
    pairs = _drawn(TEXT.replace(GOOD, "values: {min: n, max: C}"), 3, range(20))
    assert all(bool((per >= n.to(torch.int64).unsqueeze(1)).all()) for n, per in pairs)
    assert any(bool((per == 4).any()) for _, per in pairs)


def test_the_draws_of_the_other_buffers_are_unchanged() -> None:
    """Drawing the named buffer first keeps every buffer's seed: n is drawn as it was
    with a size bound (the same values), only per follows it."""
    before = _drawn(TEXT.replace(GOOD, "values: {min: 0, max: C}"), 3, range(3))
    after = _drawn(TEXT, 3, range(3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(before, after, strict=True))
    assert any(not torch.equal(a[1], b[1]) for a, b in zip(before, after, strict=True))


def test_deepep_normal_draws_per_gpu_counts_within_the_nodes() -> None:
    """deepep_normal at 2x3: n_send_gpu[c][m, g] <= n_send[c][m] (DeepEP's routing), both
    ends reached."""
    file = ROOT / "schedules" / "gallery" / "deepep_normal.yaml"
    world = MeshWorld((2, 3))
    schedule = parse_file(file, world)
    top = zero = 0
    for _, bufs in _ranks_inputs(schedule, world, range(3)):
        for c in range(3):
            n = bufs[f"n_send_{c}"].to(torch.int64).unsqueeze(1)
            per = bufs[f"n_send_gpu_{c}"]
            assert bool(((per >= 0) & (per <= n)).all()), (n, per)
            top += int(((per == n) & (n > 0)).sum())
            zero += int(((per == 0) & (n > 0)).sum())
    assert top and zero


def test_in_range_each_places_the_ends_as_in_range() -> None:
    """An even call: the low end of a random element on rank (call / 2) % W, the high
    end (of an element with room) on the next, none elsewhere (ranges too wide for a
    random draw to hit an end); an odd call nothing at its low end where there is room,
    an element without room its one value."""
    low = torch.tensor([0, 7, 1000])
    high = torch.tensor([10**9, 7, 2 * 10**9])
    for call in range(6):
        lead = (call // 2) % 3
        for rank in range(3):
            got = synth.in_range_each(low, high, (3, 4), torch.Generator().manual_seed(rank),
                                      call, rank, 3)
            assert bool(((got >= low[:, None]) & (got <= high[:, None])).all())
            assert bool((got[1] == 7).all())  # no room: its one value
            at_low = int((got[[0, 2]] == low[[0, 2], None]).sum())
            at_high = int((got[[0, 2]] == high[[0, 2], None]).sum())
            assert at_low == (not call % 2 and rank == lead), (call, rank, got)
            assert at_high == (not call % 2 and rank == (lead + 1) % 3), (call, rank, got)


# n used whole (an external step reads it after the loop) and by slice (n[c]): one
# memory, the slice n_c the whole's view; per[c] is bounded by n_c as the module sees it
LOOPED_WHOLE = LOOPED.replace(
    "  n:    {shape: [P, W], dtype: i32}\n",
    "  n:    {shape: [P, W], dtype: i32, values: {min: 0, max: C}}\n"
    "  o2:   {shape: [W], dtype: i32}\n",
) + "  - tail: {op: external, reads: [n], writes: [o2]}\n"


@pytest.mark.parametrize("world", [2, 3])
def test_a_bound_used_whole_and_by_slice_bounds_the_slice_the_module_sees(world: int
                                                                           ) -> None:
    """The whole n is drawn, its slices taken as its views, before per[c] is drawn
    against n[c] (was: per drawn against a slice draw the whole's view then replaced,
    185 of 400 draws out of bound)."""
    assert check_errors(LOOPED_WHOLE) == [], [d.render() for d in check_errors(LOOPED_WHOLE)]
    schedule = parse_text(LOOPED_WHOLE, "s.yaml")
    assert "n" in synth.engine_inputs(schedule) and schedule.slices == {"n": 2}
    top = 0
    for _, bufs in _ranks_inputs(schedule, world, range(10)):
        for c in range(2):
            n = bufs[f"n_{c}"].to(torch.int64).unsqueeze(-1)
            assert torch.equal(bufs["n"][c].to(torch.int64), n.squeeze(-1))
            per = bufs[f"per_{c}"]
            assert bool(((per >= 0) & (per <= n)).all()), (n, per)
            top += int(((per == n) & (n > 0)).sum())
    assert top


def test_in_range_each_is_exact_over_the_whole_i64_range() -> None:
    """Ends at the i64 extremes: no wrap (was: high - floor + 1 overflowed, negative
    draws), no float rounding (was: share * span in float64, every odd-call draw over
    0 .. 2^60 even or odd alike); both ends a draw over small ranges still."""
    top = 2**63 - 1
    for call in range(4):
        got = synth.in_range_each(torch.tensor([0, 5, 0]), torch.tensor([top, top, 2**60]),
                                  (3, 400), torch.Generator().manual_seed(call), call)
        assert bool((got[:2] >= torch.tensor([[0], [5]])).all()), got
        assert bool((got[2] <= 2**60).all())
        assert 100 < int((got[2] % 2).sum()) < 300  # odd and even alike
    text = TEXT.replace("wide: {shape: [W], dtype: i64, values: {min: 0, max: C}}",
                        f"wide: {{shape: [W], dtype: i64, values: {{min: 0, max: {top}}}}}")
    text = text.replace("per:  {shape: [W, G], dtype: i32, values: {min: 0, max: n}}",
                        "per:  {shape: [W, G], dtype: i64, values: {min: 0, max: wide}}")
    schedule = parse_text(text, "s.yaml")
    for _, bufs in _ranks_inputs(schedule, 2, range(5)):
        bound = bufs["wide"].unsqueeze(1)
        assert bool(((bufs["per"] >= 0) & (bufs["per"] <= bound)).all()), bufs


# n read as row counts by two moves of capacities C and 2 * C: dcpc run draws it within
# the least, 0 .. C, which is no one size expression: a bound that names it reads no one
# range (was: the checker took the first, C, while idx was drawn up to 2 * C into q's
# C + 1 rows)
TWO_CAPS = """schedule: tc
sizes: {C: {max: 4}, H: 8}
buffers:
  x:    {shape: [W, C, H], dtype: bf16}
  x2:   {shape: [W, 2 * C, H], dtype: bf16}
  n:    {shape: [W], dtype: i32}
  x_r:  {shape: [W, C, H], dtype: bf16, symmetric: true}
  x_r2: {shape: [W, 2 * C, H], dtype: bf16, symmetric: true}
  n_r:  {shape: [W], dtype: i32, symmetric: true}
  n_r2: {shape: [W], dtype: i32, symmetric: true}
  q:    {shape: [C + 1, H], dtype: f32}
  idx:  {shape: [W], dtype: i32, values: {min: 0, max: n}}
  o:    {shape: [W, H], dtype: f32}
steps:
  - go:  {op: ragged_all_to_all, src: x, dst: x_r, counts: n, recv_counts: n_r, capacity: C}
  - go2: {op: ragged_all_to_all, src: x2, dst: x_r2, counts: n, recv_counts: n_r2,
          capacity: 2 * C}
  - use: {op: external, reads: ["q[idx]", x_r, x_r2], writes: [o]}
  - b: {op: barrier}
"""


def test_a_bound_naming_counts_of_several_capacities_is_refused() -> None:
    found = check_errors(TWO_CAPS)
    line = TWO_CAPS.splitlines()[11]
    assert [(d.code, d.mark.line, d.mark.col) for d in found] == [
        ("bad-values", 12, line.index("max: n") + 6)], [d.render() for d in found]
    assert "capacities C and 2 * C" in found[0].message
    assert "declare 'n' 'values: {min: 0, max: C}'" in found[0].hint
    fixed = TWO_CAPS.replace("n:    {shape: [W], dtype: i32}",
                             "n:    {shape: [W], dtype: i32, values: {min: 0, max: C}}")
    assert check_errors(fixed) == [], [d.render() for d in check_errors(fixed)]
    schedule = parse_text(fixed, "s.yaml")
    for sizes, bufs in _ranks_inputs(schedule, 2, range(5)):
        assert int(bufs["n"].max()) <= sizes["C"]
        assert bool((bufs["idx"] <= bufs["n"]).all())


def test_a_name_both_a_size_and_a_buffer_is_refused_as_ambiguous() -> None:
    """`max: n` with a size n and a buffer n: neither meaning silently (main read the
    size, the named bound the buffer); the hint (rename one) is accepted."""
    text = TEXT.replace("G: 3, H: 8}", "G: 3, H: 8, n: 2}")
    found = check_errors(text)
    line = text.splitlines()[LINE - 1]
    assert [(d.code, d.mark.line, d.mark.col) for d in found] == [
        ("bad-values", LINE, line.index("max: n") + 6)], [d.render() for d in found]
    assert "and size 'n' too" in found[0].message
    assert found[0].hint == "rename size 'n' or buffer 'n'"
    renamed = text.replace("H: 8, n: 2}", "H: 8, k: 2}")
    assert check_errors(renamed) == [], [d.render() for d in check_errors(renamed)]


@pytest.mark.parametrize(("spelling", "suggested"), [
    ("pr", None),     # per itself: never
    ("mde", None),    # made, which step 'use' writes: refused, never suggested
    ("n_rr", None),   # n_r, the module's memory: refused, never suggested
    ("nn", "n"),      # n: an engine input, suggested, and accepted
])
def test_the_did_you_mean_of_a_misspelt_bound_names_only_a_buffer_it_may_name(
        spelling: str, suggested: str | None) -> None:
    found = check_errors(TEXT.replace(GOOD, f"values: {{min: 0, max: {spelling}}}"))
    assert [d.code for d in found] == ["unknown-size"], [d.render() for d in found]
    assert "(nor is it an integer buffer)" in found[0].message
    assert ("did you mean" in found[0].hint) == (suggested is not None), found[0].hint
    if suggested is not None:
        assert f"'{suggested}'" in found[0].hint
        assert check_errors(TEXT.replace(GOOD, f"values: {{min: 0, max: {suggested}}}")) == []


def test_a_buffer_inside_a_size_expression_is_said_so() -> None:
    """`max: n + 1`: n is an integer buffer, which bounds only as a whole end (not "nor
    is it an integer buffer"); the hint, followed, is accepted."""
    found = check_errors(TEXT.replace(GOOD, "values: {min: 0, max: n + 1}"))
    assert [d.code for d in found] == ["unknown-size"], [d.render() for d in found]
    assert "buffer 'n' bounds only as a whole end" in found[0].message
    assert "nor is it" not in found[0].message
    assert found[0].hint.startswith("write 'max: n'")
    assert check_errors(TEXT.replace(GOOD, "values: {min: 0, max: n}")) == []


def test_the_hint_of_a_refused_bound_names_a_size_the_file_has() -> None:
    """No 'C' in a file without C: the example names its first size (K here)."""
    text = TEXT.replace("C", "K").replace(GOOD, "values: {min: 0, max: made}")
    found = check_errors(text)
    assert [d.code for d in found] == ["bad-values"], [d.render() for d in found]
    assert found[0].hint == "bound it by a size expression, e.g. 'max: K'"
    assert check_errors(text.replace("max: made}", "max: K}")) == []


def test_a_slice_is_known_by_the_loops_not_by_its_name() -> None:
    """A bound naming a buffer the loops split is said so (Schedule.sliced); a buffer
    that merely ends in _0 (m_0, no loop) makes 'max: m' an unknown name, not a slice."""
    assert parse_text(LOOPED, "s.yaml").sliced == {"n": 2, "per": 2, "x": 2, "o": 2}
    text = TEXT.replace(GOOD, "values: {min: 0, max: m}").replace(
        "  made: {shape: [W], dtype: i32}\n",
        "  made: {shape: [W], dtype: i32}\n  m_0:  {shape: [W], dtype: i32}\n").replace(
        "by_g, free]", "by_g, free, m_0]")
    found = check_errors(text)
    assert [d.code for d in found] == ["unknown-size"], [d.render() for d in found]
