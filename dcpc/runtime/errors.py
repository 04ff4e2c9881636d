"""Errors raised by generated modules at run time (no compiler imports here)."""

from __future__ import annotations


class DcpcError(RuntimeError):
    """Base of every run-time error of a generated module."""


class DcpcTimeoutError(DcpcError):
    """A bounded spin loop expired: a peer never signalled the epoch we waited for."""

    def __init__(self, step: str, peer: int, epoch: int, rank: int | None = None):
        self.step, self.peer, self.epoch, self.rank = step, peer, epoch, rank
        who = f"rank {rank}" if rank is not None else "this rank"
        super().__init__(
            f"step '{step}': {who} timed out waiting for peer {peer} to signal epoch {epoch}; "
            "the peer did not reach this step (a missing call, a different call order or a "
            "crashed process); the module's signal state is now unusable: close() it"
        )


class DcpcArgumentError(ValueError):
    """An argument of a generated method is not what the schedule declares."""
