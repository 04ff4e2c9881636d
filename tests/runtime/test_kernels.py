"""The generated Triton kernels of the local ops, on CPU under the Triton interpreter,
against the float64 reference (dcpc.runtime.merge, itself checked against a naive loop
in test_runtime.py). W = 4 partials; every edge case of domain.md is in the data."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support.kernels import compile_text, load, merge_schedule

from dcpc.runtime import merge

WORLD, T, G = 4, 7, 3
TOL = {
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}
DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # The interpreter runs log(0) and inf - inf in numpy; the kernels mask those.
    warnings.filterwarnings("ignore", category=RuntimeWarning)


def make_inputs(
    dtype: torch.dtype, dv: int, seed: int = 0, mask: bool = True
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    o = (torch.randn(WORLD, T, G, dv, generator=g) * 2).to(dtype)
    lse = torch.randn(WORLD, T, G, generator=g) * 3
    # requests: tokens 0-1 -> seq 2 (ranks 2, 3 empty with I=1), token 2 -> seq 0 (all
    # empty), tokens 3-4 -> seq 9; tokens 5-6 are CUDA-graph padding.
    seq_lens = torch.tensor([2, 0, 9], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    lse[0, 3, 0] = float("nan")  # NaN -> -inf
    lse[1, 3, 1] = float("inf")  # +inf -> -inf
    lse[:, 4, 2] = float("-inf")  # every partial -inf: out 0, LSE -inf
    lse[2, 4, 0] = float("-inf")  # zero weight with garbage output
    o[2, 4, 0] = float("nan")
    o[0, 3, 0] = float("inf")
    if mask:
        o[2:, 0:2] = float("nan")  # empty shards may leave garbage
        o[:, 2] = float("inf")
        o[:, 5:] = float("nan")  # padding rows
    return dict(o=o, lse=lse, seq_lens=seq_lens, qsl=qsl)


def run_merge(mod, x, dtype, *, base, return_lse, mask, interleave, kernel, own=None, fast=False):
    """``fast``: the request lookup as one vector (BLOCK_B) and an unrolled column loop
    (ROW_LEN), as modules with few requests and a fixed row length launch it; else the
    binary search and the run-time column loop."""
    dv = x["o"].shape[-1]
    dst = torch.full((T, G, dv), float("nan"), dtype=dtype)  # poison: unwritten fails
    dst_lse = torch.full((T, G), float("nan"), dtype=torch.float32)
    block_n, block_d = 4, 16
    o = x["o"] if own is None else x["o"][own]
    args = [o, x["lse"], dst, dst_lse, x["seq_lens"], x["qsl"], x["lse"]]  # no out_scale
    args.append(torch.zeros(8, dtype=torch.int32))  # the error record (no scale: unused)
    if own is not None:
        args += list(o.stride())  # this rank's partial [T, G, dv]: (outer, mid, inner)
    args += [T * G, dv, G, x["seq_lens"].shape[0]]
    extra = {} if own is None else {"RANK": own}
    getattr(mod, kernel)[(math.ceil(T * G / block_n),)](
        *args,
        WORLD=WORLD,
        INTERLEAVE=interleave,
        MASK=mask,
        BASE2=base == "2",
        RETURN_LSE=return_lse,
        SCALE=False,
        STEP=0,
        SEARCH_STEPS=3,
        BLOCK_B=8 if fast else 0,
        ROW_LEN=dv if fast else 0,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **extra,
    )
    return dst, dst_lse


CASES = [
    ("bf16", "e", True, True, 1),
    ("f16", "2", True, True, 1),
    ("f32", "e", False, True, 2),
    ("f32", "2", True, False, 1),
    ("bf16", "2", False, True, 3),
]


@pytest.mark.parametrize("odtype,base,return_lse,mask,interleave", CASES)
@pytest.mark.parametrize("kernel", ["_merge_kernel", "_correct_kernel"])
def test_merge_kernels_match_float64_reference(
    tmp_path, odtype, base, return_lse, mask, interleave, kernel
):
    dtype = DT[odtype]
    mod = load(compile_text(merge_schedule(odtype, base, return_lse, mask, interleave), tmp_path))
    x = make_inputs(dtype, 40, mask=mask)
    masked = merge.empty_mask(x["seq_lens"], x["qsl"], T, WORLD, interleave) if mask else None
    o64, lse64 = x["o"].double(), x["lse"].double()
    runs = [(own, fast) for own in ([None] if kernel == "_merge_kernel" else [0, 3])
            for fast in (False, True)]
    for own, fast in runs:
        dst, dst_lse = run_merge(
            mod,
            x,
            dtype,
            base=base,
            return_lse=return_lse,
            mask=mask,
            interleave=interleave,
            kernel=kernel,
            own=own,
            fast=fast,
        )
        if own is None:
            ref, ref_lse = merge.lse_combine(o64, lse64, base, masked, torch.float64)
        else:
            ref, ref_lse = merge.lse_correct(o64[own], lse64, own, base, masked, torch.float64)
        assert not torch.isnan(dst).any(), "NaN in the output (unwritten or leaked garbage)"
        torch.testing.assert_close(dst.double(), ref.to(dtype).double(), **TOL[dtype])
        if return_lse:
            torch.testing.assert_close(dst_lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
            assert torch.isneginf(dst_lse[4, 2])
        else:
            assert torch.isnan(dst_lse).all(), "return_lse off must not write the LSE"
        assert (dst[4, 2] == 0).all(), "an all -inf row merges to exactly 0"
        if mask:
            assert (dst[2] == 0).all() and (dst[5:] == 0).all(), "empty/padding rows are 0"
            if return_lse:
                assert torch.isneginf(dst_lse[5:]).all()


def test_search_handles_one_request_and_full_batch(tmp_path):
    """searchsorted over qsl[1:] in-kernel: B = 1 and B = max, row past the end masked."""
    mod = load(compile_text(merge_schedule("f32", "e", True, True, 1), tmp_path))
    x = make_inputs(torch.float32, 40, seed=3)
    x["o"] = x["o"].nan_to_num(0.0, 0.0, 0.0)
    x["lse"] = torch.randn(WORLD, T, G)
    cases = [([30], [0, 6]), ([5, 6, 7, 8, 9, 10, 11, 12], [0, 1, 2, 3, 4, 5, 6, 7, 7])]
    for (seq, qsl), fast in [(c, f) for c in cases for f in (False, True)]:
        x["seq_lens"] = torch.tensor(seq, dtype=torch.int32)
        x["qsl"] = torch.tensor(qsl, dtype=torch.int32)
        masked = merge.empty_mask(x["seq_lens"], x["qsl"], T, WORLD, 1)
        dst, dst_lse = run_merge(
            mod,
            x,
            torch.float32,
            base="e",
            return_lse=True,
            mask=True,
            interleave=1,
            kernel="_merge_kernel",
            fast=fast,
        )
        ref, ref_lse = merge.lse_combine(x["o"].double(), x["lse"].double(), "e", masked)
        torch.testing.assert_close(dst.double(), ref.double(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dst_lse.double(), ref_lse.double(), rtol=1e-5, atol=1e-5)
