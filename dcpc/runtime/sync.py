"""The signal bank of a generated module: signal words, epochs, the error record, and
the run-time guard of the call contract (fingerprints, failure flags, deadlines).

Layout (docs/internals.md, "Signals and the guard"): ONE symmetric int64 buffer per
module instance,

- ``flags[src_rank]`` (the first ``world`` words): nonzero once rank ``src_rank``'s
  instance failed (``FLAG_FAILED``) or was closed (``FLAG_CLOSED``), written by that
  rank into every peer's bank; or once its process is gone (``FLAG_DIED``), written by
  this rank's own watchdog (CPU); read by a wait only while its epoch is still pending;
- ``sig[channel, src_rank, program]`` (the rest); channel = ``step_index * slots +
  slot``. A producer stores ``fingerprint << 32 | uint32(epoch)`` with release
  semantics into ``sig[channel, producer_rank, program]`` of every consumer: the
  epoch and the call's fingerprint travel in one atomic word, so a consumer that sees
  the epoch sees the fingerprint of that very call.

Local, per rank: ``epochs`` int32 ``[channel, program]`` (advanced by the kernels,
compared wrap-safely) and ``errors`` int32 ``[ERROR_WORDS]``: (code, step, peer,
epoch, fingerprint here, fingerprint seen, stop, peer flag) of the first failed wait.
On GPU the kernel then traps; on CPU it returns and the method raises
(``check_errors``).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence

import torch
import triton
import triton.language as tl

from dcpc.runtime import errors
from dcpc.runtime.clock import cpu_clock
from dcpc.runtime.device import _dcpc_flag_all
from dcpc.runtime.errors import (
    ERROR_WORDS,
    FLAG_CLOSED,
    FLAG_DIED,
    FLAG_FAILED,
    RECORD,
    DcpcContractError,
    DcpcError,
    DcpcPeerFailedError,
    DcpcTimeoutError,
)
from dcpc.runtime.heap import SymmetricBuffer
from dcpc.runtime.local import sync_stream
from dcpc.runtime.tiles import next_pow2

STOP_WORD = RECORD.index("stop")  # CPU: the watchdog sets it at the deadline
# the signal/wait protocol's codes by their short names (defined once, with every op's:
# dcpc.runtime.errors.KERNEL_ERRORS)
TIMEOUT, CONTRACT, PEER_FAILED = (errors.KERNEL_ERRORS[k].code
                                  for k in ("TIMEOUT", "CONTRACT", "PEER_FAILED"))
DECODE = {e.code: e.decode for e in errors.KERNEL_ERRORS.values() if e.decode is not None}
WATCH_S = 0.5  # CPU: how often an armed call's watchdog looks for dead peers (wall s)
JOIN_S = 30.0  # close(): how long to wait for the watchdog's thread to end (wall s)
FLAG_REASONS = {
    FLAG_FAILED: "failed (an error in one of its calls: that rank's own error says which)",
    # a closed peer's flag stops only a wait for a signal it never sent: it made fewer
    # calls of this slot than we did (a skipped call without call_id= shows only here)
    FLAG_CLOSED: "was closed before it made this call (it made fewer calls of this slot "
                 "than this rank: a rank that skipped or repeated a whole call is seen "
                 "here, at the end, unless the engine passes call_id=)",
    FLAG_DIED: "died (its process is gone: killed or crashed)",
}
INT32_MAX = 2**31 - 1
FINGERPRINT_BITS = 31  # fingerprints are in 0..2**31-1 (never -1)


def channel(step_index: int, slot: int, slots: int) -> int:
    return step_index * slots + slot


def signal_nbytes(channels: int, world: int, programs: int) -> int:
    return (world + channels * world * programs) * 8


def wrap_int32(value: int) -> int:
    """``value`` as a two's-complement int32 (epochs wrap; comparisons are wrap-safe)."""
    return (value + 2**31) % 2**32 - 2**31


def pack(fingerprint: int, epoch: int) -> int:
    """The int64 signal word of ``epoch`` carrying ``fingerprint``."""
    return wrap_int64((fingerprint << 32) | (epoch & 0xFFFFFFFF))


def wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class Fingerprints:
    """The fingerprint of a call of each step: the run-time sizes it binds, exactly.

    A step's fingerprint is a mixed-radix number over the values of the run-time sizes
    its shapes use (each in 0..max), times the schedule's salt (its source hash), so two
    calls with the same fingerprint bound the same sizes of the same schedule. When the
    sizes do not fit in 31 bits, a CRC of them is used (mismatches are still found, but
    the peer's values cannot be read back)."""

    def __init__(
        self, steps: Mapping[str, Sequence[str]], maxima: Mapping[str, int], schedule_hash: str
    ):
        self.sizes = {step: tuple(names) for step, names in steps.items()}
        self.radix = {step: tuple(maxima[n] + 1 for n in names) for step, names in steps.items()}
        self.salt = int(schedule_hash[:8] or "0", 16)
        self.exact: dict[str, int] = {}  # step -> product of its radices, when they fit
        for step, radix in self.radix.items():
            total = 1
            for r in radix:
                total *= r
            if total < 2**FINGERPRINT_BITS:
                self.exact[step] = total

    def of(self, step: str, env: Mapping[str, int]) -> int:
        names = self.sizes.get(step, ())
        values = [env.get(n, 0) for n in names]
        total = self.exact.get(step)
        if total is None:
            return zlib.crc32(repr((self.salt, values)).encode()) & INT32_MAX
        code = 0
        for value, radix in zip(values, self.radix[step], strict=True):
            code = code * radix + value
        return code + total * (self.salt % (2**FINGERPRINT_BITS // total))

    def decode(self, step: str, fingerprint: int) -> dict[str, int] | None:
        """The sizes a fingerprint of ``step`` carries; None when they cannot be read back."""
        total = self.exact.get(step)
        if total is None or fingerprint // total != self.salt % (2**FINGERPRINT_BITS // total):
            return None
        code, out = fingerprint % total, {}
        for name, radix in reversed(list(zip(self.sizes[step], self.radix[step], strict=True))):
            code, out[name] = divmod(code, radix)
        return {n: out[n] for n in self.sizes[step]}

    def differ(self, step: str, here: int, there: int, peer: int) -> str:
        """'T=5 here, T=3 on peer 1', or what can be said when the values are hashed."""
        mine, theirs = self.decode(step, here), self.decode(step, there)
        if mine is None or theirs is None:
            return (f"fingerprint {here:#x} here, {there:#x} on peer {peer} (another "
                    "schedule, or sizes too large to read back)")
        diff = [n for n in mine if mine[n] != theirs[n]]
        return (", ".join(f"{n}={mine[n]}" for n in diff) + " here, "
                + ", ".join(f"{n}={theirs[n]}" for n in diff) + f" on peer {peer}")


@triton.jit
def _dcpc_flag_peers(sig_ptrs, value, RANK: tl.constexpr, WORLD: tl.constexpr,
                     WP2: tl.constexpr):
    """flags[RANK] = value in every peer's bank (release, system scope)."""
    _dcpc_flag_all(sig_ptrs, value, RANK, WORLD, WP2)


class Watchdog:
    """CPU backends: sets ``errors[STOP_WORD]`` when an armed call passes its deadline.

    The Triton interpreter cannot read a clock inside a kernel, so on CPU a wait polls
    this word; one daemon thread per module instance, idle unless a call is armed.

    The deadline counts the CPU time of the thread that armed it (``timeout_s`` of it),
    not wall time: a CPU wait spins, so its thread runs whenever the machine lets a
    busy thread run, and the peers it waits for run at that same share. On an idle
    machine that is wall time; on a loaded one it stretches as the peers slow down
    (a fixed number of wall seconds timed out healthy ranks whose peer was merely
    descheduled: issue 31), and a peer that stopped (dead, stuck, asleep) is still
    named after ``timeout_s`` seconds of spinning.

    ``watch``: called every WATCH_S wall seconds while a call is armed (the module's
    look for dead peers: it flags a peer whose process is gone, and the wait stops at
    once, naming it, instead of spinning out its deadline)."""

    def __init__(self, errors: torch.Tensor, timeout_s: float,
                 watch: Callable[[], None] | None = None):
        self.errors, self.timeout_s, self.watch = errors, timeout_s, watch
        self._deadline: float | None = None  # on self._clock
        self._clock: Callable[[], float] = time.monotonic
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="dcpc-watchdog", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def arm(self) -> None:
        clock = cpu_clock()  # the calling thread's (a thread id may be reused: not cached)
        with self._cond:
            self.errors[STOP_WORD] = 0
            self._clock = clock
            self._deadline = clock() + self.timeout_s
            self._cond.notify()

    def disarm(self) -> None:
        self._deadline = None  # the thread sees it at its next wake-up (no lock needed)

    def close(self) -> None:
        """Stop the thread and wait for it to end (at most JOIN_S): a daemon thread that
        ends while the interpreter finalises drops its tensors without the GIL, which
        aborts the process ("terminate called without an active exception", issue 31)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                deadline = self._deadline
                if deadline is None:
                    self._cond.wait()
                    continue
                try:
                    left = deadline - self._clock()
                except OSError:  # the armed thread is gone: nobody waits any more
                    self._deadline = None
                    continue
                if left > 0:  # CPU time grows no faster than wall time: wake, look again
                    if self.watch is None:
                        self._cond.wait(max(left, 0.01))
                        continue
                    self._cond.wait(min(max(left, 0.01), WATCH_S))
                    if not self._closed and self._deadline is deadline:  # still this call:
                        self.watch()  # are its peers alive? (close() waits for it)
                    continue
                self.errors[STOP_WORD] = 1
                self._deadline = None


_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()  # every watchdog not yet collected


@atexit.register
def _close_watchdogs() -> None:
    """At exit, before the interpreter finalises: end every watchdog's thread (one that
    was never closed, e.g. a module an engine keeps, may be armed and wake later)."""
    for dog in list(_LIVE):
        dog.close()


class SignalBank:
    """Signal words and failure flags (symmetric), epochs and the error record."""

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
        words = segment.view(torch.int64, (world + channels * world * programs,))
        self.flags = words[:world]
        self.sig = words[world:].view(channels, world, programs)
        self.sig_ptrs = segment.peer_ptrs
        # Every slot starts at epoch_start: the first wait is for epoch_start + 1.
        self.flags.zero_()
        self.sig.fill_(pack(0, epoch_start))
        self.epochs = torch.full(
            (channels, programs), epoch_start, dtype=torch.int32, device=device
        )
        self.errors = torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)

    def flag_peers(self, rank: int, value: int) -> None:
        """Tell every peer's waits that this rank failed or closed (one tiny kernel)."""
        if self.world > 1:
            _dcpc_flag_peers[(1,)](self.sig_ptrs, value, RANK=rank, WORLD=self.world,
                                   WP2=next_pow2(self.world), num_warps=1)

    def check_errors(
        self,
        step_names: Sequence[str],
        rank: int | None = None,
        fingerprints: Fingerprints | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Raise the error recorded by a kernel, if any (reads device memory: a host sync)."""
        sync_stream(self.errors.device)  # first: see dcpc.runtime.local.to_host
        record = [int(v) for v in self.errors.tolist()]
        code, step, peer, epoch, here, there, _, flag = record
        if code == 0:
            return
        name = step_names[step] if 0 <= step < len(step_names) else f"#{step}"
        if code == TIMEOUT:
            raise DcpcTimeoutError(name, peer, epoch, rank, timeout_s)
        if code == CONTRACT:
            what = (fingerprints.differ(name, here, there, peer) if fingerprints is not None
                    else f"fingerprint {here:#x} here, {there:#x} on peer {peer}")
            who = f"rank {rank}" if rank is not None else "this rank"
            raise DcpcContractError(
                name,
                f"step '{name}': {who}'s call differs from peer {peer}'s: {what} (epoch "
                f"{epoch}); every rank must make the same calls with the same sizes (the "
                "contract dcpc check assumed); this module instance is now failed",
                peer,
            )
        if code == PEER_FAILED:
            reason = FLAG_REASONS.get(flag, f"set failure flag {flag}")
            raise DcpcPeerFailedError(name, peer, epoch, rank, reason)
        if code in DECODE:  # an op's code
            raise DECODE[code](name, rank, dict(zip(RECORD, record, strict=True)))
        raise DcpcError(f"step '{name}': kernel error code {code} (peer {peer}, epoch {epoch})")
