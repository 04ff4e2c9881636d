"""Numeric facts every stage reads from one place (the float64 simulator, the torch
backend's math): where a request's KV tokens live, and the fp8 formats. A leaf module:
importing it imports neither torch nor Triton (the compiler reads FP8_FORMATS; the
functions import torch when called)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value


def local_seq_len(seq_lens: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    """Tokens of each request held by ``rank`` (token t lives on (t // I) % W)."""
    base = seq_lens // interleave // world * interleave
    rem = (seq_lens - base * world - rank * interleave).clamp(0, interleave)
    return base + rem


SCALE_FLOOR = 1e-4  # a token's amax below this is taken as this (DeepEP's floor): no 1/0

# the fp8 formats a cast or an fp8 output rounds into, by dtype: (largest finite value,
# mantissa bits, smallest normal exponent); one rule for both (round_fp8, the kernels'
# _dcpc_store_fp8 in dcpc/runtime/device.py)
FP8_FORMATS = {"fp8e4m3": (FP8_E4M3_MAX, 3, -6), "fp8e5m2": (57344.0, 2, -14)}


# a per-token cast's rule (``scale: {rule: ...}``, dcpc/ops/cast.py): how a group's scale
# is made and how its values round, by name. "dcpc" the default; "deepep": DeepEP's
# low-latency dispatch (csrc/kernels/legacy/internode_ll.cu, calculate_fp8_scales in
# utils.cuh) with round_scale=False, "deepep_round_scale" with round_scale=True (powers of
# two: its UE8M0 scales' values). The one definition of each rule's properties
# (RuleProps): token_scales and quantise_tokens branch on them, and dcpc.ops.cast.cast_attrs
# hands them to the kernel's template, which branches on them too.
ScaleRule = Literal["dcpc", "deepep", "deepep_round_scale"]


@dataclass(frozen=True)
class RuleProps:
    """What a scale rule does. ``skips_nan``: the amax skips a NaN (fmaxf; else a NaN
    makes its group's scale NaN, and so every value of the group); ``scale``: ``divide``
    (scale amax / top, inverse top / amax), ``multiply`` (scale amax * fl32(1 / top):
    inverse_top, inverse top / amax) or ``pow2`` (multiply's scale rounded up to a power
    of two 2**e from its bits, inverse 2**-e); ``even``: values round ties to even (else
    away from zero)."""

    skips_nan: bool
    scale: Literal["divide", "multiply", "pow2"]
    even: bool


SCALE_RULES: dict[ScaleRule, RuleProps] = {
    "dcpc": RuleProps(skips_nan=False, scale="divide", even=False),
    "deepep": RuleProps(skips_nan=True, scale="multiply", even=True),
    "deepep_round_scale": RuleProps(skips_nan=True, scale="pow2", even=True),
}


def inverse_top(dtype: str) -> float:
    """fl32(1 / top) of fp8 ``dtype`` (top: FP8_FORMATS' largest finite value), the
    constant a ``multiply`` or ``pow2`` rule's scale is amax times (DeepEP's
    kFinfoAmaxInvE4M3); an f32, so a kernel's literal of it is exact."""
    return float(ieee_div(1.0, FP8_FORMATS[dtype][0]))


def round_fp8(y: torch.Tensor, dtype: str = "fp8e4m3", even: bool = False) -> torch.Tensor:
    """fp32 ``y`` clamped to the finite range of fp8 ``dtype`` (+-448 e4m3, +-57344 e5m2:
    saturated, an inf too) and rounded to its grid, ties away from zero (``even``: ties to
    even, a GPU's ``__nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, ..)`` as DeepEP
    converts; the clamp first is the same saturation) (3 or 2 mantissa
    bits; below the smallest normal, 2**-6 or 2**-14, the subnormal grid 2**-9 or
    2**-16); NaN stays NaN (one NaN, positive, byte
    0x7F, whatever sign the NaN had: x86 makes inf * 0 a negative NaN, a GPU a positive
    one), in fp32 bit arithmetic: the kernels' rule (``_dcpc_store_fp8``), so that the
    reference and every backend agree bit for bit. The sign of a zero is kept (-0.0, and
    a negative value that rounds to 0, give -0: byte 0x80), as a conversion. Not the bits
    of Transformer Engine's or torch's fp8 casts: those round ties to even, so a value
    exactly halfway between two fp8 values rounds apart (e4m3: 8.5 is 9 here, 8 there)."""
    import torch

    top, mantissa, min_exp = FP8_FORMATS[dtype]
    y = y.float().clamp(-top, top)
    exponent = (y.view(torch.int32) >> 23) & 0xFF
    ulp = (torch.clamp(exponent - mantissa, min=127 + min_exp - mantissa) << 23
           ).view(torch.float32)
    x = y.abs() / ulp  # exact (a power of two); x - floor(x) too, where x + 0.5 rounds
    t = torch.floor(x)  # (0.5 - 2**-25 + 0.5 is 1.0 in fp32): the half compared apart
    half = x - t
    up = (half > 0.5) | ((half == 0.5) & ((t % 2 == 1) if even else True))
    r = torch.where(up, t + 1.0, t) * ulp
    return torch.where(torch.isnan(y), torch.nan, torch.where(torch.signbit(y), -r, r))


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """``round_fp8`` into e4m3."""
    return round_fp8(y, "fp8e4m3")


def ieee_max(parts: torch.Tensor) -> torch.Tensor:
    """The maximum over dim 0 as ``reduce: max`` defines it on every backend: NaN if any
    part is NaN, and +0 above -0 (IEEE 754-2019 maximum): a max of zeros is +0 unless
    every one is -0, whatever their order (torch.maximum keeps its first argument on a
    tie, numpy's its second). The kernels: templates/ops/all_reduce.py.j2, reduce.py.j2."""
    import torch

    top = parts.amax(dim=0)
    positive_zero = ((parts == 0) & ~torch.signbit(parts)).any(dim=0)
    zero = torch.zeros_like(top)
    return torch.where(top == 0, torch.where(positive_zero, zero, -zero), top)


SCALE_MIN = 2.0**-126  # the smallest normal f32: a per-tensor fp8 scale is at least this
SCALE_MAX = 2.0**126  # and at most this: 1 / s stays normal (a GPU's div_rn flushes to 0)


def scale_fault(value: float) -> str | None:
    """Why ``value`` is no per-tensor fp8 scale (``output_scale``, a cast's ``per:
    tensor`` scale), or None: a scale is a positive finite normal f32 whose inverse is
    normal too (SCALE_MIN <= s <= SCALE_MAX, 2**-126 to 2**126). 0, a denormal, a
    negative, NaN or inf would quantise to +-448, flip signs, or give NaN or 0; above
    2**126, 1 / s is a denormal on the CPU and 0 on a GPU (Triton's div_rn is
    div.rn.ftz). The one rule: the torch backend and the reference call this; the
    kernels read the same bounds (dcpc/runtime/device.py ``_dcpc_scale``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "zero" if math.copysign(1.0, value) > 0 else "negative zero"
    if value < 0:
        return "negative"
    if value < SCALE_MIN:
        return "a denormal"
    if value > SCALE_MAX:
        return "above 2**126: its inverse is no normal f32"
    return None


def token_scales(rows: torch.Tensor, dtype: str = "fp8e4m3", group: int | None = None,
                 rule: ScaleRule = "dcpc") -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) of each group of ``group`` channels of each row (last dim) for a
    cast into fp8 ``dtype``, in fp32: ``amax = max(|group|, SCALE_FLOOR)``, ``scale =
    amax / top``, ``inverse = top / amax`` (top: FP8_FORMATS' largest finite value, 448
    e4m3, 57344 e5m2); a group is sent as ``round_fp8(x * inverse, dtype)`` and read back
    as ``q * scale`` (``spread`` puts a group's scale on each of its channels).
    ``group`` None: per token, the whole row one group, the scales ``rows``' shape
    without its last dim; else DeepEP's per-128-channel scales, ``[..., H / group]``.
    ``rule``: its SCALE_RULES properties; "deepep", DeepEP's calculate_fp8_scales with
    round_scale=False: a NaN skipped by the amax (fmaxf), ``scale = amax * fl32(1 /
    top)``, ``inverse = top / amax``; "deepep_round_scale": ``scale = 2**e``, ``inverse =
    2**-e``, e the ceiling of log2(amax * fl32(1 / top)) read from its bits
    (fast_log2_ceil, fast_pow2: an inf amax gives e = 128, scale inf, inverse -inf, as
    there)."""
    import torch

    props = SCALE_RULES[rule]
    top = FP8_FORMATS[dtype][0]
    x = rows.float()
    width = x.shape[-1] if group is None else group
    magnitude = torch.where(x.isnan(), 0.0, x.abs()) if props.skips_nan else x.abs()
    groups = magnitude.reshape(*x.shape[:-1], x.shape[-1] // width, width)
    amax = groups.amax(dim=-1).clamp(min=SCALE_FLOOR)
    amax = amax.squeeze(-1) if group is None else amax
    if props.scale == "divide":
        return ieee_div(amax, top), ieee_div(top, amax)
    scale = amax * inverse_top(dtype)  # kFinfoAmaxInvE4M3: 1 / 448.0f, a multiply
    if props.scale == "multiply":
        return scale, ieee_div(top, amax)
    bits = scale.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e + 127) << 23).view(torch.float32), ((127 - e) << 23).view(torch.float32)


def quantise_tokens(rows: torch.Tensor, dtype: str = "fp8e4m3", group: int | None = None,
                    rule: ScaleRule = "dcpc") -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp8 ``dtype`` values of ``rows`` in fp32, the scales sent) of a per-token
    quantise by ``rule`` (token_scales; ties to even as its SCALE_RULES ``even`` says): the one
    rule of the float64 reference (dcpc.ops.cast) and the torch backend."""
    scale, inverse = token_scales(rows, dtype, group, rule)
    return round_fp8(rows.float() * spread(inverse, group), dtype, SCALE_RULES[rule].even), scale


def spread(scales: torch.Tensor, group: int | None) -> torch.Tensor:
    """``token_scales``' per-group values on every channel of their group (broadcastable
    against the rows): per token ``s[..., None]``; per group ``s[..., c // group]``."""
    return scales[..., None] if group is None else scales.repeat_interleave(group, dim=-1)


def ieee_div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b in fp32, correctly rounded as the kernels divide: torch computes ``2.0 / t``
    as ``t.reciprocal() * 2.0`` (one ulp off, e.g. 448 / 1.9140625), so both operands
    are made fp32 tensors first, on one device (a's, else b's): CUDA divides by a CPU
    scalar tensor as a * (1 / b) too."""
    import torch

    device = a.device if isinstance(a, torch.Tensor) else (
        b.device if isinstance(b, torch.Tensor) else None)
    a = torch.as_tensor(a, dtype=torch.float32, device=device)
    b = torch.as_tensor(b, dtype=torch.float32, device=device)
    return torch.div(a, b)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: str = "fp8e4m3"
                 ) -> torch.Tensor:
    """``x`` quantised into fp8 ``dtype`` by a per-tensor scale (``output_scale``, a
    cast's ``per: tensor`` scale; ``scale`` its fp32 value, checked by scale_fault):
    ``round_fp8(fl32(x) * fl32(1 / scale))``, the kernels' rule (``_dcpc_quantize`` of
    ``_dcpc_inv_scale``'s div_rn(1, s)), never ``x / scale`` (e4m3, s = 3: 7.1249995
    * fl32(1/3) is 2.5, 7.1249995 / 3 2.25). The one quantiser: the torch backend
    (merge.quantize) and the float64 reference (simulate.scaled, the cast's) call it."""
    return round_fp8(x.float() * ieee_div(1.0, scale), dtype)


def reference_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """The float64 reference's per-tensor fp8 scale ``scale[0]`` as fp32, refused as the
    backends refuse it (``scale_fault``: ValueError naming ``what``)."""
    import torch

    s = scale.reshape(-1)[0].to(torch.float32)
    why = scale_fault(float(s))
    if why is not None:
        raise ValueError(f"simulator: {what} is {float(s)!r} ({why}); a per-tensor fp8 "
                         "scale is a positive finite normal f32, 2**-126 to 2**126")
    return s
