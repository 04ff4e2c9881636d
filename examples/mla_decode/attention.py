"""A small, readable MLA decode attention in torch, and the DCP interleave rule.

MLA ("absorbed" form, DeepSeek-V3 / Kimi): every KV cache row is one latent vector
of D = kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 numbers shared by all heads.
Scores are q . kv over all 576 dims; values are the first 512 dims of the same row.

This stands in for the engine's attention kernel (FlashMLA and friends). It is
written to be CUDA-graph safe: fixed shapes, no host synchronisation, every
per-step quantity (sequence lengths, request boundaries) read from device tensors.
"""

from __future__ import annotations

import math

import torch

D_QK = 576  # kv_lora_rank + qk_rope_head_dim
D_V = 512  # kv_lora_rank: the value part of a latent row

# What a kernel may leave in the LSE of a row that saw no key. Real kernels differ;
# the merge must mask these rows by metadata (seq_lens), never trust this value.
GARBAGE_LSE = 5.0


def owner_rank(position: int, world: int, interleave: int = 1) -> int:
    """The rank that stores KV token `position`: blocks of `interleave` tokens round-robin."""
    return (position // interleave) % world


def local_seq_len(seq_len: torch.Tensor, rank: int, world: int, interleave: int = 1):
    """How many of a request's `seq_len` tokens live on `rank` (domain.md's formula)."""
    base = seq_len // interleave // world * interleave
    rem = (seq_len - base * world - rank * interleave).clamp(0, interleave)
    return base + rem


def global_position(local_index: torch.Tensor, rank: int, world: int, interleave: int = 1):
    """The sequence position of the `local_index`-th row of `rank`'s shard."""
    block, within = local_index // interleave, local_index % interleave
    return block * world * interleave + rank * interleave + within


def row_to_request(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Request index of every query row; padding rows (past the last request) get B."""
    rows = torch.arange(num_rows, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:], rows, right=True)


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    rank: int = 0,
    world: int = 1,
    interleave: int = 1,
    empty_lse: float = -math.inf,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of every query row against one rank's KV shard.

    q:               [T, H, 576] (T may include CUDA-graph padding rows)
    kv_cache:        [B, L, 576], request b's shard rows in local order (L >= its local length)
    seq_lens:        [B] int32, GLOBAL sequence lengths (the query token is the last one)
    query_start_loc: [B + 1] int32, rows of request b are query_start_loc[b] : [b + 1]

    Returns o [T, H, 512] (q.dtype) and lse [T, H] (fp32, natural log), both relative to
    this shard only. With world=1 this is plain single-GPU attention over the full cache.
    A row whose shard is empty gets lse `empty_lse` (-inf, or kernel garbage) and a NaN
    output: what an engine kernel may leave there. Padding rows get whatever falls out.
    """
    num_rows, num_requests = q.shape[0], seq_lens.shape[0]
    request = row_to_request(query_start_loc, num_rows).clamp(max=num_requests - 1).long()

    # Which shard rows are real for this row's request: the first local_seq_len of them.
    # Decode: the query token is at position seq_len - 1, so every stored token is causal.
    # (With several query tokens per request (MTP), a per-row causal bound is needed here.)
    n_local = local_seq_len(seq_lens.long(), rank, world, interleave)[request]  # [T]
    slot = torch.arange(kv_cache.shape[1], device=q.device)
    visible = slot[None, :] < n_local[:, None]  # [T, L]

    kv = kv_cache[request].float()  # [T, L, 576]: each row's request's shard
    scores = torch.einsum("thd,tld->thl", q.float(), kv) / math.sqrt(D_QK)
    scores = scores.masked_fill(~visible[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]; -inf where nothing is visible
    probs = torch.exp(scores - lse[..., None])  # NaN on rows with no key: kernel garbage
    out = torch.einsum("thl,tlv->thv", probs, kv[..., :D_V])

    empty = (n_local == 0)[:, None].expand_as(lse)
    lse = torch.where(empty, torch.full_like(lse, empty_lse), lse)
    return out.to(q.dtype), lse


def shard_of(kv_full: torch.Tensor, rank: int, world: int, interleave: int = 1):
    """This rank's rows of a request's full cache [S, 576], in local order."""
    positions = torch.arange(kv_full.shape[0], device=kv_full.device)
    return kv_full[(positions // interleave) % world == rank]
