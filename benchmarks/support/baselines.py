"""Baselines the generated code must beat, in the same run: NCCL paths with fused Triton math.

- nccl_gather: all_gather_into_tensor + the copy into the heads-major final layout.
- nccl_agrs_fused: LSE all-gather (NCCL), ONE Triton kernel (LSE over W, mask, scale the
  local output, write it in reduce-scatter layout), reduce_scatter_tensor (NCCL).
- nccl_a2a_fused: layout copies, all_to_all_single of output and LSE, ONE Triton merge kernel.
- signal floor: one tiny kernel that signals every peer and waits (shared/lab/baselines.py).
- peer copy: copy engine into the peers' symmetric buffers.
The Triton kernels implement domain.md's masks (interleave 1) and run under
TRITON_INTERPRET=1 too, which is how the CPU dry run checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from benchmarks.support.reference import DV, D


@triton.jit
def _row_request(seq_lens, qsl, t, B, BLOCK_B: tl.constexpr):
    """(seq_len of row t's request, row t is a real row) via searchsorted(qsl[1:], t, right)."""
    offs = tl.arange(0, BLOCK_B)
    ends = tl.load(qsl + 1 + offs, mask=offs < B, other=2147483647)
    req = tl.sum((ends <= t).to(tl.int32), axis=0)
    total = tl.load(qsl + B)
    real = (t < total) & (req < B)
    sl = tl.load(seq_lens + tl.minimum(req, B - 1))
    return sl, real


@triton.jit
def _masked_lse(ptrs, sl, real, p: tl.constexpr, W: tl.constexpr, hmask):
    """LSE of rank p's partial, -inf if p's shard is empty, the row is padding, NaN or +inf."""
    x = tl.load(ptrs, mask=hmask, other=float("-inf"))
    base = sl // W
    local = base + tl.minimum(tl.maximum(sl - base * W - p, 0), 1)
    ok = real & (local > 0) & (x == x) & (x != float("inf"))
    return tl.where(ok, x, float("-inf"))


@triton.jit
def _merged_lse(ptrs, stride_p, sl, real, W: tl.constexpr, hmask, BLOCK_H: tl.constexpr):
    """LSE = m + log(sum_p exp(lse_p - m)) over the W masked partials at ptrs + p * stride_p
    (m = max_p lse_p, 0 when all are -inf): the merge both baselines share."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for p in tl.static_range(W):
        m = tl.maximum(m, _masked_lse(ptrs + p * stride_p, sl, real, p, W, hmask))
    m = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros([BLOCK_H], tl.float32)
    for p in tl.static_range(W):
        s += tl.exp(_masked_lse(ptrs + p * stride_p, sl, real, p, W, hmask) - m)
    return m + tl.log(s)


@triton.jit
def agrs_correct_kernel(o_ptr, lse_all_ptr, seq_lens, qsl, oc_ptr, T, B,
                        RANK: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                        HL: tl.constexpr, DV_: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_B: tl.constexpr):
    """oc[j, t, h - j*HL] = exp(lse_RANK - LSE) * o[t, h] (0 where weight 0), j = h // HL."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    sl, real = _row_request(seq_lens, qsl, t, B, BLOCK_B)
    total = _merged_lse(lse_all_ptr + t * H + heads, T * H, sl, real, W, hmask, BLOCK_H)
    mine = _masked_lse(lse_all_ptr + (RANK * T + t) * H + heads, sl, real, RANK, W, hmask)
    w = tl.where(mine == float("-inf"), 0.0, tl.exp(mine - total))
    d = tl.arange(0, DV_)
    o = tl.load(o_ptr + (t * H + heads)[:, None] * DV_ + d[None, :], mask=hmask[:, None],
                other=0.0).to(tl.float32)
    val = tl.where(w[:, None] > 0, o * w[:, None], 0.0)
    row = ((heads // HL) * T + t) * HL + heads % HL
    tl.store(oc_ptr + row[:, None] * DV_ + d[None, :], val.to(tl.bfloat16),
             mask=hmask[:, None])


@triton.jit
def a2a_merge_kernel(recv_o, recv_l, seq_lens, qsl, out_ptr, T, B,
                     W: tl.constexpr, HL: tl.constexpr, DV_: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[t, h] = sum_p exp(lse_p - LSE) o_p over recv [W, T, HL, DV], masks applied."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HL
    sl, real = _row_request(seq_lens, qsl, t, B, BLOCK_B)
    total = _merged_lse(recv_l + t * HL + heads, T * HL, sl, real, W, hmask, BLOCK_H)
    d = tl.arange(0, DV_)
    acc = tl.zeros([BLOCK_H, DV_], tl.float32)
    for p in tl.static_range(W):
        x = _masked_lse(recv_l + (p * T + t) * HL + heads, sl, real, p, W, hmask)
        w = tl.where(x == float("-inf"), 0.0, tl.exp(x - total))
        o = tl.load(recv_o + ((p * T + t) * HL + heads)[:, None] * DV_ + d[None, :],
                    mask=hmask[:, None], other=0.0).to(tl.float32)
        acc += tl.where(w[:, None] > 0, o * w[:, None], 0.0)
    tl.store(out_ptr + (t * HL + heads)[:, None] * DV_ + d[None, :], acc.to(tl.bfloat16),
             mask=hmask[:, None])


@triton.jit
def signal_floor_kernel(sigs, epochs, CH: tl.constexpr, RANK: tl.constexpr,
                        WORLD: tl.constexpr, NP: tl.constexpr):
    """Signal every peer, wait for every peer: the floor of any exchange kernel."""
    pid = tl.program_id(0)
    ep = tl.load(epochs + CH * NP + pid) + 1
    tl.store(epochs + CH * NP + pid, ep)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD):
        s = tl.load(sigs + peer).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(s + (CH * WORLD + RANK) * NP + pid, ep, sem="release", scope="sys")
    me = tl.load(sigs + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        while tl.atomic_add(me + (CH * WORLD + peer) * NP + pid, 0, sem="acquire",
                            scope="sys") < ep:
            pass
    tl.debug_barrier()


def _blocks(heads: int, B: int) -> tuple[int, int]:
    return min(16, triton.next_power_of_2(max(1, heads))), triton.next_power_of_2(max(1, B))


def nccl_gather(q_local: torch.Tensor, H: int) -> tuple[Callable[[], None], torch.Tensor]:
    """all_gather_into_tensor [W, T, hl, D] + copy into q_full [T, H, D]; returns (fn, q_full)."""
    T, hl, _ = q_local.shape
    W = H // hl
    stage = torch.empty(W, T, hl, D, dtype=q_local.dtype, device=q_local.device)
    q_full = torch.empty(T, H, D, dtype=q_local.dtype, device=q_local.device)

    def fn() -> None:
        dist.all_gather_into_tensor(stage.flatten(0, 1), q_local)
        q_full.view(T, W, hl, D).copy_(stage.transpose(0, 1))

    return fn, q_full


def nccl_agrs_fused(o: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor,
                    qsl: torch.Tensor, rank: int, W: int
                    ) -> tuple[Callable[[], None], torch.Tensor]:
    """LSE all-gather + one fused correction kernel + reduce_scatter; returns (fn, out)."""
    T, H, _ = o.shape
    hl = H // W
    B = seq_lens.numel()
    lse_all = torch.empty(W, T, H, dtype=torch.float32, device=o.device)
    oc = torch.empty(W, T, hl, DV, dtype=torch.bfloat16, device=o.device)
    out = torch.empty(T, hl, DV, dtype=torch.bfloat16, device=o.device)
    block_h, block_b = _blocks(H, B)
    grid = (T, triton.cdiv(H, block_h))

    def fn() -> None:
        dist.all_gather_into_tensor(lse_all.flatten(0, 1), lse)
        agrs_correct_kernel[grid](o, lse_all, seq_lens, qsl, oc, T, B, RANK=rank, W=W, H=H,
                                  HL=hl, DV_=DV, BLOCK_H=block_h, BLOCK_B=block_b,
                                  num_warps=4)
        dist.reduce_scatter_tensor(out, oc.flatten(0, 1))

    return fn, out


def nccl_a2a_fused(o: torch.Tensor, lse: torch.Tensor, seq_lens: torch.Tensor,
                   qsl: torch.Tensor, W: int) -> tuple[Callable[[], None], torch.Tensor]:
    """Layout copies + all_to_all_single (output, LSE) + one fused merge; returns (fn, out)."""
    T, H, _ = o.shape
    hl = H // W
    B = seq_lens.numel()
    send_o = torch.empty(W, T, hl, DV, dtype=torch.bfloat16, device=o.device)
    recv_o = torch.empty_like(send_o)
    send_l = torch.empty(W, T, hl, dtype=torch.float32, device=o.device)
    recv_l = torch.empty_like(send_l)
    out = torch.empty(T, hl, DV, dtype=torch.bfloat16, device=o.device)
    block_h, block_b = _blocks(hl, B)
    grid = (T, triton.cdiv(hl, block_h))

    def fn() -> None:
        send_o.copy_(o.view(T, W, hl, DV).transpose(0, 1))
        send_l.copy_(lse.view(T, W, hl).transpose(0, 1))
        dist.all_to_all_single(recv_o, send_o)
        dist.all_to_all_single(recv_l, send_l)
        a2a_merge_kernel[grid](recv_o, recv_l, seq_lens, qsl, out, T, B, W=W, HL=hl, DV_=DV,
                               BLOCK_H=block_h, BLOCK_B=block_b, num_warps=4)

    return fn, out


class SymmScratch:
    """Symmetric buffers of our own for the signal floor and the peer-copy bandwidth."""

    NPROG = 32

    def __init__(self, rank: int, world: int, device: torch.device, copy_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        self.rank, self.world = rank, world
        self.sig = symm_mem.empty(4 * world * self.NPROG, dtype=torch.int32, device=device)
        self.sig.zero_()
        self.sig_handle = symm_mem.rendezvous(self.sig, group_name)
        self.sig_ptrs = torch.tensor([p + self.sig_handle.offset
                                      for p in self.sig_handle.buffer_ptrs],
                                     dtype=torch.int64, device=device)
        self.epochs = torch.zeros(4 * self.NPROG, dtype=torch.int32, device=device)
        self.copy_elems = copy_bytes // 2
        self.buf = symm_mem.empty(world * self.copy_elems, dtype=torch.bfloat16, device=device)
        self.buf_handle = symm_mem.rendezvous(self.buf, group_name)
        self.src = torch.randn(self.copy_elems, device=device).to(torch.bfloat16)
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])

    def floor_fn(self) -> Callable[[], None]:
        """One launch: signal every peer and wait for all (channel 0, one program)."""

        def fn() -> None:
            signal_floor_kernel[(1,)](self.sig_ptrs, self.epochs, CH=0, RANK=self.rank,
                                      WORLD=self.world, NP=self.NPROG, num_warps=1)

        return fn

    def peer_copy_fn(self, nbytes: int) -> Callable[[], None]:
        """Copy ``nbytes`` into every peer's buffer (region ``rank``): copy engine, NVLink."""
        n = min(nbytes // 2, self.copy_elems)
        views: list[Any] = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            whole = self.buf_handle.get_buffer(peer, (self.world * self.copy_elems,),
                                               torch.bfloat16)
            views.append(whole[self.rank * self.copy_elems: self.rank * self.copy_elems + n])
        src = self.src[:n]

        def fn() -> None:
            for v in views:
                v.copy_(src, non_blocking=True)

        return fn
