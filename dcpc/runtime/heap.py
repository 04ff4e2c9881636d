"""Symmetric heaps: one buffer instance per rank, every rank's address known to all.

A generated module allocates every symmetric buffer (all slots) and its signal bank
with ONE collective ``heap.allocate([...])`` call at construction. Backends:

- ``symm_mem``: ``dcpc.runtime.symm.SymmMemHeap`` (CUDA, torch symmetric memory);
- ``host``: ``dcpc.runtime.host.HostHeap`` (CPU processes sharing memory);
- ``local``: ``dcpc.runtime.local.LocalThreadHeap`` (W ranks as threads of one process,
  one device: tests and one-GPU benchmarks);
- ``torch`` (and any single-rank group): ``LocalHeap``, plain local tensors; kernels
  may only address this rank's instance (``peer_ptrs`` holds 0 for other ranks).

Which backend a group gets, and building its heap, is ``dcpc.runtime.backend`` (it
imports the backends; they import this module's types, so this one imports none).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

ALIGN = 256


@runtime_checkable
class SymmetricBuffer(Protocol):
    local: torch.Tensor  # uint8, this rank's instance
    peer_ptrs: torch.Tensor  # int64 [W] on the device: every rank's instance, in this process

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...


@runtime_checkable
class SymmetricHeap(Protocol):
    rank: int
    world: int
    device: torch.device

    def allocate(self, nbytes: list[int]) -> list[SymmetricBuffer]: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...


class Segment:
    """A sub-range of a heap's allocation: the local instance plus every peer's address."""

    def __init__(self, local: torch.Tensor, peer_ptrs: torch.Tensor):
        self.local = local
        self.peer_ptrs = peer_ptrs

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.local[: n * itemsize].view(dtype).view(shape)


def aligned_offsets(nbytes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of each request in one allocation (``align``-byte aligned) and the total."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-max(n, 1) // align) * align
    return offsets, max(total, align)


def poison_(t: torch.Tensor) -> None:
    """Fill with 0xFF bytes: NaN for every float dtype, -1 for integers."""
    if t.is_contiguous():
        t.view(torch.uint8).fill_(0xFF)
    else:  # an integer holds no NaN: -1 is its 0xFF bytes
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)


class LocalHeap:
    """Plain local memory: for the torch backend and for single-rank groups."""

    def __init__(self, rank: int, world: int, device: torch.device, poison: bool = False):
        self.rank, self.world, self.device, self.poison = rank, world, device, poison
        self._storage: torch.Tensor | None = None

    def allocate(self, nbytes: list[int]) -> list[SymmetricBuffer]:
        if self._storage is not None:
            raise RuntimeError("allocate() is called once per heap")
        offsets, total = aligned_offsets(nbytes)
        self._storage = torch.zeros(total + ALIGN, dtype=torch.uint8, device=self.device)
        shift = (-self._storage.data_ptr()) % ALIGN
        base = self._storage[shift : shift + total]
        if self.poison:
            poison_(base)
        out: list[SymmetricBuffer] = []
        for off, n in zip(offsets, nbytes, strict=True):
            local = base[off : off + n]
            ptrs = torch.zeros(self.world, dtype=torch.int64)
            ptrs[self.rank] = local.data_ptr()
            out.append(Segment(local, ptrs.to(self.device)))
        return out

    def barrier(self) -> None:
        """Nothing to order: a local heap has no peers."""

    def close(self) -> None:
        self._storage = None

