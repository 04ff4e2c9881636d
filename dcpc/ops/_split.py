"""Split-phase steps (``phase: put`` / ``phase: wait``), shared by the ops that take
them (shift, ragged_all_to_all, all_gather): which put each wait polls, the verifier's
unmatched-put / unmatched-wait errors, and, for an exchange with every peer (ragged,
all_gather), its semantics, float64 reference, io and lowering attrs, once.

An op opts in with a ``split_key(schedule)`` method on its model: the k-th ``phase:
wait`` step of a key polls the k-th ``phase: put`` step of it (the key starts with the
op's name, so two ops never match; ``dim_key`` and ``axis_key`` compare a dim and an
``axis:`` as meant, not as written). ``WAITS_FIRST`` (a class attribute, default False): a wait
may also be written BEFORE its put (a shift's chain: receive, compute, send); such a
wait pairs with the earliest later unmatched put of its key. Without it a wait with no
earlier unmatched put is lonely. The choice does not depend on W.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dcpc.lang.mesh import mesh_of
from dcpc.ops.common import WRITE, Effect, Semantics, Sync
from dcpc.ops.common import exchange as whole

if TYPE_CHECKING:
    from collections.abc import Callable

    from dcpc.lang.nodes import ScheduleView, Step
    from dcpc.ops.common import Scope
    from dcpc.ops.iface import ShapeRules, SimView
    from dcpc.ops.registry import IO

PUT, WAIT = "put", "wait"  # the halves of a split step (``phase:``)


@dataclass
class Puts:
    """Which put each ``phase: wait`` step polls (by step name), and what is unmatched."""

    polls: dict[str, Step] = field(default_factory=dict)
    lands: dict[str, Step] = field(default_factory=dict)  # put -> the wait that polls it
    lonely_waits: list[Step] = field(default_factory=list)
    lonely_puts: list[Step] = field(default_factory=list)


def key(step: Step, schedule: ScheduleView) -> tuple[Any, ...] | None:
    """The split key of ``step`` (its op's name first), or None: not a split step."""
    if half(step) is None:
        return None
    return (step.kind, *step.op.split_key(schedule))  # type: ignore[attr-defined]


def half(step: Step) -> str | None:
    """Which half of a split step ``step`` is (PUT, WAIT), or None (the float64
    reference's chain asks: the harness names no op's keys)."""
    if getattr(step.op, "split_key", None) is None:
        return None
    return getattr(step.op, "phase", None)


def dim_key(schedule: ScheduleView, buffer: str, dim: int | None) -> int | None:
    """``dim`` of ``buffer`` counted from its first dim (``dim: -1`` of a 2-D buffer is
    ``dim: 1``), as a wait's key compares it with its put's; out of range or of an
    unknown buffer: as written (the shape check's error)."""
    spec = schedule.buffers.get(buffer)
    n = len(spec.shape) if spec is not None else 0
    return dim % n if dim is not None and -n <= dim < n else dim


def axis_key(schedule: ScheduleView, op: Any) -> tuple[int, ...] | None:
    """The team ``op``'s ``axis:`` names, as its mesh positions (``axis: gpu`` is
    ``axis: [gpu]``; naming every axis is none), as a wait's key compares it."""
    return mesh_of(schedule).team_axes(op)


def puts(schedule: ScheduleView) -> Puts:
    """Match the k-th ``phase: wait`` step of a key with the k-th put of it (module
    docstring: a wait written first pairs only where its op allows it)."""
    out = Puts()
    pending: dict[tuple[Any, ...], list[Step]] = {}
    early: dict[tuple[Any, ...], list[Step]] = {}  # waits written before their put
    lonely: list[Step] = []
    for step in schedule.step_list():
        k = key(step, schedule)
        if k is None:
            continue
        if half(step) == PUT and early.get(k):
            wait = early[k].pop(0)
            out.polls[wait.name], out.lands[step.name] = step, wait
        elif half(step) == PUT:
            pending.setdefault(k, []).append(step)
        elif pending.get(k):
            put = out.polls[step.name] = pending[k].pop(0)
            out.lands[put.name] = step
        elif getattr(step.op, "WAITS_FIRST", False):
            early.setdefault(k, []).append(step)
        else:
            lonely.append(step)
    out.lonely_waits = sorted([*lonely, *(s for waiting in early.values() for s in waiting)],
                              key=lambda s: s.index)
    out.lonely_puts = [s for waiting in pending.values() for s in waiting]
    return out


def matched(holder: Any) -> Puts:
    """``puts(holder.schedule)``, computed once per holder: a pass over one schedule (a
    rule ``Scope``, a structural ``Context``, a lowering ``Ctx``, a ``Sim``) asks it for
    every split step, and each answer walks every step (quadratic in a ring of hops)."""
    memo = getattr(holder, "_split_puts", None)
    if memo is None or memo[0] is not holder.schedule:
        memo = (holder.schedule, puts(holder.schedule))
        holder._split_puts = memo
    return memo[1]


def wait_first(holder: Any, step: Step) -> Step | None:
    """The put a ``phase: wait`` step polls when it is written BEFORE that put (a
    pipeline stage: receive, compute, send), else None."""
    put = matched(holder).polls.get(step.name)
    return put if put is not None and put.index > step.index else None


def torch_handshake(holder: Any, step: Step) -> dict[str, bool]:
    """Where a split pair's torch-backend handshake runs (the plan attr ``handshake``;
    templates/module.py.j2 defaults it to the step that waits): before the torch body's
    blocking exchange, which is at the put when the put is written before its wait (the
    data moves at the put), so that a peer that failed or bound other sizes is found
    before it; then not at that wait again. ``{}`` elsewhere (a wait written first
    receives there, its handshake before it)."""
    found = matched(holder)
    if half(step) == PUT:
        wait = found.lands.get(step.name)
        return {"handshake": True} if wait is None or wait.index > step.index else {}
    if half(step) == WAIT:
        put = found.polls.get(step.name)
        return {"handshake": False} if put is not None and put.index < step.index else {}
    return {}


def verify_matched(v: ShapeRules, step: Step, *, waits: str, puts: str, same: str,
                   wait_hint: str, put_hint: str) -> None:
    """``unmatched-wait`` / ``unmatched-put`` at ``step``'s ``phase``: ``waits`` and
    ``puts`` say what it moves ("for a shift of 'x' into 'y'", "'x' into 'y' of rank
    r+1"), ``same`` the keys a pair shares ("src, dst, offset and wrap")."""
    found = matched(v.ctx)
    op = step.op
    if any(w.name == step.name for w in found.lonely_waits):
        where = ("is left for it, earlier or later" if getattr(op, "WAITS_FIRST", False)
                 else "is written before it")
        v.error(op.mark("phase"), "unmatched-wait",
                f"step '{step.name}' waits {waits}, but no 'phase: put' step with the same "
                f"{same} {where}; the wait could never finish", wait_hint)
    if any(p.name == step.name for p in found.lonely_puts):
        v.error(op.mark("phase"), "unmatched-put",
                f"step '{step.name}' puts {puts}, but no 'phase: wait' step with the same "
                f"{same} is left for it; the receiver never learns that its data arrived",
                put_hint)


# An exchange with every peer split in two (ragged_all_to_all, all_gather): the put
# pushes and signals every peer, the wait waits for every peer's put and then lands it.


def exchange(c: Scope, step: Step, before: list[Effect], after: list[Effect]) -> Semantics:
    """The whole op's effects (``before`` its signal, ``after`` its wait) as the step's
    half: a put keeps ``before``, its stores in flight until the wait that polls it
    (``Effect.lands``; unmatched: the verifier's error, they land nowhere), and signals
    every peer; a wait waits for every peer's put, then ``after``. Not split: both, as
    ``dcpc.ops.common.exchange``."""
    phase = getattr(step.op, "phase", None)
    if phase == WAIT:
        polled = matched(c).polls.get(step.name)
        return Semantics(tuple(after), Sync(wait="all", polls=polled.index if polled else None))
    if phase == PUT:
        wait = matched(c).lands.get(step.name)
        lands = wait.index if wait is not None else None
        return Semantics(tuple(replace(e, lands=lands) if e.kind == WRITE else e
                               for e in before), Sync(signal="all"))
    return whole(before, after, step)


def store(sim: SimView, step: Step) -> Callable[..., None]:
    """Where the float64 reference of ``step`` stores: the simulator (``sim.store``), or,
    for a put, held on the receiver (rounded as stored, with its unsent mask) until the
    wait that polls it lands it (``land``). ``part`` (a put to one peer): the elements
    it sends; the rest of the buffer is left as it is when it lands."""
    if getattr(step.op, "phase", None) != PUT:
        return sim.store

    def hold(rank: int, name: str, value: Any, *, unsent: Any = None, part: Any = None) -> None:
        sim.stash(rank, f"{step.name}@inflight:{name}", value, like=name)
        if unsent is not None:
            sim.bufs[rank][f"{step.name}@unsent:{name}"] = unsent
        if part is not None:
            sim.bufs[rank][f"{step.name}@part:{name}"] = part
    return hold


def land(sim: SimView, step: Step) -> bool:
    """At a ``phase: wait``: store what the put it polls holds (``store``) on every rank;
    True. False elsewhere (the caller computes the op)."""
    if getattr(step.op, "phase", None) != WAIT:
        return False
    put = matched(sim).polls[step.name]
    for j in range(sim.world):
        for k in [k for k in sim.bufs[j] if k.startswith(f"{put.name}@inflight:")]:
            name = k.split(":", 1)[1]
            value = sim.bufs[j].pop(k)
            unsent = sim.bufs[j].pop(f"{put.name}@unsent:{name}", None)
            part = sim.bufs[j].pop(f"{put.name}@part:{name}", None)
            if part is not None:  # one peer's part: the rest as it is now, unsent where
                # nothing wrote it yet this call (sim.unsent_mask); no read by the step
                value = value.where(part, sim.bufs[j].get(name, sim.unsent(name)))
                sent = unsent if unsent is not None else part.logical_not()
                unsent = sent.where(part, sim.unsent_mask(j, name))
            sim.store(j, name, value, unsent=unsent)
    return True


def verify_exchange(v: ShapeRules, step: Step, *, waits: str, puts: str, same: str) -> None:
    """``verify_matched`` for a split exchange with every peer (its wait after its put);
    nothing for a whole op."""
    if getattr(step.op, "phase", None) is None:
        return
    article = "an" if step.kind[0] in "aeiou" else "a"
    verify_matched(v, step, waits=waits, puts=puts, same=same,
                   wait_hint=f"add a 'phase: put' step before it, or drop 'phase' for "
                   f"{article} {step.kind} that waits itself",
                   put_hint="add a 'phase: wait' step after it")


def io(op: Any, sent: list[str], landed: list[str]) -> IO:
    """The whole op reads ``sent`` and writes ``landed``: a put only reads, a wait only
    writes (returns)."""
    return {PUT: (sent, []), WAIT: ([], landed)}.get(op.phase, (sent, landed))  # type: ignore[return-value]


def lowered(ctx: Any, step: Step) -> dict[str, Any]:
    """A split step's plan attrs: its kernel signals (a put) or waits (a wait), a wait
    launches its put's grid (``tune_of``: program i polls program i), and where the
    torch backend handshakes (``torch_handshake``); ``{}`` for a whole op."""
    phase = getattr(step.op, "phase", None)
    if phase is None:
        return {}
    put = matched(ctx).polls.get(step.name) if phase == WAIT else step
    return {"signal": phase == PUT, "wait": phase == WAIT, "tune_of": (put or step).name,
            **torch_handshake(ctx, step)}
