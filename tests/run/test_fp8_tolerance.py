"""A computed fp8 output is compared within one grid step plus its fp32 error over the
scale, one rule for e4m3 and e5m2 (worker.fp8_tolerance, from numerics.FP8_FORMATS).

Before: e5m2 had no tolerance (bit exact against float64), so lse_combine_fp8e5m2 at
W = 4 (8 calls, seed 0, T=24, B=5, interleaved) failed on the GPU and on the CPU alike
at call 6 rank 2, out[17, 0, 9]: its partials 0.1006 + 0.4618 - 0.5624 cancel to
4.44e-8 in float64 and to 5.96e-8 (one ulp of 0.5) in fp32, which over the scale
1.164e-4 is 1.56 * 2**-12 -> 1.5 * 2**-12 against 2.10 * 2**-12 -> 2**-11: two e5m2
steps apart, though the kernel computed exactly what fp32 gives.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dcpc.harness import simulate
from dcpc.harness.run import RunConfig, format_report, run_schedule
from dcpc.harness.worker import OutputStats, compare, fp8_tolerance
from dcpc.numerics import FP8_FORMATS, round_fp8

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


def test_a_merge_cancelling_in_fp32_is_within_tolerance() -> None:
    """The recorded element: the reference rounds to 1.5 * 2**-12, fp32 to 2**-11; both
    are right to fp32's precision, so compare passes it (before: 1 mismatch)."""
    weights, _ = simulate.merge_weights(torch.tensor(LSE, dtype=torch.float64)[:, None], "e")
    parts = torch.tensor(PARTS, dtype=torch.float64)[:, None, None]
    exact = float(simulate._weighted_sum(weights, parts))
    assert exact == pytest.approx(4.4378e-8, rel=1e-4)
    want = round_fp8(torch.tensor([exact / SCALE], dtype=torch.float64), "fp8e5m2").double()
    got = round_fp8(torch.tensor([_fp32_merge(PARTS, LSE, SCALE)]), "fp8e5m2").double()
    assert float(want) == 1.5 * 2**-12 and float(got) == 2**-11
    stats = OutputStats()
    compare("out", "math", "fp8e5m2", got, want, stats, "call 6")
    assert stats.mismatches == 0, stats.first_mismatch


@pytest.mark.parametrize("dtype", sorted(FP8_FORMATS))
def test_one_grid_step_passes_two_fail_nan_never(dtype: str) -> None:
    """Away from zero (where atol is small beside the grid) a result one step from the
    reference passes and two steps fail; a NaN passes only against a NaN."""
    top, mantissa, _ = FP8_FORMATS[dtype]
    atol, rtol = fp8_tolerance(dtype)
    assert rtol == 2.0**-mantissa
    for value in (top / 64, -top / 8, top / 2):
        assert atol < abs(value) * rtol / 8
        step = 2.0 ** (math.floor(math.log2(abs(value))) - mantissa)
        want = torch.tensor([value], dtype=torch.float64)
        for steps, bad in ((1, 0), (2, 1), (-2, 1)):
            got = want + steps * step
            stats = OutputStats()
            compare("out", "math", dtype, got, want, stats, "here")
            assert stats.mismatches == bad, (value, steps, stats.first_mismatch)
    for got, want in ((math.nan, 0.0), (0.0, math.nan), (math.nan, math.nan)):
        stats = OutputStats()
        compare("out", "math", dtype, torch.tensor([got], dtype=torch.float64),
                torch.tensor([want], dtype=torch.float64), stats, "here")
        assert stats.mismatches == (0 if math.isnan(got) and math.isnan(want) else 1)


def test_the_tolerance_is_each_formats_own() -> None:
    """One rule, two formats: e5m2's scales are 128 times smaller (its top 57344 against
    448), so its fp32 error over the scale is 128 times larger; its rtol is twice e4m3's
    (2 mantissa bits against 3)."""
    (a4, r4), (a5, r5) = fp8_tolerance("fp8e4m3"), fp8_tolerance("fp8e5m2")
    assert r5 == 2 * r4
    assert (a5 - 2.0**-16) == pytest.approx((a4 - 2.0**-9) * 57344 / 448)


@pytest.mark.e2e
def test_lse_combine_e5m2_at_w4_runs_clean() -> None:
    """The run the GPU failed, on the CPU (ranks as threads): the same element off by
    two steps before the rule, within it now; every other element still compared."""
    report = run_schedule(RunConfig(
        schedule=str(OPS / "lse_combine_fp8e5m2.yaml"), world=4, backend="local", calls=8,
        seed=0, order="interleaved", sizes={"T": 24, "B": 5}))
    text = format_report(report)
    assert report.ok and report.mismatches == 0, text
    assert report.outputs["out"].compared == 32, text
    assert report.outputs["out"].max_abs_err == pytest.approx(2.0**-11 - 1.5 * 2**-12), text


def test_a_wrong_e5m2_merge_still_mismatches() -> None:
    """The tolerance does not hide a wrong weight: the same partials merged with the
    weights of partials 0 and 1 swapped land far outside it."""
    weights, _ = simulate.merge_weights(torch.tensor(LSE, dtype=torch.float64)[:, None], "e")
    parts = torch.tensor(PARTS, dtype=torch.float64)[:, None, None]
    good = simulate._weighted_sum(weights, parts) / SCALE
    bad = simulate._weighted_sum(weights[[1, 0, 2]], parts) / SCALE
    want = round_fp8(good.reshape(1), "fp8e5m2").double()
    got = round_fp8(bad.reshape(1), "fp8e5m2").double()
    stats = OutputStats()
    compare("out", "math", "fp8e5m2", got, want, stats, "here")
    assert stats.mismatches == 1, (float(got), float(want))

