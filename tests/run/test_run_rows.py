"""``dcpc run`` judges a layout whatever its rows are called (issue 21 item 6): the
synthetic inputs put CUDA-graph padding rows, empty KV shards and NaN/inf garbage on the
rows ``query_start_loc`` indexes (the masked merge's leading dim: ``B*T`` for MTP), and
``--sizes`` binds any size name, validated as the generated constructor does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc.demo import main
from dcpc.harness import simulate, synth
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
MTP = ROOT / "schedules" / "gallery" / "mtp_dbo_decode.yaml"


def test_mtp_rows_get_padding_empty_shards_and_garbage() -> None:
    """Rows B*T (no size named like the rows): the old synth built its masks around a size
    named ``T`` and left every padding row and empty shard of this layout untested."""
    schedule = parse_file(MTP)
    world = 3
    ctor = synth.constructor_sizes(schedule, world)
    padding = empty = garbage = rows_seen = masked_all = 0
    beyond_t = False  # a call with real rows past T: the mask spans B*T rows
    for call in range(8):
        sizes = synth.call_sizes(schedule, world, ctor, 0, call)
        rows = synth.mask_rows(schedule, sizes)
        assert rows == sizes["B"] * sizes["T"]
        inputs = synth.call_inputs(schedule, world, sizes, 0, call)
        qsl = inputs[0]["query_start_loc"]
        assert len(qsl) == rows + 1 and int(qsl[-1]) <= rows
        rows_seen += rows
        beyond_t |= int(qsl[-1]) > sizes["T"]
        padding += rows - int(qsl[-1])
        external = synth.make_external(schedule, world, sizes, 0, call)
        bufs = simulate.simulate_call(schedule, world, sizes, inputs, external)
        mask = synth.mask_of(schedule)
        for r in range(world):
            masked = simulate.empty_rows(mask, inputs[r], r, world, rows)
            empty += int(masked[: int(qsl[-1])].sum())  # real rows of an empty shard
            masked_all += int(masked.sum())
            bad = ~torch.isfinite(bufs[r]["o_part"]).all(-1).all(-1)
            garbage += int(bad.sum())
            assert not bool(bad[~masked].any()), "garbage only where the mask hides it"
            assert torch.isfinite(bufs[r]["out"]).all(), f"call {call} rank {r}: NaN leaked"
    print(f"{rows_seen} rows: {padding} padding, {empty} empty-shard (row, rank) pairs, "
          f"{garbage} (row, rank) partials of garbage")
    assert padding > 0 and empty > 0 and beyond_t
    # garbage on the masked rows (a quarter of the pool is a finite 3e4): on every kind
    assert 2 * garbage >= masked_all, (garbage, masked_all)


def test_sizes_option_is_validated_before_any_rank_starts(capsys) -> None:
    for sizes, words in (("X=3", "unknown size 'X'; the schedule's sizes are"),
                         ("T=9", "size T can only be lowered from its maximum 8 (1..8), got 9"),
                         ("D=8", "size D is the constant 576, not 8"),
                         ("H=3", "size H=3 must be a positive multiple of W=2 (W=2)")):
        assert main([str(MTP), "--sizes", sizes, "--calls", "1"]) == 2, sizes
        err = capsys.readouterr().err
        assert f"dcpc run: --sizes: MtpDboDecode: {words}" in err, err


@pytest.mark.parametrize("text,words", [
    ("T", "'T' is not NAME=INT"), ("T=x", "size T: 'x' is not an integer"),
    ("T=2,T=3", "size T given twice")])
def test_sizes_option_syntax(capsys, text: str, words: str) -> None:
    assert main([str(MTP), "--sizes", text]) == 2
    assert words in capsys.readouterr().err


def test_default_deadline_grows_with_steps_sizes_and_world() -> None:
    from dcpc.harness.run import default_timeout_s, run_elements

    kimi = str(ROOT / "schedules" / "kimi_k3_dcp.yaml")

    def deadline(path: str, world: int, calls: int = 20, **given: int) -> float:
        s = synth.constructor_sizes(parse_file(path), world, given)
        return default_timeout_s(calls, world, 60.0, *run_elements(path, world, s))

    old = 4 * (60 + 0.6 * 20 * 2)  # the former bound: max(60 + 0.6 x calls x W, ...)
    assert old <= deadline(kimi, 2) <= 1.1 * old  # the shipped schedule keeps its bound
    assert deadline(kimi, 4) > deadline(kimi, 3) > deadline(kimi, 2)
    assert deadline(str(MTP), 4, T=8, B=64) > 4 * deadline(str(MTP), 4, T=8, B=4)
    steps, _ = run_elements(kimi, 2, {"T": 8, "B": 4, "H": 4})
    assert default_timeout_s(20, 2, 60.0, 2 * steps) > default_timeout_s(20, 2, 60.0, steps)
