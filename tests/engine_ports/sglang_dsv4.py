"""Port of SGLang's DeepSeek-V4 DCP collectives parity test (``test_dsv4_dcp_collectives``,
sgl-project/sglang; the index holds two versions without path or commit: ids
59175841495, 2 local heads, and 59435891748, 16 local heads with the packed top-k and the
CUDA-graph replays) onto dcpc's SGLang adapters (dcpc.engines.sglang).

Kept, every one: the query all-gather equals the global query; ag_rs
(``cp_lse_ag_out_rs_mla(...).transpose(0, 1).contiguous()``) and a2a
(``dcp_a2a_lse_reduce(..., comm_backend="a2a")``) each equal the reference within
4e-2 and each other within 3e-2; the ag_rs result is contiguous and views as
[batch, -1]; three replays give results equal to the eager ag_rs within 3e-2, each
contiguous, and bit-identical to each other.

Replaced (fixtures): torchrun + NCCL GroupCoordinator -> a dcpc LocalGroup (threads,
``local`` backend) or gloo processes with the coordinator's attributes (``torch``
backend); CUDA -> CPU; 2 and 4 ranks -> 2 and 3; CUDA-graph capture + 3 replays -> 3
eager calls with the same inputs (the "replay identity" is then that of repeated calls
on reused buffers). SGLang's Triton sparse decode kernel (its attention, not a
collective) -> ``attend`` below, fp32 torch attention with the attention sink over the
same indices; the top-k candidate selection and merge (SGLang's index kernels, not
collectives) -> every valid index of the row (``global_lens``), sharded as SGLang's
(token t on rank t mod W, the sink shifted by -log W per rank). Sizes: version 1's
(2 local heads, width 67). The query gather is checked through dcpc's
all_gather_q_for_mla_decode (SGLang's test calls its coordinator's all_gather).
Not ported: the packed/combined-q top-k assertions of version 2 (SGLang's index
kernels, no dcpc counterpart).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def attend(q: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, sink: torch.Tensor,
           scale: float, stride: int = 1, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, H, D] over rows ``offset::stride`` of ``kv`` [N, D] (K = V) below
    each row's length, with the sink's logit in the denominator; (out [B, H, D] bf16,
    natural-base LSE [B, H] fp32 including the sink)."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        keys = kv[offset:int(lens[b]):stride].float() if int(lens[b]) > offset \
            else kv[:0].float()
        logits = torch.einsum("hd,nd->hn", q[b].float(), keys) * scale
        full = torch.cat([logits, sink.float().unsqueeze(1)], dim=1)
        lse = torch.logsumexp(full, dim=1)
        weights = torch.exp(logits - lse.unsqueeze(1))
        outs.append(weights @ keys)
        lses.append(lse)
    return torch.stack(outs).to(torch.bfloat16), torch.stack(lses)


def _inputs(world: int) -> dict[str, Any]:
    batch, local_heads, head_dim, width = 3, 2, 512, 67
    g = torch.Generator().manual_seed(20260819)
    global_heads = local_heads * world
    return {
        "q": torch.randn(batch, global_heads, head_dim, generator=g).bfloat16(),
        "kv": torch.randn(width, head_dim, generator=g).bfloat16(),
        "lens": torch.tensor([17, 53, width]),
        "sink": torch.randn(global_heads, generator=g),
        "local_heads": local_heads, "batch": batch, "head_dim": head_dim,
    }


def run_all(group: Any, r: int, world: int, barrier: Any) -> dict[str, Any]:
    from dcpc.engines import sglang as S

    x = _inputs(world)
    lh, batch, head_dim = x["local_heads"], x["batch"], x["head_dim"]
    q_global = x["q"]
    local_q = q_global[:, r * lh:(r + 1) * lh]
    q_nope, q_pe = S.all_gather_q_for_mla_decode(local_q[..., 64:].contiguous(),
                                                 local_q[..., :64].contiguous(), group)
    gathered_q = torch.cat([q_pe, q_nope], dim=-1)
    torch.testing.assert_close(gathered_q, q_global)
    barrier()  # the gathered views are read before the next gather reuses them

    scale = head_dim ** -0.5
    reference_out, _ = attend(q_global, x["kv"], x["lens"], x["sink"], scale)
    reference_local = reference_out[:, r * lh:(r + 1) * lh]
    shifted_sink = x["sink"] - math.log(world)
    partial_out, partial_lse = attend(q_global, x["kv"], x["lens"], shifted_sink, scale,
                                      stride=world, offset=r)

    ag_rs = S.cp_lse_ag_out_rs_mla(partial_out, partial_lse.clone(), group,
                                   is_lse_base_on_e=True).transpose(0, 1).contiguous()
    barrier()
    a2a = S.dcp_a2a_lse_reduce(partial_out.clone(), partial_lse.clone(), group,
                               is_lse_base_on_e=True, comm_backend="a2a").clone()
    barrier()
    torch.testing.assert_close(ag_rs.float(), reference_local.float(), atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(a2a.float(), reference_local.float(), atol=4e-2, rtol=4e-2)
    torch.testing.assert_close(a2a.float(), ag_rs.float(), atol=3e-2, rtol=3e-2)
    assert ag_rs.is_contiguous()
    ag_rs.view(batch, -1)

    replay_results = []
    for _ in range(3):  # the graph replays -> eager calls on the reused buffers
        got = S.cp_lse_ag_out_rs_mla(partial_out.clone(), partial_lse.clone(), group,
                                     is_lse_base_on_e=True).transpose(0, 1).contiguous()
        replay_results.append(got.clone())
        barrier()
    for replay_result in replay_results:
        torch.testing.assert_close(replay_result.float(), ag_rs.float(), atol=3e-2, rtol=3e-2)
        assert replay_result.is_contiguous()
        replay_result.view(batch, -1)
    for replay_result in replay_results[1:]:
        torch.testing.assert_close(replay_result, replay_results[0], atol=0, rtol=0)
    err = float((ag_rs.double() - reference_local.double()).abs().max())
    return {"sglang_dsv4": "ok", "ag_rs_err": err}
