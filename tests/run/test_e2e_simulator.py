"""The float64 reference itself, checked against definitions written out by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from dcpc.harness import simulate, synth
from dcpc.lang.parse import parse_file, parse_text

SCHEDULES = Path(__file__).resolve().parents[2] / "schedules"


@pytest.mark.parametrize("world,interleave", [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_local_seq_len_matches_token_placement(world: int, interleave: int) -> None:
    seq_lens = torch.arange(0, 40)
    for rank in range(world):
        want = [sum(1 for t in range(n) if (t // interleave) % world == rank) for n in range(40)]
        got = simulate.local_seq_len(seq_lens, rank, world, interleave)
        assert got.tolist() == want


def test_merge_weights_edge_cases() -> None:
    lse = torch.tensor([[1.0, -math.inf, -math.inf], [2.0, 0.5, -math.inf]], dtype=torch.float64)
    weights, merged = simulate.merge_weights(lse, "e")
    assert merged[0].item() == pytest.approx(math.log(math.e + math.e**2))
    assert merged[1].item() == 0.5 and weights[:, 1].tolist() == [0.0, 1.0]
    assert merged[2].item() == -math.inf and weights[:, 2].tolist() == [0.0, 0.0]
    garbage = torch.tensor([[[math.nan]], [[3.0]]], dtype=torch.float64)
    out = simulate._weighted_sum(torch.tensor([[0.0], [1.0]], dtype=torch.float64), garbage)
    assert out.tolist() == [[3.0]], "a zero weight must contribute exactly 0, even to NaN"


def test_base2_merge_equals_natural_merge_of_the_same_lse() -> None:
    lse_e = torch.randn(3, 5, dtype=torch.float64)
    w_e, m_e = simulate.merge_weights(lse_e, "e")
    w_2, m_2 = simulate.merge_weights(lse_e / math.log(2), "2")
    assert torch.allclose(w_e, w_2) and torch.allclose(m_e / math.log(2), m_2)


@pytest.mark.parametrize("world", [2, 3])
def test_kimi_schedule_reference_by_hand(world: int) -> None:
    schedule = parse_file(SCHEDULES / "kimi_k3_dcp.yaml")
    ctor = synth.constructor_sizes(schedule, world)
    for call in range(6):
        sizes = synth.call_sizes(schedule, world, ctor, 5, call)
        inputs = synth.call_inputs(schedule, world, sizes, 5, call)
        ext = synth.make_external(schedule, world, sizes, 5, call)
        bufs = simulate.simulate_call(schedule, world, sizes, inputs, ext)
        hl = sizes["H"] // world
        q_full = torch.cat([inputs[r]["q_local"] for r in range(world)], dim=1)
        seq_lens, qsl = inputs[0]["seq_lens"], inputs[0]["query_start_loc"]
        for r in range(world):
            # bit for bit: q_local is a moved payload, its NaNs with their bits
            assert torch.equal(bufs[r]["q_full"].view(torch.int64), q_full.view(torch.int64))
            for t in range(sizes["T"]):
                b = int(torch.searchsorted(qsl[1:], torch.tensor(t), right=True))
                for h in range(hl):
                    parts = []
                    for p in range(world):
                        lse = float(bufs[p]["lse_part"][t, r * hl + h])
                        shard = sum(1 for k in range(int(seq_lens[min(b, len(seq_lens) - 1)]))
                                    if k % world == p)
                        if t >= int(qsl[-1]) or shard == 0 or math.isnan(lse) or lse == math.inf:
                            continue
                        parts.append((lse, bufs[p]["o_part"][t, r * hl + h]))
                    want = torch.zeros(sizes["Dv"], dtype=torch.float64)
                    if parts:
                        top = max(lse for lse, _ in parts)
                        total = top + math.log(sum(math.exp(lse - top) for lse, _ in parts))
                        for lse, o in parts:
                            want += math.exp(lse - total) * o
                    got = bufs[r]["out"][t, h]
                    assert torch.allclose(got, want.to(torch.bfloat16).double(), atol=1e-2)
                    assert not torch.isnan(got).any()


def test_inputs_cover_empty_shards_padding_and_token_extremes() -> None:
    schedule = parse_file(SCHEDULES / "kimi_k3_dcp.yaml")
    world, ctor = 3, synth.constructor_sizes(schedule, 3)
    tokens, padded, empty, garbage = set(), 0, 0, 0
    for call in range(50):
        sizes = synth.call_sizes(schedule, world, ctor, 0, call)
        inputs = synth.call_inputs(schedule, world, sizes, 0, call)
        tokens.add(sizes["T"])
        qsl = inputs[0]["query_start_loc"]
        padded += int(qsl[-1]) < sizes["T"]
        empty += int((simulate.local_seq_len(inputs[0]["seq_lens"], 2, world, 1) == 0).any())
        bufs = simulate.simulate_call(schedule, world, sizes, inputs,
                                      synth.make_external(schedule, world, sizes, 0, call))
        garbage += int((~torch.isfinite(bufs[0]["o_part"])).any())
    assert {1, ctor["T"]} <= tokens
    assert padded >= 5 and empty >= 5 and garbage >= 5


def _unwritten(schedule: Any, world: int) -> Any:
    """The UnwrittenRead the float64 reference of one call of ``schedule`` raises."""
    sizes = synth.call_sizes(schedule, world, synth.constructor_sizes(schedule, world, {}),
                             1, 0)
    inputs = synth.call_inputs(schedule, world, sizes, 1, 0)
    external = synth.make_external(schedule, world, sizes, 1, 0)
    with pytest.raises(simulate.UnwrittenRead) as err:
        simulate.simulate_call(schedule, world, sizes, inputs, external, trace=[])
    return err


def test_a_reference_read_of_an_unwritten_buffer_names_step_buffer_and_rank() -> None:
    """A schedule the checker refuses (rank 2 is no destination of the swap at W=3, yet
    'use' reads its s): were it ever proved (a checker bug, as one was), the reference
    says where it read nothing; it raised a bare KeyError: 's'."""
    schedule = parse_text(
        "schedule: s\nsizes: {N: 4, D: 2}\nbuffers:\n  x: {shape: [N, D], dtype: f32}\n"
        "  y: {shape: [N, D], dtype: f32}\n"
        "  s: {shape: [N, D], dtype: f32, symmetric: true}\nsteps:\n"
        '  - swap: {op: shift, src: x, dst: s, perm: "r + 1 - 2 * (r % 2)"}\n'
        '  - use: {op: external, when: "rank >= 0", reads: [s], writes: [y]}\n', world=3)
    err = _unwritten(schedule, 3)
    assert (err.value.step, err.value.buffer, err.value.rank) == ("use", "s", 2)
    assert str(err.value).startswith("the float64 reference of step 'use' reads 's' on "
                                     "rank 2, where no earlier step of the call wrote it")


def test_a_reference_read_in_a_wait_first_chain_names_the_step() -> None:
    """Review finding: the chain of a wait written before its put (simulate._chain) raised
    UnwrittenRead with no step. Rank 0 receives nothing from the line, yet 'stage' reads
    its recv there (the checker refuses it: read-before-write)."""
    schedule = parse_text(
        "schedule: s\nsizes: {N: 4, D: 2}\nbuffers:\n  a: {shape: [N, D], dtype: f32}\n"
        "  r: {shape: [N, D], dtype: f32, symmetric: true}\nsteps:\n"
        "  - receive: {op: shift, src: a, dst: r, offset: next, wrap: false, phase: wait}\n"
        '  - stage: {op: external, when: "rank >= 0", reads: [r], writes: [a]}\n'
        "  - send: {op: shift, src: a, dst: r, offset: next, wrap: false, phase: put}\n",
        world=2)
    err = _unwritten(schedule, 2)
    assert (err.value.step, err.value.buffer, err.value.rank) == ("stage", "r", 0)
    assert str(err.value).startswith("the float64 reference of step 'stage' reads 'r'")
