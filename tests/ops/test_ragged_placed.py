"""ragged_all_to_all with ``index`` (DeepEP's low-latency combine: each row at its
token's index, src_info) and without ``recv_counts`` (no count back, the signal only):
the kernel (ranks as threads, the ``local`` backend) lands each live row at the row of
its destination slot the index names, bit for bit (NaN rows included), at index 0 and
capacity - 1, empty slots untouched; an index outside [0, capacity) is the call's error,
never a store; the torch backend's placement and refusal; the float64 reference and the
synthetic inputs (distinct rows per slot, a weighted_combine's index into the rows
placed on the round trip). The float64 runs are schedules/ops/ragged_all_to_all_placed.yaml's
and the gallery's moe_dispatch_combine.yaml's (tests/cli/test_gallery.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.kernels import run_threads
from support.schedules import check_errors

from dcpc.runtime.errors import DcpcArgumentError, DcpcPeerFailedError

ROOT = Path(__file__).resolve().parents[2]
W, L, C, H = 2, 3, 4, 8

COMBINE = """\
schedule: placed
sizes: {C: {max: 4}, L: 3, H: 8}
buffers:
  y:      {shape: [L, W*C, H], dtype: bf16}
  at:     {shape: [L, W*C], dtype: i32}
  n:      {shape: [L, W], dtype: i32}
  y_back: {shape: [W, L*C, H], dtype: bf16, symmetric: true}
steps:
  - move: {op: ragged_all_to_all, src: y, dst: y_back, counts: n, index: at, capacity: C,
           groups: L, direction: combine}
"""

# counts[p][e][j]: rows rank p's expert e returns to rank j; 0 (an empty slot) and C
COUNTS = [[[2, C], [0, 1], [C, 3]], [[1, 0], [C, 2], [3, C]]]


def _rows(rank: int) -> torch.Tensor:
    """Rank ``rank``'s src, NaN (with a payload) in some rows, bit-distinct rows."""
    gen = torch.Generator().manual_seed(rank)
    y = torch.randn(L, W * C, H, generator=gen).bfloat16()
    y.view(torch.int16)[:, ::3, 1] = 0x7FC1  # a NaN with its bits: moved, not converted
    return y


def _index(rank: int) -> torch.Tensor:
    """A permutation of the slot's rows per (expert, peer) slot: row 0 -> C - 1, so
    index 0 and capacity - 1 both occur in every full slot."""
    at = torch.empty(L, W * C, dtype=torch.int32)
    for e in range(L):
        for j in range(W):
            at[e, j * C:(j + 1) * C] = (torch.arange(C - 1, -1, -1) + e + j + rank) % C
    return at


def _run(text: str, call: Callable[[Any, int], Any]) -> list[Any]:
    """``call(instance, rank)`` on every rank of a W-rank local group, its result or the
    error it raised (str)."""
    return run_threads(text, "placed", W, {"C": C}, call)


def _expected(j: int, before: torch.Tensor) -> torch.Tensor:
    """Rank j's y_back: live row i of slot (e, j) of rank p at row at[e, j*C + i] of
    slot (p, e); every other row as it was (``before``)."""
    out = before.clone().reshape(W * L, C, H)
    for p in range(W):
        y, at = _rows(p), _index(p)
        for e in range(L):
            for i in range(COUNTS[p][e][j]):
                out[p * L + e, int(at[e, j * C + i])] = y[e, j * C + i]
    return out.reshape(W, L * C, H)


def test_each_row_lands_at_its_index_bit_for_bit() -> None:
    """Rows at index 0 and C - 1, NaN rows by their bits, an empty slot (count 0) and
    the rows no index names keep what the call found there (the poison's bits, read
    back after a first call that wrote nothing: every count 0)."""
    def call(inst: Any, rank: int) -> Any:
        empty = inst.move(_rows(rank), torch.zeros(L, W, dtype=torch.int32), _index(rank))
        before = empty.clone()  # one output: y_back (no recv_counts)
        got = inst.move(_rows(rank), torch.tensor(COUNTS[rank], dtype=torch.int32),
                        _index(rank))
        return [before, got]

    ranks = _run(COMBINE, call)
    assert not any(isinstance(r, str) for r in ranks), ranks
    for j, (before, got) in enumerate(ranks):
        want = _expected(j, before)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), j
    assert any(int(_index(p)[e, j * C]) == C - 1 for p in range(W) for e in range(L)
               for j in range(W))  # the edges occur among live rows
    assert any(int(_index(p)[e, j * C + i]) == 0 for p in range(W) for e in range(L)
               for j in range(W) for i in range(COUNTS[p][e][j]))


@pytest.mark.parametrize("bad", [C, -1])
def test_an_index_outside_the_slot_is_the_call_s_error_not_a_store(bad: int) -> None:
    """Rank 1's row for rank 0's slot of expert 2 placed at ``bad``: rank 1's call raises
    OUTSIDE_SLOT naming the peer, the slot (its flat index in counts [L, W]: 2 * W + 0),
    the row and the capacity; nothing is stored
    outside the slot (rank 0's y_back past its slots is the dst's own memory: its rows
    other than the placed ones are as before)."""
    def call(inst: Any, rank: int) -> Any:
        at = _index(rank)
        if rank == 1:
            at[2, 0 * C + 1] = bad  # expert 2's second row for rank 0 (count 3 > 1)
        return [inst.move(_rows(rank), torch.tensor(COUNTS[rank], dtype=torch.int32), at)]

    ranks = _run(COMBINE, call)
    assert isinstance(ranks[1], str) and ranks[1].startswith(
        f"step 'move': rank 1's index places a row for rank 0 (slot 4 of counts) at row "
        f"{bad} of its slot, outside [0, capacity {C})"), ranks


@pytest.mark.parametrize(("bad", "said"), [
    (2**32, ">= 2147483647"), (2**31 + 3, ">= 2147483647"), (-(2**40), "<= -2147483648")])
def test_an_i64_index_past_i32_is_reported_by_its_side(bad: int, said: str) -> None:
    """An i64 index the kernel's i32 error word cannot hold: clamped with its sign, so
    the message stays true (2**32 was reported as row 0, -2**40 as -2147483648)."""
    text = COMBINE.replace("at:     {shape: [L, W*C], dtype: i32}",
                           "at:     {shape: [L, W*C], dtype: i64}")

    def call(inst: Any, rank: int) -> Any:
        at = _index(rank).long()
        if rank == 1:
            at[2, 0 * C + 1] = bad
        return [inst.move(_rows(rank), torch.tensor(COUNTS[rank], dtype=torch.int32), at)]

    ranks = _run(text, call)
    assert isinstance(ranks[1], str) and ranks[1].startswith(
        f"step 'move': rank 1's index places a row for rank 0 (slot 4 of counts) at row "
        f"{said} of its slot, outside [0, capacity {C})"), ranks


@pytest.mark.parametrize("bad", [C, -1])
def test_a_row_outside_the_slot_stores_nothing_beside_the_legitimate_ones(bad: int) -> None:
    """A first call with every count 0 (the rows as the call finds them), then rank 1's
    expert 1 returns 2 rows to rank 0, the second at ``bad``: rank 1's call raises, and
    rank 0's y_back differs from before only at the first row's index, which holds that
    row's bits (``bad`` = C would land on the next slot's row 0, -1 on the slot
    before's last row: stored there if the kernel's mask let it)."""
    def call(inst: Any, rank: int) -> Any:
        zero = torch.zeros(L, W, dtype=torch.int32)
        y_back = inst.move(_rows(rank), zero, _index(rank))  # the buffer itself
        before = y_back.clone()
        counts, at = zero.clone(), _index(rank)
        if rank == 1:
            counts[1, 0] = 2
            at[1, 0 * C + 1] = bad
            inst.move(_rows(rank), counts, at)  # raises
        try:  # rank 1's signal or its failure, both after its stores
            inst.move(_rows(rank), counts, at)
        except DcpcPeerFailedError:
            pass
        return [before, y_back.clone()]

    ranks = _run(COMBINE, call)
    assert isinstance(ranks[1], str) and "outside [0, capacity" in ranks[1], ranks[1]
    assert not isinstance(ranks[0], str), ranks[0]
    before, got = ranks[0]
    want = before.clone().reshape(W * L, C, H)
    want[1 * L + 1, int(_index(1)[1, 0])] = _rows(1)[1, 0]
    assert torch.equal(got.view(torch.int16), want.reshape(got.shape).view(torch.int16))


@pytest.mark.parametrize("bad", [None, C])
def test_the_torch_backend_places_the_rows_and_refuses_outside(bad: int | None) -> None:
    """One rank (the exchange is a copy): slot e's live rows at index's rows of slot
    (0, e), the rest untouched, no count stored (recv_counts None); an index past the
    slot raises before anything moves."""
    from dcpc.runtime import collectives

    one = collectives.SlotGroup(None, 0, 0, None)
    src = torch.randn(L, C, H)
    at = torch.stack([torch.randperm(C) for _ in range(L)]).to(torch.int32)
    counts = torch.tensor([2, 0, C], dtype=torch.int32)
    dst = torch.full((1, L * C, H), -7.0)
    if bad is not None:
        at[2, C - 1] = bad
        with pytest.raises(DcpcArgumentError, match=rf"step 'move': rank 0's index places "
                           rf"a row for rank 0 \(slot 2 of counts\) at row {bad} of its slot"):
            collectives.ragged_all_to_all(one, src, counts, dst, None, C, 1, "move",
                                          groups=L, combine=True, index=at)
        assert bool((dst == -7.0).all())  # nothing moved
        return
    collectives.ragged_all_to_all(one, src, counts, dst, None, C, 1, "move", groups=L,
                                  combine=True, index=at)
    slots = dst.reshape(L, C, H)
    for e, n in enumerate(counts.tolist()):
        named = [int(r) for r in at[e, :n]]
        for i, r in enumerate(named):
            assert torch.equal(slots[e, r], src[e, i])
        for r in set(range(C)) - set(named):
            assert bool((slots[e, r] == -7.0).all())  # never written


def test_the_reference_places_rows_and_refuses_outside() -> None:
    """The float64 reference: the same placement (rows no index names NaN, unsent), and
    an index outside the slot is the simulator's error (as a count over capacity)."""
    from dcpc.harness.simulate import simulate_call
    from dcpc.lang.parse import parse_text

    schedule = parse_text(COMBINE)
    inputs = [{"y": _rows(p).double(), "at": _index(p).long(),
               "n": torch.tensor(COUNTS[p])} for p in range(W)]
    out = simulate_call(schedule, W, {"C": C, "L": L, "H": H}, inputs,
                        external=None)  # type: ignore[arg-type]
    for j in range(W):
        got = out[j]["y_back"]
        want = _expected(j, torch.full((W, L * C, H), float("nan"), dtype=torch.bfloat16))
        assert torch.equal(got.isnan(), want.isnan()), j
        assert torch.equal(got.nan_to_num(7.0), want.double().nan_to_num(7.0)), j
    inputs[1]["at"][2, 1] = C
    with pytest.raises(ValueError, match=rf"rank 1's index of slot 4 holds {C}, outside"):
        simulate_call(schedule, W, {"C": C, "L": L, "H": H}, inputs,
                      external=None)  # type: ignore[arg-type]


def test_run_draws_distinct_rows_per_slot_and_reads_only_placed_rows() -> None:
    """The gallery's synthetic inputs: i_send (sent beside the tokens, returned as the
    combine's index) holds distinct rows of [0, min(T, C)) in the first min(T, C) rows
    of every slot (the counts, at most T, make no more live), and the
    weighted_combine's slot_of names only rows the combine places on this rank
    ((j * L + e) * C + i_send[j, e * C + i], i < counts[j, e]) or -1."""
    from dcpc.harness import synth
    from dcpc.lang.parse import parse_file

    schedule = parse_file(ROOT / "schedules/gallery/moe_dispatch_combine.yaml", 3)
    ctor = synth.constructor_sizes(schedule, 3)
    named = 0
    for call in range(4):
        sizes = synth.call_sizes(schedule, 3, ctor, 0, call)
        cap, tokens = sizes["C"], min(sizes["T"], sizes["C"])
        for bufs in synth.call_inputs(schedule, 3, sizes, 0, call):
            sent = bufs["i_send"].reshape(-1, cap)
            assert int(bufs["counts"].max()) <= tokens
            for slot in sent.tolist():
                assert len(set(slot[:tokens])) == tokens and all(0 <= v < tokens for v in slot)
            live = {s * cap + int(sent[s, i]) for s, n in
                    enumerate(bufs["counts"].reshape(-1).tolist()) for i in range(n)}
            picks = [v for v in bufs["slot_of"].reshape(-1).tolist() if v >= 0]
            assert set(picks) <= live, (call, picks, live)
            named += len(picks)
    assert named > 0


def test_two_rows_placed_alike_keep_the_later_in_the_reference_and_torch() -> None:
    """A duplicate index (a race in DeepEP too; ``dcpc run`` never draws one): the
    float64 reference and the torch backend both keep the later row in row order, and
    the row no index names stays unwritten."""
    from dcpc.harness.simulate import simulate_call
    from dcpc.lang.parse import parse_text
    from dcpc.runtime import collectives

    src = torch.randn(L, C, H).bfloat16()
    at = torch.tensor([[1, 1, 0, 2]] * L, dtype=torch.int32)  # rows 0 and 1 both at 1
    counts = torch.tensor([3, 3, 3], dtype=torch.int32)
    dst = torch.full((1, L * C, H), -7.0).bfloat16()
    collectives.ragged_all_to_all(collectives.SlotGroup(None, 0, 0, None), src, counts, dst,
                                  None, C, 1, "move", groups=L, combine=True, index=at)
    one = COMBINE.replace("[L, W*C", "[L, C").replace("[W, L*C", "[1, L*C").replace(
        "[L, W]", "[L, 1]")
    ref = simulate_call(parse_text(one), 1, {"C": C, "L": L, "H": H},
                        [{"y": src.double(), "at": at.long(), "n": counts.reshape(L, 1)}],
                        external=None)[0]["y_back"]  # type: ignore[arg-type]
    for e in range(L):
        for got in (dst.reshape(L, C, H)[e].double(), ref.reshape(L, C, H)[e]):
            assert torch.equal(got[1], src[e, 1].double())  # the later of rows 0 and 1
            assert torch.equal(got[0], src[e, 2].double())
        assert bool((dst.reshape(L, C, H)[e, 2:] == -7.0).all())
        assert bool(ref.reshape(L, C, H)[e, 2:].isnan().all())


@pytest.mark.parametrize(("spot", "code", "words"), [
    ("at:     {shape: [L, W*C], dtype: i32}", None, ""),
    ("at:     {shape: [L, W*C], dtype: f32}", "bad-index",
     "index 'at' of step 'move' is f32; it holds the row of its slot each row of src"),
    ("at:     {shape: [L, C], dtype: i32}", "shape-mismatch",
     "index 'at' of step 'move' has shape [L, C] but must be [L, W*C]"),
])
def test_an_index_is_integers_in_src_s_first_two_dims(spot: str, code: str | None,
                                                      words: str) -> None:
    """The checker: an index of floats, or not one integer per row of src, is a located
    error at the step's ``index`` entry; the footprint is the slot (no other error)."""
    text = COMBINE.replace("at:     {shape: [L, W*C], dtype: i32}", spot)
    found = check_errors(text)
    if code is None:
        assert found == []
        return
    (error,) = found
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "index: at" in t)
    col = text.splitlines()[line - 1].index("index: at") + len("index: ") + 1
    assert (error.code, error.mark.line, error.mark.col) == (code, line, col)
    assert words in error.message, error.message
