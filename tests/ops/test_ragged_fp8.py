"""fp8 e4m3 (and e5m2) tokens moved as they are, with their per-128-channel f32 scales beside them
(DeepEP's normal dispatch takes x = (fp8 [tokens, hidden], f32 [tokens, hidden / 128]),
the caller having quantised): schedules/ops/ragged_all_to_all_fp8.yaml. No cast: every
payload moves bit for bit. `dcpc run` draws such a payload over every byte (NaN of both
signs, -0) and compares an fp8 move by its bytes; a scale buffer of the wrong shape is
refused where it is declared in the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.schedules import errors, write

from dcpc.harness import synth
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.simulate import TORCH_DTYPES, float_bits, float_value
from dcpc.harness.worker import OutputStats, compare
from dcpc.lang import model as m
from dcpc.lang.parse import parse_file

ROOT = Path(__file__).resolve().parents[2]
FILE = ROOT / "schedules" / "ops" / "ragged_all_to_all_fp8.yaml"
E5M2 = ROOT / "schedules" / "ops" / "ragged_all_to_all_fp8e5m2.yaml"


def _at(text: str, needle: str) -> tuple[int, int]:
    """(line, col), 1-based, of the first ``needle`` after the 'steps:' line."""
    lines = text.splitlines()
    start = lines.index("steps:")
    for i, line in enumerate(lines[start:], start + 1):
        if needle in line:
            return i, line.index(needle) + 1
    raise AssertionError(needle)


@pytest.mark.parametrize(("old", "new", "step_key", "want"), [
    # the receiver's scales per 64 channels, the sender's per 128
    ("s_recv:   {shape: [W, C, H/128]", "s_recv:   {shape: [W, C, H/64]", "s_recv,",
     "dst 's_recv' of step 'dispatch' has shape [W, C, H/64] but must be [W, C, H/128]"),
    # one scale row more than the tokens' capacity
    ("s_send:   {shape: [W, C, H/128]", "s_send:   {shape: [W, C + 1, H/128]", "s_send,",
     "src 's_send' of step 'dispatch' has shape [W, C+1, H/128] but must be [W, C, H/128]"),
])
def test_a_wrong_scale_shape_is_refused_where_the_step_names_it(
        tmp_path: Path, old: str, new: str, step_key: str, want: str) -> None:
    text = FILE.read_text()
    assert old in text
    text = text.replace(old, new)
    found = errors(write(tmp_path, text, "fp8.yaml"))
    line, col = _at(text, step_key)
    hits = [f for f in found if f[0] == "shape-mismatch" and f[1:3] == (line, col)]
    assert hits and want in hits[0][3], found


def test_scales_of_an_h_not_a_multiple_of_128_are_refused(tmp_path: Path) -> None:
    text = FILE.read_text().replace("  H: 256", "  H: 200")
    found = errors(write(tmp_path, text, "fp8.yaml"))
    assert {f[0] for f in found} == {"inexact-division"}, found
    assert any("H/128 is not a whole number" in f[3] and "'s_send'" in f[3] for f in found)


def assert_rows_carry_edges(raw: torch.Tensor, edges: tuple[int, ...]) -> None:
    """Every row carries ``edges`` in order from some column on (wrapping), and that
    column differs between rows: 0xFF (the poison's byte) at no fixed column."""
    starts = set()
    for row in raw.reshape(-1, raw.shape[-1]).tolist():
        found = [c for c in range(len(row))
                 if all(row[(c + i) % len(row)] == e for i, e in enumerate(edges))]
        assert found, row
        starts.add(found[0])
    assert len(starts) > 1, starts


def test_fp8_payloads_are_drawn_over_every_byte() -> None:
    schedule = parse_file(FILE, 2)
    assert synth.payload_fp8(schedule) & set(synth.engine_inputs(schedule)) == {"x_send"}
    sizes = synth.call_sizes(schedule, 2, synth.constructor_sizes(schedule, 2), 0, 0)
    for rank in synth.call_inputs(schedule, 2, sizes, 0, 0):
        raw = rank["x_send"].to(torch.float8_e4m3fn).view(torch.uint8)
        assert_rows_carry_edges(raw, synth.FP8_EDGES[m.DType.fp8e4m3])  # both NaNs, -0
        assert len(set(raw.flatten().tolist())) > 200  # every byte, not only the edges
        # the scales: moved f32 values (synth.with_edges), one edge in a row of 2
        bits = float_bits(rank["s_send"], "f32").reshape(-1, 2)
        edge = torch.isin(bits, torch.tensor(synth.FLOAT_EDGES[m.DType.f32]).int())
        assert (edge.sum(1) == 1).all(), bits


def test_a_cast_operand_is_not_drawn_as_bytes() -> None:
    """An fp8 buffer a move dequantises is read for its value: drawn as values."""
    path = ROOT / "tests" / "op_known_failures" / "dequant_into_bf16.yaml"
    assert synth.payload_fp8(parse_file(path, 2)) == set()


ONE = {"fp8e4m3": 0x38, "fp8e5m2": 0x3C}  # 1.0


@pytest.mark.parametrize(("dtype", "got", "want", "kind", "off"), [
    ("fp8e4m3", 0x7F, 0xFF, "move", True),   # a NaN's sign lost
    ("fp8e4m3", 0x00, 0x80, "move", True),   # a zero's sign lost
    ("fp8e4m3", 0x7F, 0x7F, "move", False),
    ("fp8e4m3", 0x7F, 0xFF, "math", False),  # computed values: NaN is NaN
    ("fp8e4m3", 0x00, 0x80, "math", False),
    ("fp8e5m2", 0x7F, 0xFF, "move", True),   # a NaN's sign lost
    ("fp8e5m2", 0x00, 0x80, "move", True),   # a zero's sign lost
    ("fp8e5m2", 0x7C, 0x7B, "move", True),   # inf for the largest finite value
    ("fp8e5m2", 0x01, 0x00, "move", True),   # the smallest subnormal for 0
    ("fp8e5m2", 0xFC, 0xFC, "move", False),  # -inf as -inf
    ("fp8e5m2", 0x7F, 0xFF, "math", False),
])
def test_an_fp8_move_is_compared_by_its_bytes(dtype: str, got: int, want: int, kind: str,
                                              off: bool) -> None:
    def value(byte: int) -> torch.Tensor:
        raw = torch.tensor([ONE[dtype], byte], dtype=torch.uint8)
        return raw.view(TORCH_DTYPES[dtype]).to(torch.float64)

    stats = OutputStats()
    # a computed fp8 value is compared against its interval (simulate.fp8_bounds): here
    # the reference's own value, so only NaN-for-NaN and the sign of a zero are at stake
    bounds = None if kind == "move" else torch.stack([value(want), value(want)])
    compare("x", kind, dtype, value(got), value(want), stats, "call 0", bounds=bounds)
    assert stats.mismatches == int(off), stats
    if off:
        assert "x[1]" in stats.first_mismatch, stats.first_mismatch


@pytest.mark.parametrize("backend", ["torch", "local"])
def test_fp8_and_scales_move_bit_for_bit(backend: str) -> None:
    """gloo (fp8 as bytes) and the kernels (ranks as threads; typed fp8 loads and
    stores) move every byte drawn, NaNs of both signs included, there and back;
    the host backend runs the file in tests/ops/test_op_schedules.py."""
    report = run_schedule(RunConfig(schedule=str(FILE), world=3, backend=backend, calls=3,
                                    seed=4))
    text = format_report(report)
    assert report.ok and report.mismatches == 0, text
    for name in ("x_recv", "s_recv", "ids_recv", "x_back", "s_back"):
        assert report.outputs[name].compared == 3 * 3, (name, text)


@pytest.mark.parametrize("got", [float("inf"), 1e6, 0.3])
def test_a_value_e4m3_cannot_hold_is_not_taken_for_its_byte(got: float) -> None:
    """Review: the byte comparison alone took inf or 1e6 for 448 (e4m3 saturates) and
    0.3 for the byte it rounds to; the value comparison stays beside it."""
    want = torch.tensor([got], dtype=torch.float64).to(torch.float8_e4m3fn).to(torch.float64)
    stats = OutputStats()
    compare("x", "move", "fp8e4m3", torch.tensor([got], dtype=torch.float64), want, stats,
            "call 0")
    assert stats.mismatches == 1, stats


# ---- fp8 e5m2: moves where e4m3 moves, bit for bit; no op sums or merges it ------------
def test_e5m2_payloads_are_drawn_over_every_byte() -> None:
    """NaN of both signs, +-inf, -0, +-57344 and the subnormals in every row sent; every
    byte, the NaN payloads (0x7D, 0x7E, 0xFD, 0xFE) too: the float64 keeps a NaN's byte."""
    schedule = parse_file(E5M2, 2)
    assert synth.payload_fp8(schedule) & set(synth.engine_inputs(schedule)) == {"x_send"}
    sizes = synth.call_sizes(schedule, 2, synth.constructor_sizes(schedule, 2), 0, 0)
    edges = synth.FP8_EDGES[m.DType.fp8e5m2]
    for rank in synth.call_inputs(schedule, 2, sizes, 0, 0):
        raw = float_bits(rank["x_send"], "fp8e5m2")
        assert_rows_carry_edges(raw, edges)
        drawn = set(raw.flatten().tolist())
        assert drawn == set(range(256)), sorted(set(range(256)) - drawn)


@pytest.mark.parametrize(("dtype", "sent", "got"), [
    ("fp8e5m2", 0x7D, 0x7F), ("fp8e5m2", 0x7F, 0x7E), ("fp8e5m2", 0xFE, 0xFD),
    ("fp8e5m2", 0x7E, 0xFE), ("fp8e4m3", 0x7F, 0xFF)])
def test_a_nan_payload_a_move_changed_mismatches(dtype: str, sent: int, got: int) -> None:
    """Issue 33: torch's float64 -> e5m2 made every NaN of a sign one byte, so a move that
    changed a NaN's payload passed; the reference keeps the byte drawn (the engine gets it,
    the comparison reads the engine's bytes), so one NaN byte flipped in a moved output
    is a located mismatch; the same bytes pass."""
    drawn = synth.full_range_fp8((2, 16), torch.Generator().manual_seed(1),
                                 m.DType(dtype))
    raw = float_bits(drawn, dtype)
    raw[1, 5] = sent
    want = float_value(raw, dtype)  # the reference: the source's bytes, moved
    out = raw.clone()
    stats = OutputStats()
    compare("x", "move", dtype, out.view(TORCH_DTYPES[dtype]), want, stats, "call 0")
    assert stats.mismatches == 0, stats
    out[1, 5] = got
    compare("x", "move", dtype, out.view(TORCH_DTYPES[dtype]), want, stats, "call 0")
    assert stats.mismatches == 1 and "x[1, 5] = nan" in stats.first_mismatch, stats


@pytest.mark.parametrize("backend", ["torch", "local"])
def test_e5m2_moves_bit_for_bit(backend: str) -> None:
    """gloo (fp8 as bytes) and the kernels (typed fp8e5 loads and stores) move every e5m2
    byte drawn there and back; the host backend runs the file in test_op_schedules.py."""
    report = run_schedule(RunConfig(schedule=str(E5M2), world=3, backend=backend, calls=3,
                                    seed=4))
    text = format_report(report)
    assert report.ok and report.mismatches == 0, text
    for name in ("x_recv", "x_back"):
        assert report.outputs[name].compared == 3 * 3, (name, text)


@pytest.mark.parametrize(("old", "new", "code", "needle", "words"), [
    # a sum of e5m2 rows: refused where the step names it (a sum INTO e5m2 is not)
    ("  - release:  {op: barrier}",
     "  - total:    {op: all_reduce, src: x_send, dst: x_sum}\n  - release:  {op: barrier}",
     "non-float-output", "x_send, dst: x_sum", "never read by a sum"),
    # a sum into e5m2 goes through output_scale, as into e4m3
    ("  - release:  {op: barrier}",
     "  - total:    {op: all_reduce, src: s_send, dst: x_sum}\n  - release:  {op: barrier}",
     "missing-output-scale", "x_sum}", "writes fp8 output 'x_sum' without a scale"),
    # a cast from e5m2 to e5m2: a cast is between bf16/f16/f32 and an fp8
    ("capacity: C}\n  - use:", "capacity: C, scale: {per: token, buffer: s_tok}}\n  - use:",
     "bad-cast", "{per: token, buffer: s_tok}", "casts fp8e5m2 'x_send' into fp8e5m2"),
])
def test_no_op_sums_e5m2(tmp_path: Path, old: str, new: str, code: str,
                                needle: str, words: str) -> None:
    text = E5M2.read_text()
    assert old in text, old
    text = text.replace(old, new).replace(
        "  n_back:", "  x_sum:    {shape: [W, C, H], dtype: fp8e5m2}\n"
        "  s_tok:    {shape: [W, C], dtype: f32, symmetric: true}\n  n_back:")
    found = errors(write(tmp_path, text, "e5m2.yaml"))
    line, col = _at(text, needle)
    hits = [f for f in found if f[:3] == (code, line, col)]
    assert hits and words in hits[0][3], found
