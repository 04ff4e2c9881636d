"""Stand-ins for the generated modules, for ``gpu.py --dry-run --fake`` before codegen exists.

One class serves every schedule: each step is plain torch.distributed collectives plus the
float64 reference math of support.reference (rounded as the real outputs are). It exercises the
benchmark's flow (binding by name, checks, tables), not the compiler.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from benchmarks.support.reference import DV, clean_lse, merge_ref, valid_mask


class FakeModule:
    """Implements every step name of the shipped schedules with collectives."""

    SCHEDULE = "fake"

    def __init__(self, group: Any, sizes: dict[str, int], device: torch.device | None = None,
                 backend: str = "torch", programs: int | None = None) -> None:
        self.group = group
        self.W = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.H = int(sizes.get("H", self.W))
        self.device = device
        self.state: dict[int, dict[str, torch.Tensor]] = {}

    def _slot(self, slot: int) -> dict[str, torch.Tensor]:
        return self.state.setdefault(slot, {})

    def query_gather(self, q_local: torch.Tensor, *, slot: int = 0) -> torch.Tensor:
        T, hl, D = q_local.shape
        buf = torch.empty(self.W, T, hl, D, dtype=q_local.dtype, device=q_local.device)
        dist.all_gather_into_tensor(buf.flatten(0, 1), q_local.contiguous(), group=self.group)
        q_full = buf.permute(1, 0, 2, 3).reshape(T, self.W * hl, D)
        self._slot(slot)["q_stage"] = q_full
        return q_full

    def query_copy(self, *, slot: int = 0) -> torch.Tensor:
        return self._slot(slot)["q_stage"].clone()

    def out_exchange(self, o_part: torch.Tensor, lse_part: torch.Tensor, *, slot: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        T, H, _ = o_part.shape
        hl = H // self.W
        send_o = o_part.view(T, self.W, hl, DV).transpose(0, 1).contiguous()
        send_l = lse_part.view(T, self.W, hl).transpose(0, 1).contiguous()
        recv_o, recv_l = torch.empty_like(send_o), torch.empty_like(send_l)
        dist.all_to_all_single(recv_o, send_o, group=self.group)
        dist.all_to_all_single(recv_l, send_l, group=self.group)
        self._slot(slot).update(o_recv=recv_o, lse_recv=recv_l)
        return recv_o, recv_l

    def merge(self, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, slot: int = 0
              ) -> torch.Tensor:
        st = self._slot(slot)
        T = st["o_recv"].shape[1]
        valid = valid_mask(seq_lens, query_start_loc, T, self.W)
        out, _ = merge_ref(st["o_recv"], st["lse_recv"], valid)
        return out.to(torch.bfloat16)

    def combine(self, o_part: torch.Tensor, lse_part: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, *, slot: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        recv_o, recv_l = self.out_exchange(o_part, lse_part, slot=slot)
        valid = valid_mask(seq_lens, query_start_loc, recv_o.shape[1], self.W)
        out, lse = merge_ref(recv_o, recv_l, valid)
        return out.to(torch.bfloat16), lse.float()

    def lse_gather(self, lse_part: torch.Tensor, *, slot: int = 0) -> torch.Tensor:
        lse_all = torch.empty(self.W, *lse_part.shape, dtype=lse_part.dtype,
                              device=lse_part.device)
        dist.all_gather_into_tensor(lse_all.flatten(0, 1), lse_part.contiguous(),
                                    group=self.group)
        self._slot(slot)["lse_all"] = lse_all
        return lse_all

    def correct(self, o_part: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, *, slot: int = 0) -> torch.Tensor:
        lse_all = self._slot(slot)["lse_all"]
        valid = valid_mask(seq_lens, query_start_loc, o_part.shape[0], self.W)
        lw = clean_lse(lse_all, valid)
        m = lw.amax(0)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        total = m + torch.log(torch.exp(lw - m).sum(0))
        mine = lw[self.rank]
        w = torch.where(torch.isneginf(mine), torch.zeros_like(mine), torch.exp(mine - total))
        o = torch.where(w[..., None] > 0, o_part.double(), torch.zeros((), dtype=torch.float64))
        o_corr = (w[..., None] * o).to(torch.bfloat16)
        self._slot(slot)["o_corr"] = o_corr
        return o_corr

    def out_scatter(self, *, slot: int = 0) -> torch.Tensor:
        o_corr = self._slot(slot)["o_corr"]
        T, H, _ = o_corr.shape
        hl = H // self.W
        send = o_corr.view(T, self.W, hl, DV).transpose(0, 1).contiguous().float()
        out = torch.empty(T, hl, DV, dtype=torch.float32, device=o_corr.device)
        dist.reduce_scatter_tensor(out, send.flatten(0, 1), group=self.group)
        return out.to(torch.bfloat16)

    def kv_gather(self, kv_local: torch.Tensor, *, slot: int = 0) -> torch.Tensor:
        N, K = kv_local.shape
        buf = torch.empty(self.W, N, K, dtype=kv_local.dtype, device=kv_local.device)
        dist.all_gather_into_tensor(buf.flatten(0, 1), kv_local.contiguous(), group=self.group)
        return buf.transpose(0, 1).reshape(self.W * N, K)

    def release(self, *, slot: int = 0) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        self.state.clear()
