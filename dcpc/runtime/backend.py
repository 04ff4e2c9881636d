"""Which heap backend a group gets, and the heap for it (``make_heap``).

Apart from ``dcpc.runtime.heap`` (the protocol, ``LocalHeap`` and the helpers the
backends share) because this module imports the backends and they import heap's types.
"""

from __future__ import annotations

from typing import Any

import torch

from dcpc.runtime.heap import LocalHeap


def _is_local(group: Any) -> bool:
    """A rank of ``dcpc.runtime.local.LocalGroup`` (threads of this process)."""
    from dcpc.runtime.local import LocalRank

    return isinstance(group, LocalRank)


def group_rank_world(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (None: a single rank)."""
    if group is None:
        return 0, 1
    if _is_local(group):
        return group.rank, group.world
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def resolve_backend(backend: str, group: Any, device: torch.device) -> str:
    """``auto`` -> symm_mem (CUDA, one host), host (CPU, host heap installed), else torch."""
    if backend not in ("auto", "symm_mem", "host", "torch", "local"):
        raise ValueError(
            f"backend must be auto, symm_mem, host, torch or local, not {backend!r}")
    if _is_local(group) != (backend == "local") and backend != "auto":
        raise ValueError("backend 'local' takes a dcpc.runtime.local.LocalRank as group, and "
                         f"a LocalRank needs backend 'local' (got {backend!r})")
    if backend != "auto":
        return backend
    if _is_local(group):
        return "local"
    if device.type == "cpu":
        try:
            import dcpc.runtime.host  # noqa: F401
        except ImportError:
            return "torch"
        return "host"
    if device.type == "cuda" and _one_host(group):
        try:
            import torch.distributed._symmetric_memory  # noqa: F401
        except ImportError:
            return "torch"
        return "symm_mem"
    return "torch"


def _one_host(group: Any) -> bool:
    """Every rank of the group runs on this machine (peer pointers can reach them)."""
    _, world = group_rank_world(group)
    if world == 1:
        return True
    import socket

    import torch.distributed as dist

    names: list[Any] = [None] * world
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return len(set(names)) == 1


def make_heap(backend: str, group: Any, device: torch.device, poison: bool = False) -> Any:
    """The heap for a resolved backend. A single-rank group needs no shared memory."""
    rank, world = group_rank_world(group)
    if backend == "torch" or world == 1:
        return LocalHeap(rank, world, device, poison)
    if backend == "host":
        from dcpc.runtime.host import HostHeap

        return HostHeap(group, device, poison=poison)
    if backend == "symm_mem":
        from dcpc.runtime.symm import SymmMemHeap

        return SymmMemHeap(group, device, poison=poison)
    if backend == "local":
        from dcpc.runtime.local import LocalThreadHeap

        return LocalThreadHeap(group, device, poison=poison)
    raise ValueError(f"no heap for backend {backend!r}")
