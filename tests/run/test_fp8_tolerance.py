"""A computed fp8 output (output_scale) is compared against an interval: the float64
reference knows the unrounded value v and the call's scale s, and an fp32 error bound e
of v (simulate.fp32_error: (terms + FP32_EXTRA_TERMS) * 2**-24 * the terms' magnitude;
a merge's, simulate.merge_error, adds its weights' exp error per partial), so the
kernel's byte must lie in [quantize(v - e), quantize(v + e)] (simulate.fp8_bounds,
carried in the trace: bounds_at; worker.compare). No rtol/atol: a value far from a
rounding boundary must be the very byte the kernels' rule gives. A move carries the
interval with the value (simulate._moving); a computed fp8 value with none is a loud
``worker.NoInterval``, never an exact comparison.

Not caught by runs: a quantiser rounding ties to even instead of away from zero where
e > 0 (every merge and sum): a tie lies within e of v only, so both bytes are in the
interval; tests/ops/test_fp8_results.py's exact-byte tests catch it (the kernels' own
fp32 values, quantised). Runs catch it only where the value is exact (e = 0, a max).

Before: a fixed (atol, rtol) of one grid step (e5m2: (2.6, 1/4)), which a truncating
quantiser passed. Why not exact: lse_combine_fp8e5m2 at W = 4 (8 calls, seed 0, T=24,
B=5, interleaved) at call 6 rank 2, out[17, 0, 9]: its partials 0.1006 + 0.4618 -
0.5624 cancel to 4.44e-8 in float64 and to 5.96e-8 (one ulp of 0.5) in fp32, which over
the scale 1.164e-4 is 1.56 * 2**-12 -> 1.5 * 2**-12 against 2.10 * 2**-12 -> 2**-11:
two e5m2 steps apart, though the kernel computed exactly what fp32 gives.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import NoInterval, OutputStats, compare
from dcpc.numerics import FP8_FORMATS, quantize_fp8, round_fp8

OPS = Path(__file__).resolve().parents[2] / "schedules" / "ops"

# call 6, rank 2, out[17, 0, 9] of the run above: partials 0..2 (3 is masked)
PARTS = [0.427734375, 1.2734375, -1.3984375]
LSE = [-0.7846144437789917, -0.3514848053455353, -0.24806101620197296]
SCALE = 0.00011641374294413254


def _fp32_merge(o: list[float], lse: list[float], scale: float) -> float:
    """The kernels' merge (_dcpc_merged_lse, _dcpc_weight, _dcpc_merge_cols) in fp32:
    exp(lse_p - max) / total, summed in partial order, times 1 / scale."""
    f = torch.float32
    lse_t, o_t = torch.tensor(lse, dtype=f), torch.tensor(o, dtype=f)
    e = torch.exp(lse_t - lse_t.max())
    total = torch.zeros((), dtype=f)
    for x in e:
        total = total + x
    inv_total = torch.tensor(1.0, dtype=f) / total
    acc = torch.zeros((), dtype=f)
    for p in range(len(o)):
        acc = acc + (e[p] * inv_total) * o_t[p]
    return float(acc * (torch.tensor(1.0, dtype=f) / torch.tensor(scale, dtype=f)))


def _merge_bounds(weights: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """The interval the merge's reference records (dcpc.ops._merge.combine)."""
    v = simulate._weighted_sum(weights, parts)
    err = simulate.merge_error(weights, parts)
    return simulate.fp8_bounds(v, err, torch.tensor(SCALE, dtype=torch.float32), "fp8e5m2")


def _check(dtype: str, got: torch.Tensor, want: torch.Tensor,
           bounds: torch.Tensor | None) -> OutputStats:
    stats = OutputStats()
    compare("out", "math", dtype, got, want, stats, "here", bounds=bounds)
    return stats


def test_a_merge_cancelling_in_fp32_is_within_its_interval() -> None:
    """The recorded element: the reference rounds to 1.5 * 2**-12, fp32 to 2**-11; both
    lie in the interval the fp32 error bound gives, so compare passes it; without an
    interval compare refuses to judge it (NoInterval): exactly, it is the mismatch it was."""
    weights, _ = simulate.merge_weights(torch.tensor(LSE, dtype=torch.float64)[:, None], "e")
    parts = torch.tensor(PARTS, dtype=torch.float64)[:, None, None]
    exact = float(simulate._weighted_sum(weights, parts))
    assert exact == pytest.approx(4.4378e-8, rel=1e-4)
    want = round_fp8(torch.tensor([exact / SCALE], dtype=torch.float64), "fp8e5m2").double()
    got = round_fp8(torch.tensor([_fp32_merge(PARTS, LSE, SCALE)]), "fp8e5m2").double()
    assert float(want) == 1.5 * 2**-12 and float(got) == 2**-11
    bounds = _merge_bounds(weights, parts).reshape(2, 1)
    assert float(bounds[0]) <= float(want) <= float(bounds[1])
    assert _check("fp8e5m2", got, want, bounds).mismatches == 0
    assert float(got) != float(want)  # no fp8 rtol/atol left, and no exact comparison:
    with pytest.raises(NoInterval, match="'out' \\(fp8e5m2\\) holds a computed fp8 value"):
        _check("fp8e5m2", got, want, None)


# an e4m3 tie at scale 1: 8.5 rounds to 9 (away from zero), below it to 8
TIE = 8.5


@pytest.mark.parametrize("rule", ["sum", "merge"])
def test_the_bound_is_tight_64_ulps_off_fails_4_passes(rule: str) -> None:
    """The error bound's size is pinned: v lies 30 * 2**-24 * M below a tie (M the
    terms' magnitude), beyond the bound of a 4-term sum (20 * 2**-24 * M) and of a
    2-partial merge of equal LSEs (18 * 2**-24 * M); a kernel value 4 * 2**-24 * M
    off v rounds as v does and passes, one 64 * 2**-24 * M off crosses the tie and
    fails (with FP32_EXTRA_TERMS 200 it would pass)."""
    u, one = 2.0**-24, torch.tensor(1.0, dtype=torch.float32)
    if rule == "sum":
        x = torch.tensor([[TIE * 0.4], [TIE * 0.3], [TIE * 0.2], [TIE * 0.1]],
                         dtype=torch.float64)
        size = float(x.abs().sum())
        err = simulate.fp32_error(len(x), x.abs().sum(dim=0))
    else:
        weights = simulate.merge_weights(torch.zeros(2, 1, dtype=torch.float64), "e")[0]
        parts = torch.full((2, 1, 1), TIE, dtype=torch.float64)
        size = TIE
        err = simulate.merge_error(weights, parts).reshape(1)
    assert float(err) < 21 * u * size
    v = torch.tensor([TIE - 30 * u * size], dtype=torch.float64)
    bounds = simulate.fp8_bounds(v, err, one, "fp8e4m3")
    want = quantize_fp8(v, one, "fp8e4m3").double()
    assert float(want) == 8.0 and float(bounds[0]) == float(bounds[1]) == 8.0
    for off, bad in ((4, 0), (-4, 0), (64, 1)):
        got = quantize_fp8(v + off * u * size, one, "fp8e4m3").double()
        assert _check("fp8e4m3", got, want, bounds).mismatches == bad, off


def _truncate(x: torch.Tensor, scale: torch.Tensor, dtype: str) -> torch.Tensor:
    """A wrong quantiser: fl32(x) * fl32(1 / scale) rounded toward zero on the fp8 grid."""
    top, mantissa, min_exp = FP8_FORMATS[dtype]
    y = (x.float() * (1.0 / scale.float())).clamp(-top, top)
    exponent = (y.view(torch.int32) >> 23) & 0xFF
    ulp = (torch.clamp(exponent - mantissa, min=127 + min_exp - mantissa) << 23
           ).view(torch.float32)
    return (torch.trunc(y / ulp) * ulp).double()


def _drawn(dtype: str, n: int = 4000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merged values v as the harness draws them (|v| < 1, over many magnitudes), a
    scale putting the largest near the format's top, and the interval of a 4-partial
    merge of magnitude |v| + 1 (the partials' sizes)."""
    g = torch.Generator().manual_seed(7)
    v = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * 2.0 ** -(
        torch.randint(0, 12, (n,), generator=g).double())
    scale = torch.tensor(1.0 / (FP8_FORMATS[dtype][0] / 2), dtype=torch.float32)
    bounds = simulate.fp8_bounds(v, simulate.fp32_error(4, v.abs() + 1.0), scale, dtype)
    return v, scale, bounds


@pytest.mark.parametrize("dtype", sorted(FP8_FORMATS))
def test_the_kernels_rule_passes_a_truncating_one_does_not(dtype: str) -> None:
    """The kernels' rule applied to the fp32 value (within 2**-24 of v) passes every
    element; rounding toward zero instead is caught (before: the one-step rtol passed
    it: 0 mismatches where the exact comparison found 1136)."""
    v, scale, bounds = _drawn(dtype)
    want = quantize_fp8(v, scale, dtype).double()
    fp32 = v.float().double()
    assert _check(dtype, quantize_fp8(fp32, scale, dtype).double(), want, bounds
                  ).mismatches == 0
    stats = _check(dtype, _truncate(fp32, scale, dtype), want, bounds)
    assert stats.mismatches == 1 and stats.first_mismatch  # counted once per compare
    wrong = _truncate(fp32, scale, dtype)
    outside = (wrong < bounds[0]) | (wrong > bounds[1])
    assert int(outside.sum()) > len(v) // 10, int(outside.sum())


@pytest.mark.parametrize("dtype", sorted(FP8_FORMATS))
def test_ties_to_even_is_caught_where_the_value_is_exact(dtype: str) -> None:
    """Where the kernel computes v exactly (e = 0: a max), the interval is one byte,
    so a quantiser rounding ties to even (torch's, Transformer Engine's fp8 casts) is
    caught at a tie: e4m3 8.5 is 9 by the kernels' rule, 8 by ties to even."""
    _, mantissa, _ = FP8_FORMATS[dtype]
    tie = torch.tensor([8.0 + 2.0 ** (3 - mantissa) / 2], dtype=torch.float64)
    one = torch.tensor(1.0, dtype=torch.float32)
    bounds = simulate.fp8_bounds(tie, simulate.fp32_error(0, 0.0), one, dtype)
    want = quantize_fp8(tie, one, dtype).double()
    even = torch.tensor([8.0], dtype=torch.float64)
    assert float(want) == 8.0 + 2.0 ** (3 - mantissa)
    assert _check(dtype, want, want, bounds).mismatches == 0
    assert _check(dtype, even, want, bounds).mismatches == 1


@pytest.mark.parametrize("dtype", sorted(FP8_FORMATS))
def test_one_step_off_far_from_a_boundary_fails_nan_never_passes(dtype: str) -> None:
    """A value in the middle of a grid cell (its interval one byte wide) one step
    off mismatches, at several magnitudes; a NaN passes only against a NaN."""
    top, mantissa, _ = FP8_FORMATS[dtype]
    one = torch.tensor(1.0, dtype=torch.float32)
    for value in (top / 64, -top / 8, top / 2, 2.0**-3):
        step = 2.0 ** (math.floor(math.log2(abs(value))) - mantissa)
        v = torch.tensor([value + step / 4], dtype=torch.float64)  # a quarter step in
        bounds = simulate.fp8_bounds(v, simulate.fp32_error(8, v.abs() * 8), one, dtype)
        want = quantize_fp8(v, one, dtype).double()
        assert float(bounds[0]) == float(bounds[1]) == value
        for steps, bad in ((0, 0), (1, 1), (-1, 1)):
            stats = _check(dtype, want + steps * step, want, bounds)
            assert stats.mismatches == bad, (value, steps, stats.first_mismatch)
    nan = torch.tensor([math.nan], dtype=torch.float64)
    zero = torch.tensor([0.0], dtype=torch.float64)
    wide = simulate.fp8_bounds(zero, torch.tensor([math.inf]), one, dtype)
    assert _check(dtype, nan, zero, wide).mismatches == 1
    nan_bounds = simulate.fp8_bounds(nan, simulate.fp32_error(4, 1.0), one, dtype)
    assert torch.isnan(nan_bounds).all()
    assert _check(dtype, zero, nan, nan_bounds).mismatches == 1
    assert _check(dtype, nan, nan, nan_bounds).mismatches == 0


@pytest.mark.e2e
def test_lse_combine_e5m2_at_w4_runs_clean() -> None:
    """The run the GPU failed, on the CPU (ranks as threads): the same element off by
    two steps before the interval, within it now; every other element still compared."""
    report = run_schedule(RunConfig(
        schedule=str(OPS / "lse_combine_fp8e5m2.yaml"), world=4, backend="local", calls=8,
        seed=0, order="interleaved", sizes={"T": 24, "B": 5}))
    text = format_report(report)
    assert report.ok and report.mismatches == 0, text
    assert report.outputs["out"].compared == 32, text
    assert report.outputs["out"].max_abs_err == pytest.approx(2.0**-11 - 1.5 * 2**-12), text


def test_a_wrong_e5m2_merge_still_mismatches() -> None:
    """The interval does not hide a wrong weight: the same partials merged with the
    weights of partials 0 and 1 swapped land far outside it."""
    weights, _ = simulate.merge_weights(torch.tensor(LSE, dtype=torch.float64)[:, None], "e")
    parts = torch.tensor(PARTS, dtype=torch.float64)[:, None, None]
    good = simulate._weighted_sum(weights, parts) / SCALE
    bad = simulate._weighted_sum(weights[[1, 0, 2]], parts) / SCALE
    want = round_fp8(good.reshape(1), "fp8e5m2").double()
    got = round_fp8(bad.reshape(1), "fp8e5m2").double()
    stats = _check("fp8e5m2", got, want, _merge_bounds(weights, parts).reshape(2, 1))
    assert stats.mismatches == 1, (float(got), float(want))


# the W = 4 record's schedule with its merged fp8 output moved on by a copy
COPY = (OPS / "lse_combine_fp8e5m2.yaml").read_text().replace(
    "schedule: op_lse_combine_fp8e5m2", "schedule: op_lse_combine_fp8e5m2_copy").replace(
    "  out:      {shape: [T, Hl, Dv],     dtype: fp8e5m2}",
    "  out:      {shape: [T, Hl, Dv],     dtype: fp8e5m2}\n"
    "  out2:     {shape: [T, Hl, Dv],     dtype: fp8e5m2}").replace(
    "  - release:", "  - keep:      {op: copy, src: out, dst: out2}\n  - release:")
KEEP = ("        if _step in self._on_torch:  # the torch backend, or this step's axes"
        " are on torch\n"
        '            self._view("out2", slot, _env).copy_(self._view("out", slot, _env))\n')
BUMP = ("        if True:\n"
        '            _o2 = self._view("out2", slot, _env)\n'
        '            _o2.copy_(self._view("out", slot, _env))\n'
        "            _o2.view(torch.uint8).view(-1)[0] += 1  # one grid step up\n")


@pytest.mark.e2e
@pytest.mark.parametrize("bump", [False, True])
def test_a_moved_fp8_result_is_compared_against_its_interval(tmp_path: Path, bump: bool
                                                             ) -> None:
    """A copy of the merge's fp8 output carries its interval (simulate._moving): at the
    W = 4 record out2 holds the byte 2**-11 where the reference rounds to 1.5 * 2**-12,
    as out does, and passes (before: 1 mismatch, the copy compared bit for bit); a copy
    that moves its first byte one step up is still caught."""
    path = tmp_path / "copy.yaml"
    path.write_text(COPY)
    report = run_schedule(RunConfig(
        schedule=str(path), world=4, backend="local", calls=8, seed=0, order="interleaved",
        sizes={"T": 24, "B": 5}, module_patch=((KEEP, BUMP),) if bump else ()))
    text = format_report(report)
    assert report.outputs["out"].mismatches == 0, text
    assert report.outputs["out2"].compared == 32, text
    if not bump:
        assert report.ok and report.mismatches == 0, text
        assert report.outputs["out2"].max_abs_err == pytest.approx(2.0**-11 - 1.5 * 2**-12)
        return
    assert not report.ok and report.outputs["out2"].mismatches >= 1, text
    assert "(keep): out2[0, 0, 0]" in report.outputs["out2"].first_mismatch, text


CAST_OF_A_SUM = """\
schedule: cast_of_a_sum
slots: 2
sizes:
  C: 4
  H: 16
buffers:
  x:      {shape: [W*C, H],  dtype: f32}
  y:      {shape: [W*C, H],  dtype: f32}
  s_in:   {shape: [1],       dtype: f32}
  q:      {shape: [W, C, H], dtype: fp8e4m3, symmetric: true}
steps:
  - total: {op: all_reduce, src: x, dst: y}
  - quant: {op: all_to_all, src: y, dst: q, scale: {per: tensor, buffer: s_in}}
  - release: {op: barrier}
"""


@pytest.mark.e2e
def test_a_computed_fp8_value_without_an_interval_is_loud(tmp_path: Path) -> None:
    """A cast of a computed f32 (an all_reduce's sum) into fp8: the kernel's f32 sum may
    differ from float64's by an ulp, which can move the byte, and no interval is kept
    for it: the run fails naming the buffer (NoInterval), not an exact comparison."""
    path = tmp_path / "cast.yaml"
    path.write_text(CAST_OF_A_SUM)
    report = run_schedule(RunConfig(schedule=str(path), world=2, backend="local", calls=1))
    text = format_report(report)
    assert not report.ok, text
    assert "(quant): 'q' (fp8e4m3) holds a computed fp8 value that dcpc run keeps" in text



# the merge step of the generated module: run through the torch path (the same bits as
# the kernel: merge.quantize, numerics.quantize_fp8), or with a truncating quantiser
MERGE = ("        if _step in self._on_torch:  # the torch backend, or this step's axes"
         " are on torch\n            _rt.collectives.lse_combine(\n")
TORCH_PATH = "        if True:\n            _rt.collectives.lse_combine(\n"
TRUNCATING = (
    "        if True:\n"
    "            def _q(x, s, dtype, _m=_rt.collectives.merge):\n"
    "                top, man, low = _m.FP8_FORMATS[_m.fp8_format(dtype)]\n"
    "                y = (x.float() * (1.0 / s.reshape(-1)[0].float())).clamp(-top, top)\n"
    "                e = (y.view(torch.int32) >> 23) & 0xFF\n"
    "                u = (torch.clamp(e - man, min=127 + low - man) << 23).view(torch.float32)\n"
    "                return (torch.trunc(y / u) * u).to(dtype)\n"
    "            _rt.collectives.merge.quantize = _q\n"
    "            _rt.collectives.lse_combine(\n")


@pytest.mark.e2e
@pytest.mark.parametrize("file", ["lse_combine_fp8.yaml", "lse_combine_fp8e5m2.yaml"])
@pytest.mark.parametrize("truncating", [False, True])
def test_a_truncating_merge_mismatches_in_a_run(file: str, truncating: bool) -> None:
    """A module whose merge rounds its fp8 output toward zero (W = 2, 3 calls, seed 0)
    is caught in e4m3 and e5m2 (before: 0 mismatches in both, the one-step rtol passed
    it; now about 400 elements off); the same module with the kernels' rule is clean."""
    report = run_schedule(RunConfig(
        schedule=str(OPS / file), world=2, backend="local", calls=3, seed=0,
        module_patch=((MERGE, TRUNCATING if truncating else TORCH_PATH),)))
    text = format_report(report)
    if not truncating:
        assert report.ok and report.mismatches == 0, text
        return
    stats = report.outputs["out"]
    assert not report.ok and stats.mismatches >= 1, text
    assert "(merge): out[" in stats.first_mismatch, text


def test_a_buffer_used_whole_and_by_slice_shares_its_interval() -> None:
    """The interval of a value stored whole carries into its slices' views, and a slice
    stored with one into the whole's part (Sim.store, as alias_views does the values):
    owner_index's o_parts (2 slots at W = 2), with exact bf16 values and bounds."""
    from dcpc.lang.parse import parse_file

    schedule = parse_file(OPS / "owner_index.yaml", world=2)
    shape = (2, 24, 3, 40)
    sizes = {"T": 24, "B": 5, "Hl": 3, "D": 40, "W": 2}
    sim = simulate.Sim(schedule, 2, sizes, [{}, {}], lambda *_: {})
    value = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) % 64
    bounds = torch.stack([value - 1, value + 1])
    sim.store(0, "o_parts", value, bounds=bounds)
    for k in (0, 1):
        assert torch.equal(sim.bounds[0][f"o_parts_{k}"], bounds[:, k])
        assert torch.equal(simulate.bounds_at([sim.written], 1, 0, f"o_parts_{k}"), bounds[:, k])
    part = torch.full(shape[1:], 2.0, dtype=torch.float64)
    sim.store(0, "o_parts_1", part)  # no interval: the whole's part 1 is the value itself
    whole = sim.bounds[0]["o_parts"]
    assert torch.equal(whole[:, 0], bounds[:, 0]) and (whole[:, 1] == 2.0).all()
    assert "o_parts_1" not in sim.bounds[0] and not sim.bounds[1]
