"""Reference math of the LSE-weighted merge (domain.md), shared by the torch backend
and the tests. Works in the dtype of its inputs' promotion with fp32 (tests pass
float64); every edge case of the kernels is handled the same way here:

- NaN or +inf LSE counts as -inf (weight 0);
- a row whose partials are all -inf has output 0 and LSE -inf, never NaN;
- a partial of weight 0 contributes exactly 0, even if it holds NaN/inf (``where``);
- empty shards (local sequence length 0) and padding rows are masked to -inf.
"""

from __future__ import annotations

import torch

from dcpc.numerics import FP8_FORMATS, local_seq_len, quantize_fp8, scale_fault
from dcpc.runtime.errors import DcpcScaleError


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    bad = torch.isnan(lse) | (lse == float("inf"))
    return torch.where(bad, torch.full_like(lse, float("-inf")), lse)


def token_requests(query_start_loc: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each token row, padding flag): searchsorted(qsl[1:], row, right=True)."""
    rows = torch.arange(tokens, dtype=query_start_loc.dtype, device=query_start_loc.device)
    req = torch.searchsorted(query_start_loc[1:].contiguous(), rows, right=True)
    padding = rows >= query_start_loc[-1]
    return req, padding


def empty_mask(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tokens: int, world: int, interleave: int
) -> torch.Tensor:
    """bool [W, tokens]: True where rank p's partial of a token must not contribute."""
    req, padding = token_requests(query_start_loc, tokens)
    batch = seq_lens.shape[0]
    seq = seq_lens[req.clamp(max=max(batch - 1, 0))] if batch else torch.zeros_like(req)
    masks = [padding | (local_seq_len(seq, p, world, interleave) == 0) for p in range(world)]
    return torch.stack(masks)


def empty_mask_local(
    local_seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tokens: int
) -> torch.Tensor:
    """bool [W, tokens] from every rank's local lengths [B, W] (vLLM's
    get_dcp_local_seq_lens(seq_lens, W)): True where rank p holds no KV of the token's
    request, or the token is padding."""
    req, padding = token_requests(query_start_loc, tokens)
    batch, world = local_seq_lens.shape
    if batch == 0:
        return torch.ones(world, tokens, dtype=torch.bool, device=query_start_loc.device)
    held = local_seq_lens[req.clamp(max=batch - 1)]  # [tokens, W]
    return (padding.unsqueeze(1) | (held == 0)).t()


def checked_scale(scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor fp8 scale ``scale[0]`` as an fp32 scalar, refused with
    ``DcpcScaleError`` unless a positive finite normal (dcpc.numerics.scale_fault, the
    rule the kernels apply in-kernel). Reads the value on the host: the torch backend's
    way, as its other argument checks."""
    s = scale.reshape(-1)[0].float()
    value = float(s)
    why = scale_fault(value)
    if why is not None:
        raise DcpcScaleError(value, why)
    return s


def fp8_format(dtype: torch.dtype) -> str:
    """The fp8 format (dcpc.numerics.FP8_FORMATS) of a torch fp8 dtype; any other dtype
    is a caller's bug (ValueError), never taken as e4m3."""
    from dcpc.runtime.validate import DTYPES

    for name in FP8_FORMATS:
        if DTYPES[name] == dtype:
            return name
    raise ValueError(f"{dtype} is no fp8 format of dcpc.numerics.FP8_FORMATS "
                     f"({', '.join(FP8_FORMATS)})")


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 output of torch ``dtype`` (e4m3 or e5m2): x * (1 / scale[0]) in fp32, clamped
    to the format's range and rounded to its grid by the kernels' rule
    (dcpc.numerics.quantize_fp8, the one quantiser: ties away from zero, NaN stays NaN,
    the sign of zero kept), as vLLM's merge_attn_states with output_scale; the same bits
    as the Triton backends and the float64 reference."""
    return quantize_fp8(x, checked_scale(scale), fp8_format(dtype))


def _exp_log(base: str) -> tuple:
    if base == "2":
        return torch.exp2, torch.log2
    if base == "e":
        return torch.exp, torch.log
    raise ValueError(f"lse base must be 'e' or '2', got {base!r}")


def _apply_mask(lse: torch.Tensor, masked: torch.Tensor | None) -> torch.Tensor:
    lse = sanitize_lse(lse)
    if masked is None:
        return lse
    m = masked.reshape(masked.shape + (1,) * (lse.dim() - masked.dim()))
    return torch.where(m, torch.full_like(lse, float("-inf")), lse)


def merge_weights(
    lse: torch.Tensor, base: str = "e", masked: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [W, ...], merged LSE [...]) of partial LSEs [W, ...] (NaN/+inf and
    ``masked`` count as -inf), in lse's dtype: w_p = exp(lse_p - m) / S with m the max
    (0 when every partial is -inf) and S = sum_q exp(lse_q - m), exactly 0 for a -inf
    partial; LSE = m + log(S) (-inf for an all -inf row). Never exp(lse_p - LSE): LSE
    near a common shift s is rounded to ulp(s), 1 at 1e7 in fp32, so those weights
    were off by up to e^0.5 there. S is 0 or at least 1 (the max adds exp(0)), so the
    division by max(S, 1) is exact and never by 0."""
    exp, log = _exp_log(base)
    lse = _apply_mask(lse, masked)
    top = lse.amax(0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    total = exp(lse - top).sum(0)
    w = exp(lse - top) / total.clamp(min=1.0)
    w = torch.where(lse == float("-inf"), torch.zeros_like(w), w)
    return w, top + log(total)  # log(0) = -inf: every partial empty


def lse_combine(
    o: torch.Tensor,
    lse: torch.Tensor,
    base: str = "e",
    masked: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge W partials: o [W, ..., Dv], lse [W, ...] -> (out [..., Dv], lse [...])."""
    w, total = merge_weights(lse.to(acc_dtype), base, masked)
    w = w.unsqueeze(-1)
    contrib = torch.where(
        w > 0, w * o.to(acc_dtype), torch.zeros((), dtype=acc_dtype, device=o.device)
    )
    return contrib.sum(0), total


def lse_correct(
    o: torch.Tensor,
    lse_all: torch.Tensor,
    rank: int,
    base: str = "e",
    masked: torch.Tensor | None = None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ag_rs: rescale this rank's partial o [..., Dv] by exp(lse_rank - LSE)."""
    w, total = merge_weights(lse_all.to(acc_dtype), base, masked)
    w = w[rank].unsqueeze(-1)
    out = torch.where(w > 0, w * o.to(acc_dtype), torch.zeros((), dtype=acc_dtype, device=o.device))
    return out, total
