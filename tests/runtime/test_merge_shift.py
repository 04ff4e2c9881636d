"""The LSE merge is invariant to a common shift of every partial's LSE (issue 22, item
7): merge(lse + s) = (merge(lse).out, merge(lse).lse + s). The kernels (Triton
interpreter) and the torch backend's fp32 math must keep that at |s| up to 1e7.

What float32 can reach at shift s (ulp(s): 2^-10 at 1e3, 2^-4 at 1e6, 1 at 1e7):
- the stored inputs lse_p + s hold the differences lse_p - lse_q only to ulp(s), so the
  test compares with the float64 merge of the inputs *as stored* (and, for the
  invariance check, picks lse_p whose differences are whole numbers, exact in fp32 at
  every shift here);
- the weights exp(lse_p - m) / sum_q exp(lse_q - m), m = max_q lse_q, are then exact
  up to fp32 rounding of exp and the sum: the output matches the reference to 1e-5
  (relative and absolute) at every shift;
- the merged LSE m + log(sum) is a float32 near s: it cannot be closer than half an
  ulp of itself, so it is asserted within ulp(LSE) + 1e-5 of the reference.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.kernels import compile_text, load, merge_schedule
from test_kernels import WORLD, G, T, make_inputs, run_merge

from dcpc.runtime import merge

SHIFTS = [0.0, 1e3, -1e3, 1e6, -1e6, 1e7, -1e7]
OUT_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # The interpreter runs log(0) in numpy for all -inf rows; the kernels mask those.
    warnings.filterwarnings("ignore", category=RuntimeWarning)


def ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float32 at |x| (inf where x is infinite)."""
    a = x.abs().float()
    return (torch.nextafter(a, torch.tensor(float("inf"))) - a).double()


def shifted_inputs(shift: float, mask: bool, whole: bool) -> dict[str, torch.Tensor]:
    """make_inputs' f32 data (NaN/inf LSE, all -inf rows, garbage in masked partials)
    with every LSE moved by ``shift``; ``whole``: finite LSE differences are integers."""
    x = make_inputs(torch.float32, 40, seed=5, mask=mask)
    lse = x["lse"].double()
    if whole:
        lse = torch.where(torch.isfinite(lse), lse.round(), lse)
    x["lse"] = (lse + shift).float()  # as stored: fp32 (NaN, +-inf unchanged)
    return x


def assert_lse_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(got).any(), "NaN in the merged LSE"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf rows differ"
    err = (got.double() - want)[finite].abs()
    bound = (ulp(want) + 1e-5)[finite]
    assert (err <= bound).all(), f"LSE off by {err.max():.3g} (bound {bound.max():.3g})"


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("kernel", ["_merge_kernel", "_correct_kernel"])
def test_kernels_keep_shift_invariance(tmp_path, base, kernel):
    mod = load(compile_text(merge_schedule("f32", base, True, True, 1), tmp_path))
    masked = None
    own_ranks = [None] if kernel == "_merge_kernel" else [0, 3]
    base_out: dict = {}
    for shift in SHIFTS:
        x = shifted_inputs(shift, mask=True, whole=True)
        masked = merge.empty_mask(x["seq_lens"], x["qsl"], T, WORLD, 1)
        for own in own_ranks:
            dst, dst_lse = run_merge(
                mod, x, torch.float32, base=base, return_lse=True, mask=True,
                interleave=1, kernel=kernel, own=own,
            )
            o64, lse64 = x["o"].double(), x["lse"].double()
            if own is None:
                ref, ref_lse = merge.lse_combine(o64, lse64, base, masked, torch.float64)
            else:
                ref, ref_lse = merge.lse_correct(o64[own], lse64, own, base, masked, torch.float64)
            assert not torch.isnan(dst).any(), f"shift {shift}: NaN in the output"
            torch.testing.assert_close(
                dst.double(), ref, **OUT_TOL, msg=lambda m, s=shift: f"shift {s}: {m}"
            )
            assert_lse_close(dst_lse, ref_lse)
            # invariance: the output at every shift is the output at shift 0
            base_out.setdefault(own, dst)
            torch.testing.assert_close(dst, base_out[own], **OUT_TOL)
            assert (dst[2] == 0).all() and (dst[5:] == 0).all(), "empty/padding rows are 0"
            assert torch.isneginf(dst_lse[4, 2]) and torch.isneginf(dst_lse[5:]).all()


@pytest.mark.parametrize("base", ["e", "2"])
def test_kernels_match_float64_at_shift_with_fractional_lse(tmp_path, base):
    """Fractional LSEs: fp32 rounds the stored inputs at large shifts; the merge of what
    is stored is still reached to 1e-5 (output) and one ulp (LSE)."""
    mod = load(compile_text(merge_schedule("f32", base, True, True, 1), tmp_path))
    for shift in SHIFTS:
        check_fractional(mod, base, shift)


def check_fractional(mod, base: str, shift: float) -> None:
    x = shifted_inputs(shift, mask=True, whole=False)
    masked = merge.empty_mask(x["seq_lens"], x["qsl"], T, WORLD, 1)
    dst, dst_lse = run_merge(
        mod, x, torch.float32, base=base, return_lse=True, mask=True, interleave=1,
        kernel="_merge_kernel", fast=True,
    )
    ref, ref_lse = merge.lse_combine(x["o"].double(), x["lse"].double(), base, masked,
                                     torch.float64)
    assert not torch.isnan(dst).any()
    torch.testing.assert_close(dst.double(), ref, **OUT_TOL)
    assert_lse_close(dst_lse, ref_lse)


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("shift", SHIFTS)
def test_torch_backend_fp32_merge_keeps_shift_invariance(base, shift):
    """dcpc.runtime.merge in fp32 (the torch backend's math) against float64."""
    x = shifted_inputs(shift, mask=True, whole=False)
    masked = merge.empty_mask(x["seq_lens"], x["qsl"], T, WORLD, 1)
    o64, lse64 = x["o"].double(), x["lse"].double()
    out, total = merge.lse_combine(x["o"], x["lse"], base, masked)
    ref, ref_lse = merge.lse_combine(o64, lse64, base, masked, torch.float64)
    assert out.dtype == torch.float32 and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, **OUT_TOL)
    assert_lse_close(total, ref_lse)
    for own in (0, 3):
        out, total = merge.lse_correct(x["o"][own], x["lse"], own, base, masked)
        ref, ref_lse = merge.lse_correct(o64[own], lse64, own, base, masked, torch.float64)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out.double(), ref, **OUT_TOL)
        assert_lse_close(total, ref_lse)
    assert out.shape == (T, G, 40)
