"""SymmMemHeap: symmetric memory on CUDA through torch.distributed._symmetric_memory.

One ``symm_mem.empty`` allocation per heap, sub-allocated 256-byte aligned; every
peer's address is ``handle.buffer_ptrs[r] + handle.offset + sub-offset``. torch's own
signal pad is never touched (torch's barrier relies on it staying zero): generated
modules keep their signals in a buffer of this heap.
"""

from __future__ import annotations

from typing import Any

import torch

from dcpc.runtime.heap import Segment, SymmetricBuffer, aligned_offsets, poison_

# Closed heaps' allocations, kept for the life of the process. torch caches rendezvous
# handles by device address: a freed symmetric buffer whose address the allocator hands
# out again would come back with the OLD handle, i.e. stale peer mappings, and signals
# would land in a peer's freed memory (seen on 2xH200 as hangs after a few dozen
# instances were closed and re-created, torch 2.11). Never freeing is the safe choice.
_RETIRED: list[tuple[torch.Tensor, Any]] = []


class SymmMemHeap:
    def __init__(self, group: Any, device: torch.device, poison: bool = False):
        import torch.distributed as dist

        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = torch.device(device)
        self.poison = poison
        self._buffer: torch.Tensor | None = None
        self._handle: Any = None

    def allocate(self, nbytes: list[int]) -> list[SymmetricBuffer]:
        import torch.distributed._symmetric_memory as symm_mem

        if self._buffer is not None:
            raise RuntimeError("allocate() is called once per heap")
        offsets, total = aligned_offsets(nbytes)
        self._buffer = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
        if self.poison:
            poison_(self._buffer)
        else:
            self._buffer.zero_()
        self._handle = symm_mem.rendezvous(self._buffer, self.group.group_name)  # type: ignore[union-attr]
        base = [int(p) + int(self._handle.offset) for p in self._handle.buffer_ptrs]
        out: list[SymmetricBuffer] = []
        for off, n in zip(offsets, nbytes, strict=True):
            ptrs = torch.tensor([b + off for b in base], dtype=torch.int64, device=self.device)
            out.append(Segment(self._buffer[off : off + n], ptrs))
        torch.cuda.synchronize(self.device)
        self.barrier()
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def close(self) -> None:
        """Drop this heap's views. The memory is retired, not freed (see ``_RETIRED``)."""
        if self._buffer is not None:
            _RETIRED.append((self._buffer, self._handle))
        self._handle = None
        self._buffer = None
