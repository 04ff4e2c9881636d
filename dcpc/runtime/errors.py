"""Errors raised by generated modules at run time (no compiler imports here).

Every error a call raises (these, or anything else) marks the module instance failed:
later calls on that rank raise ``DcpcFailedError`` naming the first error, and peers
learn it through their waits (docs/engines.md, "The run-time guard").
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

# The error record of a module instance: ERROR_WORDS int32 words in device memory,
# written by the first kernel that fails (dcpc.runtime.device) and read by the host
# (dcpc.runtime.sync.SignalBank.check_errors). Word i holds RECORD[i]; the codes say
# what failed. For a failed wait: the step, the peer, the epoch waited for, this call's
# fingerprint ("here"), the one the peer's signal carried ("there"), the peer's failure
# flag. OVER_CAPACITY: "peer" the peer's rank, "epoch" the count, "here" the capacity,
# "there" 1 when the receiver found it, "flag" 1 + the peer's member index in a team
# step (its index into counts; 0: the whole group, where index and rank agree);
# BAD_INDEX: "peer" the token, "epoch" the row, "here" the rows; OUTSIDE_SLOT: "peer"
# the receiver's rank, "epoch" the row, "here" the capacity, "flag" as OVER_CAPACITY's;
# BAD_SCALE: "epoch" the scale's f32 bits. The CPU watchdog sets "stop" at a call's
# deadline (a kernel cannot read a clock there).
RECORD = ("code", "step", "peer", "epoch", "here", "there", "stop", "flag")
ERROR_WORDS = len(RECORD)
# The codes are defined once, in KERNEL_ERRORS (at the end of this file, with how the
# host raises each).
# A rank's failure flag, set in every peer's bank (flags[rank]): what a waiting peer reads.
FLAG_FAILED = 1
FLAG_CLOSED = 2
FLAG_DIED = 3  # written by a peer's watchdog, not by the rank: its process is gone


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


class DcpcCollectiveError(DcpcError):
    """torch backend: a collective of this rank's slot did not complete (a peer absent
    from it past ``timeout_s``, or gone). ``rank`` and ``peers`` are the module's ranks
    (a team op's collective runs over its team: ``peers`` are the other members; empty
    when unknown). ``step`` is filled in by the calling method."""

    def __init__(self, op: str, rank: int, slot: int, timeout: object, detail: str,
                 peers: tuple[int, ...] = ()):
        self.op, self.rank, self.slot, self.detail = op, rank, slot, detail
        self.peers = tuple(peers)
        self.seconds = getattr(timeout, "total_seconds", lambda: None)()
        self.step: str | None = None
        super().__init__(op, rank, slot, detail, self.peers)

    def __str__(self) -> str:
        step = f"step '{self.step}' " if self.step else ""
        timed_out = "timeout" in self.detail.lower() or "timed out" in self.detail.lower()
        waited = (f" within {self.seconds:g} s (timeout_s)"
                  if self.seconds is not None and timed_out else "")
        peers = self.peers
        who = (f"peer {peers[0]}" if len(peers) == 1 else
               f"one of peers {', '.join(map(str, peers))}" if peers else "a peer")
        with_ = f" with {'peer' if len(peers) == 1 else 'peers'} " + ", ".join(
            map(str, peers)) if peers else ""
        return (
            f"{step}(slot {self.slot}): rank {self.rank}'s {self.op}{with_} did not "
            f"complete{waited} (gloo: {self.detail}); {who} did not make the same call on "
            "this slot (a missing call, another step order in the slot, a dead process); "
            "this module instance is now failed: close() it"
        )


class DcpcConstructionError(DcpcError):
    """Construction's rendezvous did not meet every rank: ``missing`` maps each missing
    rank to why (not arrived within timeout_s, or gone)."""

    def __init__(self, owner: str, rank: int, missing: dict[int, str]):
        self.owner, self.rank, self.missing = owner, rank, dict(missing)
        ranks = sorted(missing)
        why = "; ".join(f"rank {p} {missing[p]}" for p in ranks)
        super().__init__(
            f"{owner}(): rank {rank} could not construct: missing rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ({why}); every "
            "rank of the group constructs the module at the same point; nothing was "
            "allocated on this rank"
        )


class DcpcConcurrentUseError(DcpcError):
    """A call on a module instance while another thread is inside a call of it."""


class DcpcFailedError(DcpcError):
    """A call on a module instance that failed earlier, or that was closed."""


class DcpcArgumentError(ValueError):
    """An argument of a generated method or constructor is not what is allowed."""


class DcpcScaleError(DcpcArgumentError):
    """A per-tensor fp8 scale (``output_scale``, a cast's ``per: tensor`` scale) that is
    not a positive finite normal f32 (dcpc.numerics.scale_fault says ``why``). The
    kernels record it (BAD_SCALE, dcpc.runtime.sync); the torch backend raises it before
    it writes. ``step``/``rank`` are filled in by the calling method when the raiser
    does not know them (dcpc.runtime.guard.guarded)."""

    def __init__(self, value: float, why: str, step: str | None = None,
                 rank: int | None = None):
        self.value, self.why, self.step, self.rank = value, why, step, rank
        super().__init__(value, why, step, rank)

    def __str__(self) -> str:
        step = f"step '{self.step}': " if self.step else ""
        who = f"rank {self.rank}" if self.rank is not None else "this rank"
        return (
            f"{step}{who}'s fp8 scale is {self.value!r} ({self.why}); a per-tensor fp8 "
            "scale must be a positive finite normal f32 (2**-126 <= scale <= 2**126); this "
            "call's output is not valid and this module instance is now failed: close() it"
        )


def over_capacity(step: str, rank: int | None, peer: int, count: int, capacity: int,
                  received: bool = False, index: int | None = None) -> DcpcArgumentError:
    """A ragged_all_to_all's count over its capacity or negative (nothing of that part
    was sent), as its sender (``counts[index]``, the rows for rank ``peer``) or its
    receiver (rank ``peer`` sent it) saw it. ``index``: the peer's member index in the
    step's team (None: the whole group, where it is ``peer``)."""
    who = f"rank {rank}" if rank is not None else "this rank"
    at = peer if index is None else index
    what = (f"peer {peer} routed {count} rows to {who}" if received
            else f"{who}'s counts[{at}] = {count}"
            + (f" (the rows for rank {peer})" if at != peer else ""))
    why = f"over the capacity {capacity}" if count >= 0 else "a negative count"
    return DcpcArgumentError(
        f"step '{step}': {what}, {why}; no row of that part was "
        "sent (never truncated) and this module instance is now failed: route "
        f"{'at most' if count >= 0 else '0 to'} capacity rows to each peer")


def bad_index(step: str, rank: int | None, token: int, row: int,
              rows: int) -> DcpcArgumentError:
    """A weighted_combine's index past the rows of its x (that slot was not read). The
    kernel records the row saturated into i32 (an i64 index): "row >= 2147483647"."""
    who = f"rank {rank}" if rank is not None else "this rank"
    said = f">= {row}" if row == 2**31 - 1 else row
    return DcpcArgumentError(
        f"step '{step}': {who}'s index of token {token} holds row {said}, past the {rows} "
        "rows of x; an index is a row of x, or negative for an empty slot")


def outside_slot(step: str, rank: int | None, peer: int, row: int, capacity: int,
                 index: int | None = None) -> DcpcArgumentError:
    """A ragged_all_to_all's ``index`` (the row a live row lands at in its destination
    slot, DeepEP's src_info) outside [0, capacity), in the part for rank ``peer``
    (``index``: that part's slot in counts; None: the peer's block): that row was not
    stored. The kernel records the row clamped into i32 (an i64 index): its ends read
    "at row >= 2147483647", "at row <= -2147483648"."""
    who = f"rank {rank}" if rank is not None else "this rank"
    at = f" (slot {index} of counts)" if index is not None and index != peer else ""
    said = f">= {row}" if row == 2**31 - 1 else f"<= {row}" if row == -(2**31) else row
    return DcpcArgumentError(
        f"step '{step}': {who}'s index places a row for rank {peer}{at} at row {said} of "
        f"its slot, outside [0, capacity {capacity}); that row was not stored and this "
        "module instance is now failed: an index is a row of the slot (DeepEP's "
        "src_info: the token's index on its owner, below num_max_dispatch_tokens_per_rank)")


def _bad_scale(step: str, rank: int | None, words: dict[str, int]) -> DcpcScaleError:
    from dcpc.numerics import scale_fault

    value = struct.unpack("<f", struct.pack("<i", words["epoch"]))[0]
    return DcpcScaleError(value, scale_fault(value) or "refused", step, rank)


@dataclass(frozen=True)
class KernelError:
    """A code of the error record: its value, and how the host raises it from the
    record (``decode(step name, rank, words)``, ``words``: RECORD's name -> value); None:
    the signal/wait protocol's own, which dcpc.runtime.sync raises with what it knows of
    the call (fingerprints, the deadline, the peer's flag)."""

    code: int
    decode: Callable[[str, int | None, dict[str, int]], Exception] | None = None


# The error record's codes, defined once: the kernels see each as DCPC_<name>
# (dcpc.runtime.device makes them from this table, and dcpc.codegen.emit reads their
# names from it), and dcpc.runtime.sync.SignalBank.check_errors raises an op's code
# through its decode. A new op's code is one row here, its decode next to it.
KERNEL_ERRORS: dict[str, KernelError] = {
    # a wait expired (the deadline, or another program of this launch failed)
    "TIMEOUT": KernelError(1),
    # a peer's signal carried another call's fingerprint
    "CONTRACT": KernelError(2),
    # the peer's failure flag was set while we waited for it
    "PEER_FAILED": KernelError(3),
    # ragged_all_to_all: a count over capacity or < 0
    "OVER_CAPACITY": KernelError(4, lambda step, rank, w: over_capacity(
        step, rank, w["peer"], w["epoch"], w["here"], received=w["there"] == 1,
        index=w["flag"] - 1 if w["flag"] > 0 else None)),
    # weighted_combine: an index past the rows of x
    "BAD_INDEX": KernelError(5, lambda step, rank, w: bad_index(
        step, rank, w["peer"], w["epoch"], w["here"])),
    # a per-tensor fp8 scale that dcpc.numerics.scale_fault refuses
    "BAD_SCALE": KernelError(6, _bad_scale),
    # ragged_all_to_all with index: a row placed outside its slot's capacity
    "OUTSIDE_SLOT": KernelError(7, lambda step, rank, w: outside_slot(
        step, rank, w["peer"], w["epoch"], w["here"],
        index=w["flag"] - 1 if w["flag"] > 0 else None)),
}
