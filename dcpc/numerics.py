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
