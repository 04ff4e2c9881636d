"""The host side of the run-time guard (docs/engines.md, "The run-time guard").

- ``guarded``: the decorator on every generated method: one call at a time per instance
  (a second thread's call raises ``DcpcConcurrentUseError``); an error raised by a call
  marks the module instance failed (``ScheduleModule._fail``), then propagates.
- ``CallOrder``: per slot, the methods called since the call's first step; a step
  called before one the contract puts first in the same call raises.
- ``TorchHandshake``: the torch backend's fingerprint, failure notice and bounded
  wait, one small point-to-point message per peer before a communicating step (gloo
  only: on NCCL a bounded host wait would need a host sync every call).

The kernels' side (fingerprints in the signal words, failure flags, deadlines) is in
templates/sync.j2 and dcpc.runtime.sync.
"""

from __future__ import annotations

import functools
import threading
from _thread import get_ident
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from dcpc.runtime.errors import (
    DcpcCollectiveError,
    DcpcConcurrentUseError,
    DcpcContractError,
    DcpcError,
    DcpcPeerFailedError,
    DcpcScaleError,
    DcpcTimeoutError,
)
from dcpc.runtime.sync import FLAG_FAILED, FLAG_REASONS, Fingerprints

F = TypeVar("F", bound=Callable[..., Any])
NOTICE_WAIT = timedelta(seconds=2)  # how long a failing rank waits for its notices to leave


def guarded(method: F) -> F:
    """One call at a time per instance, and mark the instance failed when ``method``
    raises (any error: arguments, timeouts, contract errors, interrupts), so that later
    calls and peers' waits fail at once.

    A call while another thread is inside a call of the same instance (any slot: the
    instance's per-call state is shared) is refused with ``DcpcConcurrentUseError`` and
    fails the instance: that rank's calls no longer match its peers'. The check is one
    non-blocking lock acquire per call; threads that take turns (vLLM's DBO microbatch
    threads, which yield between calls) never see it."""
    name = method.__name__.removeprefix("_checked_")  # the public method's name

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        enter(self, name, kwargs.get("slot", 0), kwargs)
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if (isinstance(exc, RuntimeError) and not isinstance(exc, DcpcError)
                    and "gloo/" in str(exc)):  # issued, not waited (a Dcpc error says more)
                first = (str(exc).strip().splitlines() or ["?"])[0][:200]
                exc = DcpcCollectiveError("collective", self.rank, kwargs.get("slot", 0),
                                          None, first)
                exc.step = name
                self._fail(exc)
                raise exc from None
            if isinstance(exc, (DcpcCollectiveError, DcpcScaleError)) and exc.step is None:
                exc.step = name
            if isinstance(exc, DcpcScaleError) and exc.rank is None:
                exc.rank = self.rank
            self._fail(exc)
            raise
        finally:
            leave(self)

    return call  # type: ignore[return-value]


def enter(module: Any, name: str, slot: Any, kwargs: dict | None = None) -> None:
    """Start a call of ``module`` (``guarded``, and the fast path's replay in
    dcpc.runtime.calls): refused with ``DcpcConcurrentUseError`` while another thread is
    inside a call. The refused thread touches nothing the running call uses (no kernel,
    no message): the instance fails when the running call ends (settle_refusal). After a
    successful ``enter``, ``leave`` must follow."""
    if not module._busy.acquire(False):
        module._refused = exc = concurrent_use(module, name, slot)
        settle_refusal(module)
        raise exc
    try:
        if module._refused is not None:
            module._fail(module._refused)
        # named only if a call is refused
        module._caller = (name, kwargs if kwargs is not None else {"slot": slot}, get_ident())
    except BaseException:
        leave(module)
        raise


def leave(module: Any) -> None:
    """End the call ``enter`` started."""
    module._busy.release()
    if module._refused is not None:
        settle_refusal(module)


def settle_refusal(module: Any) -> None:
    """Fail ``module`` with its refused call's error, unless a call is running (that call
    does it when it ends: whichever thread finds the lock free settles it)."""
    if module._busy.acquire(False):
        try:
            module._fail(module._refused)
        finally:
            module._busy.release()


def concurrent_use(module: Any, method: str, slot: object) -> DcpcConcurrentUseError:
    """The error of a call made while another thread is inside a call of ``module``."""
    busy = getattr(module, "_caller", None)
    where = "a call"
    if busy is not None:
        thread = threading._active.get(busy[2])  # noqa: SLF001 (its name, if it still runs)
        who = repr(thread.name) if thread is not None else f"id {busy[2]}"
        where = f"{busy[0]}(slot={busy[1].get('slot', 0)!r}) on thread {who}"
    return DcpcConcurrentUseError(
        f"{method}(slot={slot!r}) on thread {threading.current_thread().name!r}: this "
        f"{type(module).__name__} instance is already in {where}; one instance takes one "
        "call at a time (on any slot): give each thread its own instance, or make the "
        "threads take turns; this module instance is now failed (its calls no longer "
        "match its peers'): close() it"
    )


class CallOrder:
    """Which methods of the contract's call each slot has run since its first step."""

    def __init__(self, methods: Sequence[str], slots: int):
        self.methods = tuple(methods)
        self.position = {m: i for i, m in enumerate(self.methods)}
        self.done = [0] * slots  # bit i: method i ran in the slot's current call

    def enter(self, method: str, slot: int) -> None:
        i = self.position[method]
        if i == 0:
            self.done[slot] = 1
            return
        need = (1 << i) - 1
        if self.done[slot] & need != need:
            missing = [self.methods[j] for j in range(i) if not self.done[slot] >> j & 1]
            order = " -> ".join(f"{m}()" for m in self.methods)
            raise DcpcContractError(
                method,
                f"step '{method}': called before {', '.join(f'{m}()' for m in missing)} in "
                f"this call of slot {slot}; per call, every rank runs {order} in this order "
                "(the contract dcpc check assumed); this module instance is now failed",
            )
        self.done[slot] |= 1 << i


class TorchHandshake:
    """torch backend over gloo: before a communicating step, every rank sends each peer
    (fingerprint, channel, epoch, flag) and waits at most ``timeout_s`` for each peer's message.

    The messages of slot s go over slot s's process group (``collectives.SlotGroup``), as
    its collectives do, so they pair by the order of that slot's calls only. A missing
    message is a ``DcpcTimeoutError`` naming the step and the peer; another fingerprint
    or another step of the slot a ``DcpcContractError``; a peer's failure notice
    (``notify_failed``, sent when its instance fails) a ``DcpcPeerFailedError``. Messages
    between two ranks arrive in order, so a failure notice answers whatever wait the peer
    is in."""

    def __init__(self, groups: Sequence[Any], rank: int, world: int, steps: Sequence[str],
                 timeout_s: float, fingerprints: Fingerprints):
        import torch.distributed as dist

        self.dist, self.groups, self.rank, self.world = dist, list(groups), rank, world
        self.steps = tuple(steps)
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.fingerprints = fingerprints
        self.epochs = [0] * (max(len(self.steps), 1) * len(self.groups))
        self.peers = [(rank + k) % world for k in range(1, world)]
        self.global_rank = [{p: dist.get_global_rank(g, p) for p in self.peers}
                            for g in self.groups]
        self.outbox = {p: torch.zeros(4, dtype=torch.int64) for p in self.peers}
        self.inbox = {p: torch.zeros(4, dtype=torch.int64) for p in self.peers}
        self.pending: list[Any] = []  # failure notices in flight (kept alive, never waited)

    def _gloo_error(self, exc: RuntimeError, step: str, peer: int, epoch: int,
                    slot: int) -> Exception:
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return DcpcTimeoutError(step, peer, epoch, self.rank, self.timeout_s)
        first = (str(exc).strip().splitlines() or ["?"])[0][:200]
        return DcpcPeerFailedError(step, peer, epoch, self.rank,
                                   f"is unreachable (slot {slot}; gloo: {first})")

    def exchange(self, step: str, chan: int, slot: int, fingerprint: int,
                 ranks: set[int] | None = None) -> None:
        """Every gloo call here (isend, irecv, wait: a peer gone raises in any of them)
        raises a Dcpc error naming the step, the slot, this rank and the peer.
        ``ranks``: the ranks that run the step (a guarded one), None: every rank."""
        self.epochs[chan] += 1
        epoch = self.epochs[chan]
        group, global_rank = self.groups[slot], self.global_rank[slot]
        peers = self.peers if ranks is None else [p for p in self.peers if p in ranks]
        sends = []
        for p in peers:
            self.outbox[p].copy_(torch.tensor([fingerprint, chan, epoch, 0]))
            try:
                sends.append(self.dist.isend(self.outbox[p], global_rank[p], group=group))
            except RuntimeError as exc:
                raise self._gloo_error(exc, step, p, epoch, slot) from None
        for p in peers:
            try:
                work = self.dist.irecv(self.inbox[p], global_rank[p], group=group)
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise self._gloo_error(exc, step, p, epoch, slot) from None
            there, their_chan, their_epoch, flag = (int(v) for v in self.inbox[p].tolist())
            if flag:
                reason = FLAG_REASONS.get(flag, f"set failure flag {flag}")
                raise DcpcPeerFailedError(step, p, epoch, self.rank, reason)
            if (there, their_chan, their_epoch) != (fingerprint, chan, epoch):
                what = self.fingerprints.differ(step, fingerprint, there, p)
                if there == fingerprint:
                    theirs = self.steps[their_chan // len(self.groups)]
                    what = (f"call {epoch} of step '{step}' here, call {their_epoch} of step "
                            f"'{theirs}' on peer {p}, both in slot {slot}")
                raise DcpcContractError(
                    step,
                    f"step '{step}': rank {self.rank}'s call differs from peer {p}'s: {what} "
                    f"(epoch {epoch}); every rank must make the same calls of each slot, in "
                    "the same order and with the same sizes (the call contract, "
                    "docs/engines.md); this module instance is now failed",
                    p,
                )
        for p, work in zip(peers, sends, strict=True):
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                raise self._gloo_error(exc, step, p, epoch, slot) from None

    def notify_failed(self) -> None:
        """Send every peer a failure notice on every slot's group (its next wait for this
        rank reads it); wait a moment for the sends, so that a process that exits right
        after still delivers."""
        for group, global_rank in zip(self.groups, self.global_rank, strict=True):
            for p in self.peers:
                notice = torch.tensor([0, -1, 0, FLAG_FAILED], dtype=torch.int64)
                try:
                    self.pending.append(
                        (notice, self.dist.isend(notice, global_rank[p], group=group)))
                except RuntimeError:
                    pass  # the group itself is broken: peers will time out instead
        for _, work in self.pending:
            try:
                work.wait(NOTICE_WAIT)
            except RuntimeError:
                pass
