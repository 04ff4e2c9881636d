"""Float64 statements of the engine functions' documented semantics (one process, given
every rank's inputs), written from the engines' math (docs/engines.md and the research
notes), not from dcpc's kernels: what the adapters' tests compare with.

Conventions: ``outs[r]`` [B, H, D] and ``lses[r]`` [B, H] are rank r's partials of ALL
heads; rank r owns heads r*H/W .. (r+1)*H/W - 1; ``local_lens[r]`` [B] is rank r's
local KV length per request (vLLM's seq_lens argument on rank r).
"""

from __future__ import annotations

import torch

from dcpc.runtime.local import to_host

NEG_INF = float("-inf")


def _f64(t: torch.Tensor) -> torch.Tensor:
    return to_host(t.detach().to(torch.float64))  # safe with ranks as threads on one GPU


def source_mask(lse: torch.Tensor, local_lens: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """vLLM's mask_dcp_empty_shards_: rows at or past qsl[-1], and rows of a request
    whose local length is 0, get -inf (all rows when there are no requests)."""
    lse = _f64(lse).clone()
    lens, q = to_host(local_lens).long(), to_host(qsl).long()
    if lens.numel() == 0:
        return torch.full_like(lse, NEG_INF)
    for row in range(lse.shape[0]):
        if row >= q[-1]:
            lse[row] = NEG_INF
            continue
        req = int(torch.searchsorted(q[1:], torch.tensor(row), right=True))
        if lens[min(req, lens.numel() - 1)] == 0:
            lse[row] = NEG_INF
    return lse


def global_lse(lses: torch.Tensor, base2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(sanitized lses [W, ...], G [...]): NaN and +inf count as -inf, the max is
    shifted out (0 when every entry is -inf), G = log(sum exp(lse - m)) + m."""
    exp, log = (torch.exp2, torch.log2) if base2 else (torch.exp, torch.log)
    lses = torch.where(torch.isnan(lses) | (lses == float("inf")), NEG_INF, lses)
    m = lses.amax(0)
    m = torch.where(m == NEG_INF, 0.0, m)
    return lses, log(exp(lses - m).sum(0)) + m


def merge_all(outs: list[torch.Tensor], lses: list[torch.Tensor], base2: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge over ranks: (out [B, H, D], G [B, H]); a weight-0 partial adds 0
    even when it holds NaN; a row with no live partial is 0."""
    exp = torch.exp2 if base2 else torch.exp
    lse, total = global_lse(torch.stack([_f64(x) for x in lses]), base2)
    w = exp(lse - total)
    w = torch.where(torch.isnan(w), 0.0, w).unsqueeze(-1)
    o = torch.stack([_f64(x) for x in outs])
    return torch.where(w == 0, 0.0, w * o).sum(0), total


def vllm_combine(outs: list[torch.Tensor], lses: list[torch.Tensor], *, base2: bool = False,
                 local_lens: list[torch.Tensor] | None = None, qsl: torch.Tensor | None = None
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """vLLM's cp_lse_ag_out_rs and dcp_a2a_lse_reduce (equal in exact arithmetic): per
    rank (out [B, H/W, D], G [B, H/W]) of its heads; with local_lens and qsl every
    rank's LSE is masked at the source first."""
    world = len(outs)
    if local_lens is not None:
        lses = [source_mask(lses[r], local_lens[r], qsl) for r in range(world)]
    out, total = merge_all(outs, lses, base2)
    part = out.shape[1] // world
    return [(out[:, r * part:(r + 1) * part], total[:, r * part:(r + 1) * part])
            for r in range(world)]


def vllm_v_up_proj_combine(outs: list[torch.Tensor], lses: list[torch.Tensor],
                           w_uv: torch.Tensor, *, base2: bool = False,
                           local_lens: list[torch.Tensor] | None = None,
                           qsl: torch.Tensor | None = None) -> list[torch.Tensor]:
    """vLLM 0.34.0's dcp_a2a_v_up_proj_lse_reduce (and the manager's v_up_proj_combine):
    per rank the merge of its heads (vllm_combine) up-projected by those heads' W_UV
    (``w_uv`` [H, L, V], all heads in rank order): [B, H/W * V]. Either of vLLM's
    orders (project, then merge; merge, then project) equals this in exact arithmetic."""
    w64 = _f64(w_uv)
    out = []
    for r, (merged, _) in enumerate(vllm_combine(outs, lses, base2=base2,
                                                 local_lens=local_lens, qsl=qsl)):
        part = merged.shape[1]
        heads = w64[r * part:(r + 1) * part]  # [H/W, L, V]
        out.append(torch.einsum("bhl,hlv->bhv", merged, heads).reshape(merged.shape[0], -1))
    return out


def vllm_correct_attn_out(out: torch.Tensor, lses: torch.Tensor, rank: int,
                          base2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's correct_attn_out: (out * exp(lse_rank - G), 0 where the factor is 0; G)."""
    exp = torch.exp2 if base2 else torch.exp
    lse, total = global_lse(_f64(lses), base2)
    d = lse[rank] - total
    d = torch.where(torch.isnan(d) | (d == float("inf")), NEG_INF, d)
    f = exp(d).unsqueeze(-1)
    return torch.where(f == 0, 0.0, _f64(out) * f), total


def sglang_ag_rs_mla(outs: list[torch.Tensor], lses: list[torch.Tensor], base2: bool = True
                     ) -> list[torch.Tensor]:
    """SGLang's cp_lse_ag_out_rs_mla: per rank the merged output of its heads, head-major
    [H/W, B, D] (SGLang keeps a NaN partial NaN; with finite partials the same)."""
    return [out.transpose(0, 1) for out, _ in vllm_combine(outs, lses, base2=base2)]


def sglang_a2a(outs: list[torch.Tensor], lses: list[torch.Tensor], base2: bool = False
               ) -> list[torch.Tensor]:
    """SGLang's dcp_a2a_lse_reduce: per rank the output of its heads [B, H/W, D]."""
    return [out for out, _ in vllm_combine(outs, lses, base2=base2)]


def gather_heads(parts: list[torch.Tensor]) -> torch.Tensor:
    """The query all-gather along heads: [B, H/W, D] per rank -> [B, H, D]."""
    return torch.cat([_f64(p) for p in parts], dim=1)


def gather_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """all_gather_into_tensor: [N, C] per rank -> [W*N, C], rank-major."""
    return torch.cat([_f64(p) for p in parts], dim=0)
