"""What every op does, written once: its buffer effects and its synchronisation.

    semantics(schedule, step) -> Semantics(effects, sync)
    channels(schedule) -> Channels          (which signal step each wait polls)

Every stage reads this table and nothing else: the dataflow graph (dcpc.graph), the
read-before-write check (dcpc.check.flow), the lowering (dcpc.codegen), which copies
the effects and the sync into the plan, and the happens-before checker and the
execution oracle, which analyse that plan (the exact signal slots and epochs the
kernels use). Adding an op = one model class, one entry in ``RULES``, one lowering
rule, one template, one test.

Effects happen ``before`` the step's signal (its push; the whole step for an op that
does not synchronise) or ``after`` its wait. A remote store carries a ``Region``: it
writes the writing rank's part of EVERY rank's instance, its own included.

Signals (docs/internals.md): a signalling step owns the signal slots of channel
``index * slots + slot`` and advances its own epoch there once per call; a
communication op waits on its own slots; a ``wait`` step polls the slots of ONE
``signal`` step, chosen here: on a channel, the k-th wait ``from: F`` polls the k-th
signal whose ``to`` reaches it (``from: prev`` <- ``to: next | all``, ``from: next``
<- ``to: prev | all``, ``from: all`` <- ``to: all``). The choice does not depend on
W, so one emitted module serves every group size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dcpc.diagnostics import Mark
from dcpc.lang import expr as ex
from dcpc.lang import model as m

READ, WRITE = "read", "write"
BEFORE, AFTER = "before", "after"


@dataclass(frozen=True)
class Region:
    """The part of every rank's instance that one writer's store covers.

    Writer ``p`` covers part ``p`` of a partition of axis ``dim``: a contiguous
    ``block`` (concatenating all_gather), an ``index`` of a W-long axis (stacking
    all_gather, all_to_all, receive buffers) or every ``interleave``-th row block.
    Stores of the same partition overlap only when their writers are equal; stores
    of different partitions may always overlap.
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
class Effect:
    """One buffer access of a step: ``kind`` read|write, ``when`` before|after.

    ``region`` None: this rank's own instance, whole. ``key``: the op key that names
    the buffer ("src[0]", "mask_empty.seq_lens", ...; "" for an implicit buffer).
    """

    buffer: str
    kind: str
    when: str
    region: Region | None = None
    key: str = ""


@dataclass(frozen=True)
class Sync:
    """The signal slots a step's kernel uses.

    ``signal``: the peers ("all" | "next" | "prev") this step publishes its epoch to,
    in its own slots. ``wait``: the peers it waits for, polling the slots of step
    ``polls`` (its own index for a communication op).
    """

    signal: str | None = None
    wait: str | None = None
    polls: int | None = None


@dataclass(frozen=True)
class Semantics:
    effects: tuple[Effect, ...] = ()
    sync: Sync = field(default_factory=Sync)

    @property
    def reads(self) -> tuple[str, ...]:
        return _unique(e.buffer for e in self.effects if e.kind == READ)

    @property
    def writes(self) -> tuple[str, ...]:
        return _unique(e.buffer for e in self.effects if e.kind == WRITE)


def _unique(names: object) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))  # type: ignore[call-overload]


# --- the signal channels --------------------------------------------------------

# The ``to`` values whose signal reaches a wait ``from: F`` at every W.
REACHES = {m.Peers.prev: (m.Peers.next, m.Peers.all), m.Peers.next: (m.Peers.prev, m.Peers.all),
           m.Peers.all: (m.Peers.all,)}


@dataclass(frozen=True)
class ChannelError:
    step: m.Step
    code: str  # "unmatched-wait" | "peer-mismatch" | "unpolled-signal" | "unmatched-signal" (w)
    message: str
    hint: str | None
    key: str  # the op key to point at


@dataclass
class Channels:
    """Which signal step each wait step polls (by step name), and what cannot match."""

    polls: dict[str, m.Step] = field(default_factory=dict)
    errors: list[ChannelError] = field(default_factory=list)


def channels(schedule: m.Schedule) -> Channels:
    """Match every ``wait`` step with the ``signal`` step whose slots it polls."""
    out = Channels()
    steps = schedule.step_list()
    signals: dict[str, list[m.Step]] = {}
    for step in steps:
        if isinstance(step.op, m.Signal):
            signals.setdefault(step.op.channel, []).append(step)
    seen: dict[tuple[str, m.Peers], int] = {}
    polled: set[str] = set()
    for step in steps:
        op = step.op
        if not isinstance(op, m.Wait):
            continue
        sent = signals.get(op.channel, [])
        if not sent:
            out.errors.append(ChannelError(
                step, "unmatched-wait",
                f"step '{step.name}' waits on channel '{op.channel}', but no step signals "
                "it; the wait can never finish", None, "channel"))
            continue
        k = seen.get((op.channel, op.from_), 0)
        seen[(op.channel, op.from_)] = k + 1
        fits = [s for s in sent if s.op.to in REACHES[op.from_]]  # type: ignore[attr-defined]
        if k < len(fits):
            out.polls[step.name] = fits[k]
            polled.add(fits[k].name)
            continue
        key = "from" if "from" in op.src_marks else ""
        wanted = " or ".join(f"'to: {p.value}'" for p in REACHES[op.from_])
        if not fits:
            other = sent[0]
            out.errors.append(ChannelError(
                step, "peer-mismatch",
                f"step '{step.name}' waits for '{op.from_.value}' peers on channel "
                f"'{op.channel}', but no signal on it goes to them (step '{other.name}' "
                f"signals '{other.op.to.value}' peers)",  # type: ignore[attr-defined]
                f"use {wanted} on '{other.name}', or another 'from' here", key))
        else:
            out.errors.append(ChannelError(
                step, "unmatched-wait",
                f"step '{step.name}' is wait number {k + 1} from '{op.from_.value}' on "
                f"channel '{op.channel}', but only {len(fits)} signal step(s) on it reach "
                f"'{op.from_.value}' waits; each wait polls its own signal step",
                f"add a signal with {wanted} on channel '{op.channel}' before it, or use "
                "another channel", key))
    for name, sent in signals.items():
        waits = [s for s in steps if isinstance(s.op, m.Wait) and s.op.channel == name]
        for step in sent:
            if step.name in polled:
                continue
            if not waits:
                out.errors.append(ChannelError(
                    step, "unmatched-signal",
                    f"step '{step.name}' signals channel '{name}', but no step waits on it",
                    "add a wait or drop the signal", "channel"))
                continue
            if any(w.name not in out.polls for w in waits):
                continue  # that wait's own error says what is wrong on the channel
            # the channel's waits poll other signals: almost surely a pairing mistake
            pairs = ", ".join(f"'{w.name}' polls '{out.polls[w.name].name}'" for w in waits)
            out.errors.append(ChannelError(
                step, "unpolled-signal",
                f"step '{step.name}' signals channel '{name}', but no wait polls it "
                f"({pairs})",
                f"each wait 'from: F' polls the next signal whose 'to' reaches F (from: prev "
                f"<- to: next | all, from: next <- to: prev | all, from: all <- to: all); "
                f"give '{step.name}' its own wait, or its own channel", "channel"))
    return out


# --- effects, one rule per op ---------------------------------------------------

class Scope:
    """What a rule may look at beyond its step: the schedule, its channels (matched
    once) and what other steps read."""

    def __init__(self, schedule: m.Schedule):
        self.schedule = schedule
        self.steps = schedule.step_list()
        self._channels: Channels | None = None

    @property
    def channels(self) -> Channels:
        if self._channels is None:
            self._channels = channels(self.schedule)
        return self._channels

    def read_elsewhere(self, step: m.Step, names: set[str]) -> bool:
        """Whether a step other than ``step`` reads one of ``names`` (its named buffers
        for a fused exchange, whose own reads depend on this question)."""
        for other in self.steps:
            if other.name == step.name:
                continue
            if other.kind == "all_to_all_combine":
                named = {b for key in ("src", "via") for b, _ in _keyed(other.op, key)}
                reads = named | {b for b, _ in _mask(other.op)}
            else:
                reads = set(RULES[other.kind](self, other).reads)
            if names & reads:
                return True
        return False


Rule = Callable[[Scope, m.Step], Semantics]
RULES: dict[str, Rule] = {}


def rule(op: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        RULES[op] = fn
        return fn

    return deco


def semantics(schedule: m.Schedule, step: m.Step) -> Semantics:
    """The effects and the sync of one step (its op's rule)."""
    return RULES[step.kind](Scope(schedule), step)


def table(schedule: m.Schedule) -> list[Semantics]:
    """The semantics of every step, by step index (program order)."""
    scope = Scope(schedule)
    return [RULES[step.kind](scope, step) for step in scope.steps]


def _keyed(op: m.OpBase, key: str) -> list[tuple[str, str]]:
    """(buffer, key) for the buffers an op names under ``key`` (a name or a list)."""
    value = getattr(op, key, None)
    if isinstance(value, str):
        return [(value, key)]
    if isinstance(value, list):
        return [(v, f"{key}[{i}]") for i, v in enumerate(value)]
    return []


def _mask(op: m.OpBase) -> list[tuple[str, str]]:
    """The buffers a merge reads besides its partials: mask_empty's lengths and
    query_start_loc, and output_scale."""
    mask = getattr(op, "mask_empty", None)
    found = []
    if mask is not None:
        found += [(mask.lengths, f"mask_empty.{mask.lengths_key}"),
                  (mask.query_start_loc, "mask_empty.query_start_loc")]
    return found + _keyed(op, "output_scale")


def _effects(kind: str, when: str, named: list[tuple[str, str]],
             region: Region | None = None) -> list[Effect]:
    return [Effect(b, kind, when, region, key) for b, key in named]


def _exchange(before: list[Effect], after: list[Effect], step: m.Step) -> Semantics:
    """A communication op: push, signal every peer, wait for every peer, then ``after``."""
    return Semantics(tuple(before + after), Sync("all", "all", step.index))


def _dim_text(schedule: m.Schedule, buffer: str, dim: int) -> str:
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


@rule("all_gather")
def _all_gather(c: Scope, step: m.Step) -> Semantics:
    op: m.AllGather = step.op  # type: ignore[assignment]
    s = c.schedule
    src, dst = s.buffers.get(op.src), s.buffers.get(op.dst)
    if op.interleave:
        region = Region("interleave", op.dim, op.interleave)
    else:
        stacked = src is not None and dst is not None and len(dst.shape) == len(src.shape) + 1
        region = Region("index" if stacked else "block", op.dim, 0,
                        _dim_text(s, op.dst, op.dim))
    before = _effects(READ, BEFORE, _keyed(op, "src"))
    before += _effects(WRITE, BEFORE, _keyed(op, "dst"), region)
    return _exchange(before, [], step)


@rule("all_to_all")
def _all_to_all(c: Scope, step: m.Step) -> Semantics:
    op = step.op
    before = _effects(READ, BEFORE, _keyed(op, "src"))
    before += _effects(WRITE, BEFORE, _keyed(op, "dst"), Region("index", 0))
    return _exchange(before, [], step)


def via_of(step: m.Step) -> tuple[str, str]:
    """A reduce_scatter's receive buffer and its key (implicit: ``<step>_recv``)."""
    via = step.op.via  # type: ignore[attr-defined]
    return (via, "via") if via else (f"{step.name}_recv", "")


@rule("reduce_scatter")
def _reduce_scatter(c: Scope, step: m.Step) -> Semantics:
    op = step.op
    via = [via_of(step)]
    before = _effects(READ, BEFORE, _keyed(op, "src"))
    before += _effects(WRITE, BEFORE, via, Region("index", 0))
    after = _effects(READ, AFTER, via + _mask(op)) + _effects(WRITE, AFTER, _keyed(op, "dst"))
    return _exchange(before, after, step)


def self_copy(c: Scope, step: m.Step) -> bool:
    """Whether a fused exchange copies its own part into ``via[rank]``: only when
    another step reads ``via``; otherwise its merge reads that part from ``src``."""
    return c.read_elsewhere(step, set(step.op.via))  # type: ignore[attr-defined]


@rule("all_to_all_combine")
def _all_to_all_combine(c: Scope, step: m.Step) -> Semantics:
    op = step.op
    before = _effects(READ, BEFORE, _keyed(op, "src"))
    before += _effects(WRITE, BEFORE, _keyed(op, "via"), Region("index", 0))
    after = _effects(READ, AFTER, _keyed(op, "via") + _mask(op))
    if not self_copy(c, step):  # the merge reads this rank's own part from src
        after += _effects(READ, AFTER, _keyed(op, "src"))
    after += _effects(WRITE, AFTER, _keyed(op, "dst") + _keyed(op, "return_lse"))
    return _exchange(before, after, step)


def _local(reads: list[tuple[str, str]], writes: list[tuple[str, str]]) -> Semantics:
    return Semantics(tuple(_effects(READ, BEFORE, reads) + _effects(WRITE, BEFORE, writes)))


@rule("lse_combine")
@rule("lse_correct")
def _merge(c: Scope, step: m.Step) -> Semantics:
    op = step.op
    return _local(_keyed(op, "src") + _mask(op), _keyed(op, "dst") + _keyed(op, "return_lse"))


@rule("copy")
def _copy(c: Scope, step: m.Step) -> Semantics:
    return _local(_keyed(step.op, "src"), _keyed(step.op, "dst"))


@rule("external")
def _external(c: Scope, step: m.Step) -> Semantics:
    return _local(_keyed(step.op, "reads"), _keyed(step.op, "writes"))


@rule("barrier")
def _barrier(c: Scope, step: m.Step) -> Semantics:
    return _exchange([], [], step)


@rule("signal")
def _signal(c: Scope, step: m.Step) -> Semantics:
    return Semantics((), Sync(signal=step.op.to.value))  # type: ignore[attr-defined]


@rule("wait")
def _wait(c: Scope, step: m.Step) -> Semantics:
    polled = c.channels.polls.get(step.name)
    return Semantics((), Sync(wait=step.op.from_.value,  # type: ignore[attr-defined]
                              polls=polled.index if polled is not None else None))


def effect_mark(step: m.Step, effect: Effect) -> Mark:
    """Where the schedule names the buffer of ``effect`` (the step for an implicit one)."""
    if effect.key.startswith("mask_empty."):
        return step.op.mask_empty.mark(effect.key.split(".", 1)[1])  # type: ignore[attr-defined]
    return step.op.mark(effect.key) if effect.key else step.mark()
