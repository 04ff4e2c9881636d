"""The adapters' fallback in torch: the collectives over the DCP group (torch.distributed
for a ProcessGroup, the threads' exchange for a dcpc LocalRank) and vLLM's math in
fp32 (the source mask, the correction, the merge). Used for every call no dcpc module
takes (docs/engines.md, "Which path runs")."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from dcpc.engines.common import Group
from dcpc.runtime import merge
from dcpc.runtime.collectives import wire
from dcpc.runtime.local import LocalRank, sync_stream

NEG_INF = float("-inf")


# ---- collectives for the fallback ---------------------------------------------------------
_exchanges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Comm:
    """all_gather / all_to_all over the group, for the torch fallback: torch.distributed
    for a ProcessGroup, a shared table and the group's barrier for a dcpc LocalRank."""

    def __init__(self, group: Group):
        self.group = group

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[W, *t.shape]: every rank's ``t`` in rank order."""
        t = t.contiguous()
        if self.group.world == 1:
            return t.unsqueeze(0)
        if isinstance(self.group.handle, LocalRank):
            return torch.stack(self._local([t] * self.group.world))
        out = torch.empty(self.group.world * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(wire(out), wire(t.reshape(-1)), group=self.group.handle)
        return out.view(self.group.world, *t.shape)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [W, ...]: part j goes to rank j; returns [W, ...] with rank p's part at p."""
        t = t.contiguous()
        if self.group.world == 1:
            return t.clone()
        if isinstance(self.group.handle, LocalRank):
            return torch.stack(self._local(list(t.unbind(0))))
        out = torch.empty_like(t)
        dist.all_to_all_single(wire(out), wire(t), group=self.group.handle)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.all_gather(t).sum(0, dtype=t.dtype)

    def _local(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Threads of a LocalGroup: rank r posts part j for rank j, all arrive, each
        takes what was posted for it, all arrive again (the table is then reused)."""
        rank: LocalRank = self.group.handle
        table = _exchanges.setdefault(rank.group, {})
        table[rank.rank] = [p.clone() for p in parts]
        rank.barrier()  # syncs this stream first: the clones are done before a peer reads
        got = [table[p][rank.rank].clone() for p in range(rank.world)]
        sync_stream(parts[0].device)  # read before the owner frees or reposts its clones
        rank.group.barrier()
        return got


# ---- the math, in torch (fp32) ------------------------------------------------------------
def mask_at_source(lse: torch.Tensor, seq_lens: torch.Tensor,
                   qsl: torch.Tensor) -> torch.Tensor:
    """vLLM's mask_dcp_empty_shards_, out of place: rows at or past qsl[-1] and rows of
    requests with this rank's local length 0 get -inf (every row when B is 0)."""
    tokens, batch = lse.shape[0], seq_lens.shape[0]
    if batch == 0:
        return torch.full_like(lse, NEG_INF)
    rows = torch.arange(tokens, device=lse.device, dtype=qsl.dtype)
    req = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=batch - 1)
    dead = (rows >= qsl[-1]) | (seq_lens[req] == 0)
    return lse.masked_fill(dead.reshape(-1, *([1] * (lse.dim() - 1))), NEG_INF)


def correct(out: torch.Tensor, lses: torch.Tensor, rank: int, base2: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's correct_attn_out in fp32: (out * w_rank, 0 where the weight is 0 (NaN
    partials of empty shards included); G [B, H]). The weights are dcpc.runtime.merge's,
    relative to the running max (never exp(lse_rank - G): G is rounded to ulp(G))."""
    w, total = merge.merge_weights(lses.float(), "2" if base2 else "e")
    f = w[rank].unsqueeze(-1)
    return torch.where(f == 0, 0.0, out.float() * f), total


def a2a_merge(recv_o: torch.Tensor, recv_lse: torch.Tensor, base2: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge after the all-to-all, in fp32: (sum_p w_p * o_p [B, H/W, D], G [B, H/W])
    from recv_o [W, B, H/W, D] and recv_lse [W, B, H/W]; a partial of weight 0 adds 0
    (its NaN output included)."""
    w, total = merge.merge_weights(recv_lse.float(), "2" if base2 else "e")
    w = w.unsqueeze(-1)
    return torch.where(w == 0, 0.0, w * recv_o.float()).sum(0), total


def torch_combine(comm: Comm, path: str, o: torch.Tensor, lse: torch.Tensor, base2: bool,
                  out_dtype: torch.dtype, all_heads: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine over torch collectives (LSE already masked at the source):
    (out [B, H/W, D] in ``out_dtype``, G of this rank's heads [B, H/W] f32); with
    ``all_heads`` (vLLM's cp_lse_ag_out_ar) an all-reduce: [B, H, D] and G [B, H]."""
    world, rank = comm.group.world, comm.group.rank
    tokens, heads = lse.shape
    part = heads // world
    if o.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        o = o.float()  # fp8 partials: collectives (gloo) may not move fp8
    if path == "ag_rs" or all_heads:
        lses = comm.all_gather(lse.float())
        fixed, total = correct(o, lses, rank, base2)
        if all_heads:
            return comm.all_reduce(fixed).to(out_dtype), total
        parts = fixed.reshape(tokens, world, part, -1).transpose(0, 1)
        out = comm.all_to_all(parts).sum(0)
        return out.to(out_dtype), total[:, rank * part:(rank + 1) * part]
    recv_o = comm.all_to_all(o.reshape(tokens, world, part, -1).transpose(0, 1))
    recv_lse = comm.all_to_all(lse.float().reshape(tokens, world, part).transpose(0, 1))
    out, total = a2a_merge(recv_o, recv_lse, base2)
    return out.to(out_dtype), total
