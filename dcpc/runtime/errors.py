"""Errors raised by generated modules at run time (no compiler imports here).

Every error a call raises (these, or anything else) marks the module instance failed:
later calls on that rank raise ``DcpcFailedError`` naming the first error, and peers
learn it through their waits (docs/engines.md, "The run-time guard").
"""

from __future__ import annotations


class DcpcError(RuntimeError):
    """Base of every run-time error of a generated module."""


class DcpcTimeoutError(DcpcError):
    """A bounded wait expired: a peer never signalled the epoch we waited for."""

    def __init__(
        self,
        step: str,
        peer: int,
        epoch: int,
        rank: int | None = None,
        seconds: float | None = None,
    ):
        self.step, self.peer, self.epoch, self.rank = step, peer, epoch, rank
        who = f"rank {rank}" if rank is not None else "this rank"
        waited = f" (waited {seconds:g} s, timeout_s)" if seconds is not None else ""
        super().__init__(
            f"step '{step}': {who} timed out waiting for peer {peer} to signal epoch {epoch}"
            f"{waited}; the peer did not reach this step (a missing call, a different call "
            "order or a dead process); this module instance is now failed: close() it"
        )


class DcpcContractError(DcpcError):
    """The ranks broke the call-order contract the proof assumes (docs/engines.md).

    ``peer`` is None for a violation found on this rank alone (the call order)."""

    def __init__(self, step: str, message: str, peer: int | None = None):
        self.step, self.peer = step, peer
        super().__init__(message)


class DcpcPeerFailedError(DcpcError):
    """A peer's module instance failed (or was closed) while this rank waited for it."""

    def __init__(self, step: str, peer: int, epoch: int, rank: int | None, reason: str):
        self.step, self.peer, self.epoch, self.rank = step, peer, epoch, rank
        who = f"rank {rank}" if rank is not None else "this rank"
        super().__init__(
            f"step '{step}': {who} stopped waiting for peer {peer} (epoch {epoch}): peer {peer} "
            f"{reason}; this module instance is now failed: close() it"
        )


class DcpcConcurrentUseError(DcpcError):
    """A call on a module instance while another thread is inside a call of it."""


class DcpcFailedError(DcpcError):
    """A call on a module instance that failed earlier, or that was closed."""


class DcpcArgumentError(ValueError):
    """An argument of a generated method or constructor is not what is allowed."""
