"""The signal bank of a generated module: signal slots, epochs and the error record.

Layout (docs/internals.md):

- ``sig``: ONE symmetric int32 buffer ``[channel, src_rank, program]``; channel =
  ``step_index * slots + slot``. A producer stores its epoch, with release semantics,
  into ``sig[channel, producer_rank, program]`` of every consumer.
- ``epochs``: local int32 ``[channel, program]``; each program of a kernel advances
  its own counter (in device memory, never from the host: CUDA-graph replay works)
  and waits until ``(int32)(got - epoch) >= 0``.
- ``errors``: local int32 ``[4]`` = (code, step index, peer, epoch) of the first
  expired spin loop. On GPU the kernel then traps; on CPU it returns and the method
  raises ``DcpcTimeoutError`` (``check_errors``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dcpc.runtime.errors import DcpcError, DcpcTimeoutError
from dcpc.runtime.heap import SymmetricBuffer

TIMEOUT = 1  # error code: a spin loop expired
ERROR_WORDS = 4
INT32_MAX = 2**31 - 1


def channel(step_index: int, slot: int, slots: int) -> int:
    return step_index * slots + slot


def signal_nbytes(channels: int, world: int, programs: int) -> int:
    return channels * world * programs * 4


def wrap_int32(value: int) -> int:
    """``value`` as a two's-complement int32 (epochs wrap; comparisons are wrap-safe)."""
    return (value + 2**31) % 2**32 - 2**31


class SignalBank:
    """Signal slots (symmetric), epochs and the error record of one module instance."""

    def __init__(
        self,
        segment: SymmetricBuffer,
        channels: int,
        world: int,
        programs: int,
        device: torch.device,
        epoch_start: int = 0,
    ):
        if not -(2**31) <= epoch_start <= INT32_MAX:
            raise ValueError(f"epoch_start must fit in int32, got {epoch_start}")
        self.channels, self.world, self.programs = channels, world, programs
        self.sig = segment.view(torch.int32, (channels, world, programs))
        self.sig_ptrs = segment.peer_ptrs
        # Every slot starts at epoch_start: the first wait is for epoch_start + 1.
        self.sig.fill_(epoch_start)
        self.epochs = torch.full(
            (channels, programs), epoch_start, dtype=torch.int32, device=device
        )
        self.errors = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)

    def check_errors(self, step_names: Sequence[str], rank: int | None = None) -> None:
        """Raise the error recorded by a kernel, if any (reads device memory: a host sync)."""
        code, step, peer, epoch = (int(v) for v in self.errors.tolist())
        if code == 0:
            return
        name = step_names[step] if 0 <= step < len(step_names) else f"#{step}"
        if code == TIMEOUT:
            raise DcpcTimeoutError(name, peer, epoch, rank)
        raise DcpcError(f"step '{name}': kernel error code {code} (peer {peer}, epoch {epoch})")
