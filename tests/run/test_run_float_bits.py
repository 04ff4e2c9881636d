"""bf16/f16/f32 moves compared bit for bit: the draws carry NaNs with payloads and of both
signs, -0, +-inf and subnormals (synth.FLOAT_EDGES), the float64 reference keeps a NaN's
bits (simulate.float_value, float_bits: nan19's fp8 tag for every float dtype), and a
move that flips a -0, canonicalises a NaN's payload or flips its sign is a located
mismatch on every backend; a computed value stays compared by value."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcpc.harness import synth
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import (
    BITS,
    TORCH_DTYPES,
    float_bits,
    float_value,
    signed_view,
    simulate_call,
)
from dcpc.harness.worker import OutputStats, compare
from dcpc.lang import model as m
from dcpc.lang.parse import parse_file, parse_text

OPS = Path(__file__).resolve().parents[2] / "schedules" / "ops"
SIGN = {"bf16": 1 << 15, "f16": 1 << 15, "f32": 1 << 31}


def _signed(bits: int, dtype: str) -> int:
    return signed_view(bits, 8 * TORCH_DTYPES[dtype].itemsize)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "fp8e4m3", "fp8e5m2"])
def test_every_bit_pattern_is_kept(dtype: str) -> None:
    """float_value then float_bits gives back every bit pattern of the dtype, each NaN
    payload of both signs included (torch's conversion keeps a NaN's sign only)."""
    size = TORCH_DTYPES[dtype].itemsize
    raw = torch.arange(1 << (8 * size), dtype=torch.int64)
    raw = (raw.to(torch.uint8) if size == 1 else
           torch.where(raw >> (8 * size - 1) > 0, raw - (1 << (8 * size)), raw).to(BITS[size]))
    assert torch.equal(float_bits(float_value(raw, dtype), dtype), raw)
    assert int(torch.isnan(float_value(raw, dtype)).sum()) >= 2


def test_f32_edges_and_a_signalling_nan_are_kept() -> None:
    raw = torch.tensor([_signed(b, "f32") for b in synth.FLOAT_EDGES[m.DType.f32]],
                       dtype=torch.int32)
    assert torch.equal(float_bits(float_value(raw, "f32"), "f32"), raw)


@pytest.mark.parametrize(("file", "buffer", "dtype"), [
    ("shift.yaml", "kv", "bf16"), ("all_gather.yaml", "k", "f16"), ("copy.yaml", "k", "f32"),
])
def test_a_moved_payload_carries_the_edges(file: str, buffer: str, dtype: str) -> None:
    """Every row of a moved payload holds edges (the NaNs, -0, +-inf, subnormals) in at
    most half its columns, among normal values."""
    schedule = parse_file(OPS / file, 2)
    assert buffer in synth.payload_floats(schedule) & set(synth.engine_inputs(schedule))
    sizes = synth.call_sizes(schedule, 2, synth.constructor_sizes(schedule, 2), 0, 0)
    edges = torch.tensor([_signed(b, dtype) for b in synth.FLOAT_EDGES[m.DType(dtype)]])
    for rank in synth.call_inputs(schedule, 2, sizes, 0, 0):
        bits = float_bits(rank[buffer], dtype)
        rows = bits.reshape(-1, bits.shape[-1]).to(torch.int64)
        hits = torch.isin(rows, edges)
        assert (hits.sum(1) == min(len(edges), rows.shape[1] // 2)).all(), rows
        assert set(rows[hits].tolist()) == set(edges.tolist())


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize(("sent", "got"), [
    ("neg_zero", "zero"), ("nan_payload", "nan_quiet"), ("nan_payload", "nan_neg"),
])
def test_a_move_that_changes_bits_mismatches(dtype: str, sent: str, got: str) -> None:
    """compare: by bits for a move (a -0 made +0, a NaN's payload or sign changed, each
    equal by value), by value for math (-0 and +0 equal; any NaN where the reference's)."""
    sign, quiet = SIGN[dtype], {"bf16": 0x7FC0, "f16": 0x7E00, "f32": 0x7FC00000}[dtype]
    bits = {"neg_zero": sign, "zero": 0, "nan_payload": quiet | 1, "nan_quiet": quiet,
            "nan_neg": sign | quiet | 1}
    raw = float_bits(torch.randn(3, 8, dtype=torch.float64), dtype)
    raw[2, 5] = _signed(bits[sent], dtype)
    want = float_value(raw, dtype)  # the reference: the source's bits, moved
    out = raw.clone()
    stats = OutputStats()
    compare("x", "move", dtype, out.view(TORCH_DTYPES[dtype]), want, stats, "call 0")
    assert stats.mismatches == 0, stats
    out[2, 5] = _signed(bits[got], dtype)
    compare("x", "math", dtype, out.view(TORCH_DTYPES[dtype]), want, stats, "call 0")
    assert stats.mismatches == 0, stats
    compare("x", "move", dtype, out.view(TORCH_DTYPES[dtype]), want, stats, "call 1")
    assert stats.mismatches == 1 and stats.first_mismatch.startswith("call 1: x[2, 5] = "), stats


# what a bad move does to the bf16 bits it lands (int16 ``b``): the received block of
# schedules/ops/shift.yaml, changed in place before the method returns it
RETURN = '        return self._view("kv_recv", slot, _env)'
BAD = {
    "minus_zero_made_plus": "torch.where(_b == -32768, 0, _b)",
    "nan_payload_canonical": "torch.where(_nan, (_b & -32768) | 0x7FC0, _b)",
    "nan_sign_flipped": "torch.where(_nan, _b ^ -32768, _b)",
}


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["host", "torch", "local"])
@pytest.mark.parametrize("bad", [None, *BAD])
def test_a_bad_move_is_found_on_every_backend(backend: str, bad: str | None) -> None:
    """The shift of a bf16 block: clean as generated; each bad move a located mismatch of
    the received block (before this change none of them was drawn, and they passed)."""
    patch = () if bad is None else ((RETURN, (
        '        _v = self._view("kv_recv", slot, _env)\n'
        "        _b = _v.view(torch.int16)\n"
        "        _nan = (_b & 0x7FFF) > 0x7F80\n"
        f"        _b.copy_({BAD[bad]})\n"
        "        return _v")),)
    report = run_schedule(RunConfig(schedule=str(OPS / "shift.yaml"), world=2,
                                    backend=backend, calls=2, seed=3, module_patch=patch))
    text = format_report(report)
    if bad is None:
        assert report.ok and report.mismatches == 0, text
        return
    stats = report.outputs["kv_recv"]
    assert not report.ok and stats.mismatches >= 1, text
    said = "= 0.0, reference -0.0" if bad == "minus_zero_made_plus" else "= nan, reference nan"
    assert "(hop): kv_recv[" in stats.first_mismatch and said in stats.first_mismatch, text


# one all_gather carrying a moved bf16 block beside an f32 one a reduce_scatter computed
MIXED_GATHER = """\
schedule: mixed_gather
slots: 1
sizes:
  T: {max: 8}
  H: 3
  D: 16
buffers:
  q:        {shape: [T, H, D],    dtype: bf16}
  lse_part: {shape: [T, W*H],     dtype: f32}
  lse:      {shape: [T, H],       dtype: f32}
  q_full:   {shape: [T, W*H, D],  dtype: bf16, symmetric: true}
  lse_all:  {shape: [T, W, H],    dtype: f32, symmetric: true}
  out:      {shape: [T, H, D],    dtype: bf16}
steps:
  - scatter: {op: reduce_scatter, src: lse_part, dst: lse, dim: 1}
  - gather:  {op: all_gather, src: [q, lse], dst: [q_full, lse_all], dim: 1}
  - use:     {op: external, reads: [q_full, lse_all], writes: [out]}
  - release: {op: barrier}
"""
GATHERED = '            self._view("q_full", slot, _env),\n'


@pytest.mark.e2e
@pytest.mark.parametrize("bad", [False, True])
def test_a_move_beside_a_computed_payload_is_compared_by_bits(tmp_path: Path,
                                                              bad: bool) -> None:
    """Each dst of a move takes its own src's kind: the gathered q is compared bit for
    bit though the same step carries a computed lse (by value); a gather that makes q's
    -0 +0 and canonicalises its NaNs mismatches (it passed when the step decided)."""
    path = tmp_path / "mixed_gather.yaml"
    path.write_text(MIXED_GATHER)
    flip = ("def _flip(_v):\n    _b = _v.view(torch.int16)\n    _nan = (_b & 0x7FFF) > 0x7F80\n"
            "    _b.copy_(torch.where(_b == -32768, 0, torch.where(_nan, (_b & -32768) | 0x7FC0,"
            " _b)))\n    return _v\n\n\nclass ")
    patch = ((GATHERED, f"            _flip({GATHERED.strip()[:-1]}),\n"), ("class ", flip)) \
        if bad else ()
    report = run_schedule(RunConfig(schedule=str(path), world=2, backend="torch", calls=2,
                                    seed=3, module_patch=patch))
    text = format_report(report)
    if not bad:
        assert report.ok and report.mismatches == 0, text
        return
    assert report.outputs["q_full"].mismatches >= 1, text
    assert report.outputs["lse_all"].mismatches == 0, text


# x moved whole (a copy) and its first half reduced: one memory
SLICE_REDUCE = """\
schedule: slice_reduce
slots: 1
sizes:
  T: {max: 8}
  E: 16
buffers:
  x:      {shape: [2, W*T, E], dtype: bf16}
  xc:     {shape: [2, W*T, E], dtype: bf16}
  y:      {shape: [T, E],      dtype: bf16}
  y2:     {shape: [T, E],      dtype: bf16}
steps:
  - keep:    {op: copy, src: x, dst: xc}
  - scatter: {op: reduce_scatter, src: "x[0]", dst: y, dim: 0}
  - again:   {op: copy, src: y, dst: y2}
  - release: {op: barrier}
"""


def test_a_slice_read_for_its_value_keeps_the_whole_off_the_edges() -> None:
    """A buffer moved whole and reduced by slice is read for its value: no edge draws
    (before, the reduction read the drawn NaN/inf/max edges and the run failed)."""
    schedule = parse_text(SLICE_REDUCE)
    assert not {"x", "x_0", "x_1"} & synth.payload_floats(schedule)


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_a_slice_reduced_beside_a_whole_move_runs_clean(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "slice_reduce.yaml"
    path.write_text(SLICE_REDUCE)
    report = run_schedule(RunConfig(schedule=str(path), world=2, backend=backend, calls=2,
                                    seed=3))
    assert report.ok and report.mismatches == 0, format_report(report)


REDUCE = """\
schedule: reduce_nan
slots: 1
sizes:
  E: 4
buffers:
  x: {shape: [W*E], dtype: bf16}
  y: {shape: [E],    dtype: bf16}
steps:
  - scatter: {op: reduce_scatter, src: x, dst: y, dim: 0}
"""


def test_a_computed_nan_drops_a_moved_nan_s_payload() -> None:
    """float64 arithmetic keeps a NaN's payload: a sum over a NaN tagged 0xFF81 is stored
    as a plain NaN (0x7FC0 or 0xFFC0: its sign is the arithmetic's), not the moved bits."""
    raw = torch.tensor([-127, 0x7FC1, 0, 0, 0, 0, 0, 0], dtype=torch.int16)  # 0xFF81
    x = float_value(raw, "bf16")
    inputs = [{"x": x.clone()}, {"x": x.clone()}]
    out = simulate_call(parse_text(REDUCE), 2, {"E": 4}, inputs, external=None)  # type: ignore[arg-type]
    bits = float_bits(out[0]["y"], "bf16").tolist()
    assert [b & 0x7FFF for b in bits[:2]] == [0x7FC0, 0x7FC0], bits


@pytest.mark.parametrize("dtype", [m.DType.bf16, m.DType.f32])
def test_an_empty_payload_draws_nothing(dtype: m.DType) -> None:
    """A payload of size 0 this call (``[4, T - 1]`` at T = 1) draws an empty tensor
    (the edges' reshape raised on it, as full_range_fp8's did before this branch)."""
    g = torch.Generator().manual_seed(0)
    assert synth.with_edges((4, 0), g, dtype).shape == (4, 0)
    assert synth.full_range_fp8((0, 3), g).shape == (0, 3)


SPAN_SUM = """\
schedule: span_sum
slots: 1
sizes: {N: 4, D: 8}
buffers:
  x:    {shape: [2, N, D], dtype: bf16}
  act:  {shape: [2, N, D], dtype: bf16}
  recv: {shape: [2, N, D], dtype: bf16, symmetric: true}
  tot:  {shape: [N, D], dtype: bf16}
  out:  {shape: [N, D], dtype: bf16}
steps:
  - receive: {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: wait}
  - first:   {op: copy, when: "rank == 0", src: x, dst: act}
  - stage:   {op: copy, when: "rank > 0", src: recv, dst: act}
  - add:     {op: sum, when: "rank > 0", src: recv, dst: tot, dim: 0}
  - send:    {op: shift, src: act, dst: recv, offset: next, wrap: false, phase: put}
  - credit:  {op: signal, to: prev, channel: free}
  - last:    {op: external, reads: [act], writes: [out]}
  - look:    {op: external, when: "rank > 0", reads: [tot]}
  - freed:   {op: wait, from: next, channel: free}
"""


def test_a_sum_inside_a_wait_first_span_stores_a_plain_nan() -> None:
    """The reference runs a wait-first span's steps in the span's own order
    (simulate._chain); a step there that computes stores as every computing step does:
    the NaN a moved bf16 payload (0xFF81) brings into a sum is stored plain, not with the
    moved tag (the merge of chains20's span loop with bits20's _storing)."""
    schedule = parse_text(SPAN_SUM)
    raw = torch.zeros(2 * 4 * 8, dtype=torch.int16)
    raw[0] = _signed(0xFF81, "bf16")
    x = float_value(raw.view(2, 4, 8), "bf16")
    inputs = [{"x": x.clone()} for _ in range(2)]

    def external(step: m.Step, rank: int, bufs: dict) -> dict:
        return {"out": bufs["act"][0].clone()} if step.name == "last" else {}

    out = simulate_call(schedule, 2, {"N": 4, "D": 8}, inputs, external)
    assert bool(out[1]["recv"][0, 0, 0].isnan())  # the moved NaN reached rank 1
    stored = float_bits(out[1]["tot"], "bf16").flatten()[0].item() & 0xFFFF
    assert stored & 0x7FC0 == 0x7FC0 and stored != 0xFF81, hex(stored)
