"""Lowering a schedule to the events of one call on one rank, and unrolling calls.

Every step becomes one or two *coarse events*, exactly as the codegen lowers it
(docs/internals.md, "Op semantics"):

- a communication op (all_gather, all_to_all, reduce_scatter, all_to_all_combine,
  barrier) is a ``send`` event (local reads of ``src``, payload stores into every
  rank's instance of ``dst``/``via``, then one signal per peer) followed by a
  ``recv`` event (a wait for every peer's signal, then the local reads/writes
  that follow the wait, e.g. the merge of an ``all_to_all_combine``);
- ``signal`` is a ``send`` event and ``wait`` a ``recv`` event on a named channel;
- every other op is one ``local`` event with its reads and writes.

Merging the per-peer stores with the signals (and the wait with what follows it)
loses nothing: anything ordered after one store of a send is ordered after its
signals too (a peer only learns of a store through the signal), and the
accesses after a wait are ordered exactly like the wait. The brute-force oracle
(tests/hb_oracle.py) keeps every per-peer store, signal and wait apart and
agrees with this model on random schedules.

Only symmetric buffers are tracked: engine-owned buffers are passed in per call
and never written by peers. A symmetric buffer has one instance per (rank, slot),
or one per rank when ``shared: true``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dcpc.diagnostics import Mark
from dcpc.lang import expr as ex
from dcpc.lang.model import Peers, Schedule, Streams

PHASE_ORDER = {"send": 0, "local": 0, "recv": 1}


@dataclass(frozen=True)
class Region:
    """The part of every rank's instance that one writer's store covers.

    Writer ``p`` covers part ``p`` of a partition of axis ``dim``: a contiguous
    ``block`` (all_gather, concatenating), an ``index`` of a W-long axis (stacking
    all_gather, all_to_all, receive buffers) or every ``interleave``-th row block.
    Stores of the same partition overlap only when their writers are equal;
    stores of different partitions may always overlap.
    """

    scheme: str  # "block" | "index" | "interleave"
    dim: int
    interleave: int = 0
    dim_text: str = ""

    @property
    def partition(self) -> tuple[str, int, int]:
        return (self.scheme, self.dim, self.interleave)

    def text(self, writer: int) -> str:
        """The part of writer ``writer`` in words."""
        if self.scheme == "block":
            return f"{self.dim_text} block {writer} (dim {self.dim})"
        if self.scheme == "index":
            return f"index {writer} of dim {self.dim}"
        return f"rows of rank {writer}, interleave {self.interleave} (dim {self.dim})"


@dataclass(frozen=True)
class Access:
    """One access of an event to a symmetric buffer.

    ``region is None``: this rank reads or writes its own whole instance.
    Otherwise a store into EVERY rank's instance (its own included) of the part
    ``region`` assigns to the writing rank.
    """

    buffer: str
    kind: str  # "read" | "write"
    region: Region | None = None

    @property
    def remote(self) -> bool:
        return self.region is not None


@dataclass(frozen=True)
class Event:
    """A coarse event of one call on one rank: one phase of a step."""

    step: int  # index into Program.steps
    phase: str  # "send" | "recv" | "local"
    accesses: tuple[Access, ...] = ()
    signal: tuple[str, Peers] | None = None  # (channel, to)
    wait: tuple[str, Peers] | None = None  # (channel, from)


@dataclass(frozen=True)
class StepInfo:
    name: str
    index: int
    kind: str
    mark: Mark


@dataclass(frozen=True)
class Program:
    """What one rank does in one call, as coarse events, plus slots and streams."""

    name: str
    file: str
    slots: int
    per_slot: bool
    steps: tuple[StepInfo, ...]
    events: tuple[Event, ...]
    shared: dict[str, bool]  # every tracked (symmetric) buffer -> shared: true?

    @property
    def streams_per_rank(self) -> int:
        return self.slots if self.per_slot else 1

    def default_calls(self) -> int:
        """Calls 0 .. 2*slots-1: enough to prove every call (see dcpc.check.hb)."""
        return 2 * self.slots

    def stream(self, call: int) -> int:
        """The stream of a rank that runs ``call`` (0 .. streams_per_rank-1)."""
        return call % self.slots if self.per_slot else 0

    def stream_index(self, call: int, j: int) -> int:
        """Position of event ``j`` of ``call`` in its stream (0-based)."""
        rounds = call // self.slots if self.per_slot else call
        return rounds * len(self.events) + j

    def previous_call(self, call: int) -> int:
        """The call before ``call`` on the same stream, or -1."""
        return call - (self.slots if self.per_slot else 1)

    def channel_text(self, channel: str) -> str:
        return channel.removeprefix("step:")


def peer_deltas(peers: Peers, world: int) -> frozenset[int]:
    """Rank offsets (mod W) of the peers ``all``/``next``/``prev`` name; never 0."""
    if world < 2:
        return frozenset()
    if peers == Peers.all:
        return frozenset(range(1, world))
    return frozenset({1 % world if peers == Peers.next else (world - 1) % world})


def match_waits(program: Program, world: int) -> dict[int, list[tuple[int, int | None]]]:
    """For every event with a wait: [(source delta d, event j of the matching signal)].

    The wait of rank r expects a signal from each rank ``r + d`` its ``from`` names.
    On a channel, the k-th wait (in program order) that expects rank r+d is matched
    with the k-th signal of rank r+d that goes to r, in the same call (epochs are
    per (step, slot) and monotonic, so call c's wait is satisfied by call c's
    signal). ``None``: no signal ever satisfies it.
    """
    out: dict[int, list[tuple[int, int | None]]] = {}
    channels = {e.wait[0] for e in program.events if e.wait is not None}
    for channel in sorted(channels):
        waits = [(j, e.wait) for j, e in enumerate(program.events)
                 if e.wait is not None and e.wait[0] == channel]
        signals = [(j, e.signal) for j, e in enumerate(program.events)
                   if e.signal is not None and e.signal[0] == channel]
        for d in range(1, world):
            back = (-d) % world
            expecting = [j for j, w in waits if d in peer_deltas(w[1], world)]
            sending = [j for j, s in signals if back in peer_deltas(s[1], world)]
            for k, j in enumerate(expecting):
                out.setdefault(j, []).append((d, sending[k] if k < len(sending) else None))
    return out


# --- lowering rules: one function per op -----------------------------------------

Rule = Callable[[Schedule, str, object, int], list[Event]]


def _names(value: object) -> list[str]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [str(value)]


def _mask_reads(op: object) -> list[str]:
    mask = getattr(op, "mask_empty", None)
    return [mask.seq_lens, mask.query_start_loc] if mask is not None else []


def _dim_text(schedule: Schedule, buffer: str, dim: int) -> str:
    spec = schedule.buffers.get(buffer)
    if spec is None or not 0 <= dim < len(spec.shape):
        return f"dim {dim}"
    value = spec.shape[dim]
    if isinstance(value, int):
        return str(value)
    try:
        return ex.unparse(ex.parse(value))
    except Exception:  # noqa: BLE001 (a bad shape is the structural checker's report)
        return str(value)


def _gather_region(schedule: Schedule, op: object) -> Region:
    src, dst = schedule.buffers.get(op.src), schedule.buffers.get(op.dst)  # type: ignore[attr-defined]
    dim = op.dim  # type: ignore[attr-defined]
    if op.interleave:  # type: ignore[attr-defined]
        return Region("interleave", dim, op.interleave)  # type: ignore[attr-defined]
    stacked = src is not None and dst is not None and len(dst.shape) == len(src.shape) + 1
    return Region("index" if stacked else "block", dim, 0,
                  _dim_text(schedule, op.dst, dim))  # type: ignore[attr-defined]


def _reads(names: list[str]) -> list[Access]:
    return [Access(n, "read") for n in names]


def _writes(names: list[str]) -> list[Access]:
    return [Access(n, "write") for n in names]


def _comm(step: int, name: str, send: list[Access], recv: list[Access]) -> list[Event]:
    channel = "step:" + name
    return [Event(step, "send", tuple(send), signal=(channel, Peers.all)),
            Event(step, "recv", tuple(recv), wait=(channel, Peers.all))]


def _all_gather(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    region = _gather_region(s, op)
    return _comm(i, name, _reads([op.src]) + [Access(op.dst, "write", region)], [])  # type: ignore[attr-defined]


def _all_to_all(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    stores = [Access(d, "write", Region("index", 0)) for d in _names(op.dst)]  # type: ignore[attr-defined]
    return _comm(i, name, _reads(_names(op.src)) + stores, [])  # type: ignore[attr-defined]


def _reduce_scatter(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    via = op.via or f"{name}_recv"  # type: ignore[attr-defined]
    send = _reads([op.src]) + [Access(via, "write", Region("index", 0))]  # type: ignore[attr-defined]
    return _comm(i, name, send, _reads([via]) + _writes([op.dst]))  # type: ignore[attr-defined]


def _all_to_all_combine(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    vias = _names(op.via)  # type: ignore[attr-defined]
    send = _reads(_names(op.src)) + [Access(v, "write", Region("index", 0)) for v in vias]  # type: ignore[attr-defined]
    recv = _reads(vias + _mask_reads(op)) + _writes(
        [op.dst] + _names(op.return_lse))  # type: ignore[attr-defined]
    return _comm(i, name, send, recv)


def _merge(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    reads = _reads(_names(op.src) + _mask_reads(op))  # type: ignore[attr-defined]
    writes = _writes([op.dst] + _names(op.return_lse))  # type: ignore[attr-defined]
    return [Event(i, "local", tuple(reads + writes))]


def _copy(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    return [Event(i, "local", (Access(op.src, "read"), Access(op.dst, "write")))]  # type: ignore[attr-defined]


def _external(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    return [Event(i, "local", tuple(_reads(op.reads) + _writes(op.writes)))]  # type: ignore[attr-defined]


def _barrier(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    return _comm(i, name, [], [])


def _signal(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    return [Event(i, "send", signal=(op.channel, op.to))]  # type: ignore[attr-defined]


def _wait(s: Schedule, name: str, op: object, i: int) -> list[Event]:
    return [Event(i, "recv", wait=(op.channel, op.from_))]  # type: ignore[attr-defined]


LOWERING: dict[str, Rule] = {
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "reduce_scatter": _reduce_scatter,
    "all_to_all_combine": _all_to_all_combine,
    "lse_combine": _merge,
    "lse_correct": _merge,
    "copy": _copy,
    "external": _external,
    "barrier": _barrier,
    "signal": _signal,
    "wait": _wait,
}


def lower(schedule: Schedule) -> Program:
    """The coarse events of one call of ``schedule`` on one rank (SPMD: every rank)."""
    steps = schedule.step_list()
    tracked = {name: b.shared for name, b in schedule.buffers.items() if b.is_symmetric}
    for step in steps:
        if step.kind == "reduce_scatter" and step.op.via is None:  # type: ignore[attr-defined]
            tracked.setdefault(f"{step.name}_recv", False)
    events: list[Event] = []
    for i, step in enumerate(steps):
        for event in LOWERING[step.kind](schedule, step.name, step.op, i):
            kept = tuple(a for a in event.accesses if a.buffer in tracked)
            events.append(Event(event.step, event.phase, kept, event.signal, event.wait))
    return Program(
        name=schedule.schedule,
        file=schedule.source_file,
        slots=schedule.slots,
        per_slot=schedule.streams == Streams.per_slot and schedule.slots > 1,
        steps=tuple(StepInfo(s.name, s.index, s.kind, s.mark()) for s in steps),
        events=tuple(events),
        shared=tracked,
    )
