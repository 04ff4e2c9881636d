"""Numeric facts every stage reads from one place (the float64 simulator, the torch
backend's math): where a request's KV tokens live, and the fp8 e4m3 range. A leaf
module (torch only): importing it starts no Triton."""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value


def local_seq_len(seq_lens: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """Tokens of each request held by ``rank`` (token t lives on (t // I) % W)."""
    base = seq_lens // interleave // world * interleave
    rem = (seq_lens - base * world - rank * interleave).clamp(0, interleave)
    return base + rem


FP8_E4M3_MIN_EXP = -6  # below 2**-6, e4m3's grid is 2**-9 (subnormals)
SCALE_FLOOR = 1e-4  # a token's amax below this is taken as this (DeepEP's floor): no 1/0


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` clamped to +-448 and rounded to the e4m3 grid, half away from zero (NaN
    stays NaN: one NaN, positive, e4m3fn's byte 0x7F, whatever sign the NaN had: x86
    makes inf * 0 a negative NaN, a GPU a positive one), in fp32 bit arithmetic: the
    kernels' rule (templates/math.j2 ``_dcpc_quantize``, ``_dcpc_store_e4m3``), so that
    the reference and every backend agree bit for bit."""
    y = y.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    exponent = (y.view(torch.int32) >> 23) & 0xFF
    ulp = (torch.clamp(exponent - 3, min=127 - 9) << 23).view(torch.float32)
    r = torch.floor(y.abs() / ulp + 0.5) * ulp
    return torch.where(torch.isnan(y), torch.nan, torch.where(y < 0, -r, r))


def token_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of each row (last dim) for a per-token e4m3 cast, in fp32:
    ``amax = max(|row|, SCALE_FLOOR)``, ``scale = amax / 448``, ``inverse = 448 / amax``;
    the row is sent as ``round_e4m3(row * inverse)`` and read back as ``q * scale``."""
    amax = rows.float().abs().amax(dim=-1).clamp(min=SCALE_FLOOR)
    return ieee_div(amax, FP8_E4M3_MAX), ieee_div(FP8_E4M3_MAX, amax)


def ieee_div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b in fp32, correctly rounded as the kernels divide: torch computes ``2.0 / t``
    as ``t.reciprocal() * 2.0`` (one ulp off, e.g. 448 / 1.9140625), so both operands
    are made fp32 tensors first."""
    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    return torch.div(a, b)
