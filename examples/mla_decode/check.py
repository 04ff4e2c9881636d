"""The checker of the example: DCP output == single-GPU attention, step after step.

Every step, every rank holds the merged output of ALL heads (gathered from the group,
as the engine's o_proj would need it). We compare it with plain attention over the
full, unsplit KV cache, and compare the greedy token each output produces.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# bf16 tolerance: the partial outputs and the merged output are each rounded to bf16
# (8 bits of mantissa, relative error 2**-9 per rounding); the merge itself is fp32.
RTOL = 1.6e-2
ATOL = 1e-2


@dataclass
class CheckStats:
    steps: int = 0
    rows_checked: int = 0
    max_abs_err: float = 0.0
    tolerance_violations: int = 0  # elements with |dcp - ref| > ATOL + RTOL * |ref|
    nonfinite: int = 0  # NaN/inf in real rows of the DCP output
    rows_with_empty_shard: int = 0  # real rows where some rank holds none of the request
    padding_rows: int = 0
    padding_rows_nonzero: int = 0  # padding rows must merge to exactly 0 (all masked)
    tokens_checked: int = 0
    token_matches: int = 0
    near_ties: int = 0  # mismatches whose logits differ by less than the output error
    token_mismatches: int = 0  # mismatches that a bf16 error cannot explain

    @property
    def passed(self) -> bool:
        return (
            self.rows_checked > 0
            and self.tolerance_violations == 0
            and self.nonfinite == 0
            and self.padding_rows_nonzero == 0
            and self.token_mismatches == 0
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def compare_outputs(stats: CheckStats, dcp_out: torch.Tensor, ref_out: torch.Tensor) -> None:
    """dcp_out [T_padded, H, Dv] (gathered over the group), ref_out [T, H, Dv] fp32."""
    rows = ref_out.shape[0]
    real = dcp_out[:rows].float()
    ref = ref_out.float()
    stats.nonfinite += int((~torch.isfinite(real)).sum())
    diff = (real - ref).abs().nan_to_num(nan=float("inf"))
    stats.max_abs_err = max(stats.max_abs_err, float(diff.max()))
    stats.tolerance_violations += int((diff > ATOL + RTOL * ref.abs()).sum())
    stats.rows_checked += rows

    # CUDA-graph padding rows are masked for every peer: their merge has no partial,
    # so domain.md says the output is 0 (never NaN, never last step's data).
    padding = dcp_out[rows:].float()
    stats.padding_rows += padding.shape[0]
    stats.padding_rows_nonzero += int((padding != 0).flatten(1).any(dim=1).sum())


def compare_tokens(
    stats: CheckStats, dcp_logits: torch.Tensor, ref_logits: torch.Tensor
) -> torch.Tensor:
    """Greedy tokens of both outputs; returns the DCP ones (the engine samples those).

    A differing argmax is a near-tie when the reference's own logits for the two
    tokens are closer than the logit error this step: bf16 rounding may flip it.
    """
    dcp_tokens = dcp_logits.argmax(dim=-1)
    ref_tokens = ref_logits.argmax(dim=-1)
    stats.tokens_checked += dcp_tokens.numel()
    same = dcp_tokens == ref_tokens
    stats.token_matches += int(same.sum())
    logit_err = (dcp_logits - ref_logits).abs().amax(dim=-1)
    ref_gap = ref_logits.gather(-1, ref_tokens[:, None]) - ref_logits.gather(
        -1, dcp_tokens[:, None]
    )
    tie = ~same & (ref_gap[:, 0] <= 2 * logit_err)
    stats.near_ties += int(tie.sum())
    stats.token_mismatches += int((~same & ~tie).sum())
    return dcp_tokens


def merge_stats_across_ranks(stats: CheckStats, group) -> CheckStats:
    """Every rank checked the same gathered output; keep the worst of each counter."""
    import torch.distributed as dist

    values = torch.tensor(
        [float(v) for v in asdict(stats).values()], dtype=torch.float64
    )
    if dist.get_backend(group) == "nccl":
        values = values.cuda()
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    merged = dict(zip(asdict(stats).keys(), values.cpu().tolist(), strict=True))
    return CheckStats(
        **{k: (v if k == "max_abs_err" else int(v)) for k, v in merged.items()}
    )
