"""shift: a point-to-point move along the ring. Rank r stores its ``src`` into the
whole ``dst`` (symmetric) of rank ``r + offset`` (mod W), signals that rank, and waits
for rank ``r - offset``'s signal (its own ``dst`` has then arrived).

``phase: put`` is the split-phase half that pushes and signals without waiting; a later
``phase: wait`` step naming the same ``src``, ``dst`` and ``offset`` polls its slots
(the k-th wait of a (src, dst, offset) polls the k-th put of it: dcpc.ops._split, which
ragged_all_to_all's split shares). Between the two, the
kernel's push is in flight and other steps may run (a ring hop overlapping attention).
The language lands the data at the wait (``dst`` is written there, as the float64
reference writes it); the kernel stores at the put. So the store is modelled at the put,
in flight until the wait (``Effect.lands``): any other access to ``dst`` in between, on
any rank, is a race, even one a barrier orders after the store.

Offsets: ``next`` (= 1), ``prev`` (= -1) or any other nonzero integer k; rank r + k is
taken mod W, so at a W that divides k the shift is a local copy (no signal, no wait).
The checker's world bound counts |k| ranks per wait of a shift.

A ``phase: wait`` may come BEFORE its put on a chain (``wrap: false``, a perm with no
cycle): the pipeline stage's receive, compute, send (``wait_first``). The k-th wait of
a (src, dst, offset, wrap) polls the k-th put of it whichever comes first; only local
steps, and other such waits (of any chain) with their puts, may stand between such a
wait and its put (``_between``); the span (overlapping spans merged: ``spans``) is
proved live by running it rank by rank (``span_run``: a wait returns once its source
ran the put it polls; again with puts that block until received, as on torch) at every
W checked, and refused with the cycle of waits where a rank blocks forever
(``wait-first-span``, docs/hb-checker.md); the float64 reference runs it in that run's
order (dcpc.harness.simulate); on the torch backend the wait receives (first, in the
sender's put order, that sender's earlier messages on its group: ``_early``) and the
put only sends (on the team's group). On a ring every rank would wait first: the
checker's deadlock. A put written before its wait with another ``when:`` (``_apart``)
also only sends, its wait only receives: only local steps may stand between the two
(``_verify_apart``), as nothing may take the message on the wire or wait behind it.

``wrap: false`` (default true) makes the shift non-cyclic: rank r stores into rank
r + k only when 0 <= r + k < W and only those ranks signal; a rank whose source r - k is
outside receives nothing (its ``dst`` is left as it was) and does not wait: the
pipeline stage hand-off (stage 0 receives nothing, the last stage sends nothing). Its
peers are "line+k" and its store's region ``line`` (dcpc.ops.common).
``axis: a`` (one mesh axis, like ``ppermute`` over one axis name; the op's team,
dcpc.lang.mesh): r is the rank's index in its team along a and W the team's size, so
rank (n, g) of ``mesh: {node: N, gpu: G}`` stores into (n, g + k mod G) along gpu. The
rules below are written for the team (``on_team`` gives the region and sync its axis,
the float64 reference runs once per team: dcpc.harness.simulate); the peer ranks are
dcpc.topology ``Torus.peer``'s. A shift by an offset over several axes is refused
(dcpc.check.mesh).
``perm:`` (instead of ``offset``, JAX's ``ppermute``): rank r stores its src into the
dst of rank perm(r) and waits for perm^-1(r). Written as an expression of ``r`` and
``W`` (``W - 1 - r``, ``(r + W / 2) % W``: a value outside 0 .. W-1 sends nothing), a
list of [source, destination] pairs (which fixes W: the largest rank named + 1) or a
list of destinations, one per rank (-1: none; its length fixes W). The unroller
(dcpc.lang.loops, through ``table_at`` below) turns every form into the destination
table at the W it unrolls, so every later stage sees ``perm`` as that table. A rank
that is no source sends nothing, one that is no destination waits for nothing and
keeps its dst (as ``wrap: false``); a fixed point is a local copy. The region is
``perm`` and the peers "perm:<table>" (dcpc.ops.common): the happens-before checker
takes the stores as the union over the table's deltas on every rank and joins no clock
at its wait, as for ``wrap: false``; the brute force and the execution oracle are exact.
Along one mesh axis (``axis: gpu``, ``ppermute`` over one axis name) the perm names member
indices of a team of that axis' size; the unroller maps it to ranks once (dcpc.topology
``Torus.perm_ranks``), so every later stage sees the table over ranks: the checker's
deltas are torus translations along the axis (dcpc.ops.common ``perm_delta``), the
team's float64 reference and the torch backend (the team's group, member indices) read
it back per team (``team_table``). Over several axes (none named on a mesh: every
axis) the team is those axes' ranks in row-major member order.
Lowerings: ``lower`` below + templates/ops/shift.py.j2 (a direct push
into the peer's buffer and one signal, no staging copy); dcpc/runtime/collectives.py
``shift``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import StrictBool

from dcpc.lang.expr import product
from dcpc.lang.mesh import mesh_of
from dcpc.lang.nodes import Int, Name, OpBase, Step, Streams
from dcpc.lang.when import running as running_at
from dcpc.ops._perm import perm_shape, table, verify_perm
from dcpc.ops._split import matched, torch_handshake, verify_matched, wait_first
from dcpc.ops.common import (
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    Sync,
    chain,
    effects,
    keyed,
    offset_peers,
    peerless,
    perm_peers,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define
from dcpc.topology import along, perm_sources, shape_of, team_table, torus

if TYPE_CHECKING:
    from collections.abc import Mapping, Set

    from dcpc.lang.nodes import ScheduleView
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView

NAMED = {"next": 1, "prev": -1}
Stuck = dict[int, tuple[int, int]]  # rank -> (its step in a span, the rank it waits for)
MAX_OFFSET = 2**31 - 1


class Shift(OpBase):
    """Move ``src`` into ``dst`` of rank ``r + offset``; ``phase`` splits put and wait."""

    op: Literal["shift"]
    src: Name
    dst: Name
    offset: Int | Literal["next", "prev"] = 1
    phase: Literal["put", "wait"] | None = None
    wrap: StrictBool = True  # false: no store past either end of the ranks 0 .. W-1
    # any fixed permutation, instead of offset: an expression of r and W, [src, dst]
    # pairs, or (after the unroller, always) the destination of each rank, -1: none
    perm: str | list[Int] | list[list[Int]] | None = None
    WAITS_FIRST: ClassVar[bool] = True  # a chain's wait may come before its put (_split)

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` shares with the put it polls (dcpc.ops._split)."""
        return ((self.src, self.dst, delta(self), self.wrap)
                + ((table(self),) if self.perm is not None else ()))


def delta(op: Shift) -> int:
    """The offset as an integer (0 or a huge one is the verifier's error; 1 here)."""
    k = NAMED.get(op.offset, op.offset)  # type: ignore[call-overload]
    return k if isinstance(k, int) and 0 < abs(k) <= MAX_OFFSET else 1


def peers(op: Shift) -> tuple[str, str]:
    """The sync peers of a shift: (those it signals, those it waits for), as written
    (which ranks a wait first's span links at each W is ``sources``')."""
    k, dests = delta(op), table(op)
    if op.perm is not None:
        return perm_peers(dests), perm_peers(perm_sources(dests))
    return offset_peers(k, op.wrap), offset_peers(-k, op.wrap)


def semantics(c: Scope, step: Step) -> Semantics:
    op: Shift = step.op  # type: ignore[assignment]
    k, dests = delta(op), table(op)
    to, back = peers(op)
    if op.phase == "wait":
        polled = matched(c).polls.get(step.name)
        return Semantics((), Sync(wait=back, polls=polled.index if polled else None))
    # the store is made at the push and lands at the wait that polls it (its own, or
    # the `phase: wait` step's; an unmatched put is the verifier's error)
    wait = matched(c).lands.get(step.name) if op.phase == "put" else step
    push = effects(READ, BEFORE, keyed(op, "src"))
    region = (Region("perm", 0, table=dests) if op.perm is not None
              else Region("peer" if op.wrap else "line", 0, offset=k))
    push += effects(WRITE, BEFORE, keyed(op, "dst"), region,
                    lands=wait.index if wait is not None else None)
    if op.phase == "put":
        return Semantics(tuple(push), Sync(signal=to))
    return Semantics(tuple(push), Sync(signal=to, wait=back, polls=step.index))


def verify(v: ShapeRules, step: Step) -> None:
    op: Shift = step.op  # type: ignore[assignment]
    k = NAMED.get(op.offset, op.offset)  # type: ignore[call-overload]
    verify_perm(v, step, [k for k in ("offset",) if k in op.src_marks]
                + ([] if op.wrap else ["wrap"]))
    if not 0 < abs(k) <= MAX_OFFSET:
        v.error(op.mark("offset"), "bad-offset",
                f"step '{step.name}' shifts by {k}; an offset is a nonzero integer of at "
                f"most {MAX_OFFSET} ranks either way (or next / prev)",
                "use 'copy' to move data on this rank" if k == 0 else None)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    v.transfer(src, dst, symmetric=True)
    s = v.shape(src.name)
    if s is not None and v.shape(dst.name) is not None:
        v.expect(dst, list(s), f"the shift of src '{src.name}'")
    verify_matched(v, step, waits=f"for a shift of '{src.name}' into '{dst.name}'",
                   puts=f"'{src.name}' into '{dst.name}' of rank r{delta(op):+d}",
                   same="src, dst, offset and wrap",
                   wait_hint="add a put step, or drop 'phase' for a shift that waits itself",
                   put_hint="add a 'phase: wait' step after it (or, on a chain, before it)")
    put = wait_first(v.ctx, step)
    if put is not None:
        _verify_wait_first(v, step, put)
    elif op.phase == "put" and _apart(v.ctx, step):
        _verify_apart(v, step)


def _verify_wait_first(v: ShapeRules, step: Step, put: Step) -> None:
    """A wait written before its put (receive, compute, send): its rank's steps up to
    the put must not wait for anything (or signal, or reach another rank) but waits
    written before their puts and those puts, and the span they make must not hang
    when run rank by rank (``_verify_live``; docs/hb-checker.md, "A wait before its
    put"). Along an axis (``axis:``) the chain runs in each team (its offset moves the
    member index, W is the team's size)."""
    op: Shift = step.op  # type: ignore[assignment]
    schedule = v.ctx.schedule
    if schedule.slots > 1 and schedule.streams == Streams.per_slot:
        v.error(op.mark("phase"), "wait-first-span",
                f"step '{step.name}' waits before its put '{put.name}', but the schedule "
                f"has {schedule.slots} slots on their own streams (streams: per_slot): "
                "another call in flight may run its steps between the wait and the put, and "
                "a wait of that call (its credit) can need what this rank sends only after "
                "it (two micro-batches on a chain deadlock where the host blocks: CPU, the "
                "torch backend)",
                "use 'slots: 1', or 'streams: single' (calls one after another)")
        return
    dests, k = table(op), delta(op)
    copies = ([r for r, d in enumerate(dests) if d == r] if op.perm is not None
              else [int(w) for w in v.ctx.samples.worlds
                    if op.wrap and k % _team_size(schedule, op, w) == 0])
    if copies:
        where = (f"rank {copies[0]} is a fixed point of the perm" if op.perm is not None
                 else f"at W={copies[0]} the shift by {k} is a local copy")
        v.error(op.mark("phase"), "wait-first-span",
                f"step '{step.name}' waits before its put '{put.name}', but {where}: the "
                "copy is made at the put, so the wait would return before its data exists",
                "move the wait after the put")
        return
    for between in v.ctx.schedule.step_list()[step.index + 1:put.index]:
        if _local(v.ctx, between):
            continue
        why = _between(v.ctx, op, between)
        if why is None:  # a wait first, or the put of one: the span's run decides
            continue
        v.error(op.mark("phase"), "wait-first-span",
                f"step '{step.name}' waits before its put '{put.name}' (receive, compute, "
                f"send), but step '{between.name}' ({between.kind}) between them {why}; "
                "only steps that run on their rank alone, and the waits written before "
                "their puts (of any chain) with those puts, may stand between a wait "
                "and its later put, or a wait there could need what this rank sends only "
                "after it",
                f"move '{between.name}' before '{step.name}' or after '{put.name}'")
        return
    _verify_live(v, step, put)
    _verify_put_order(v, step, put)


def _verify_live(v: ShapeRules, step: Step, put: Step) -> None:
    """The merged span that ``step`` opens (said once, at its first wait) run under its
    blocking semantics at every W (and mesh shape) checked (``span_run``; a compiled
    module refuses any other, ``_check_proved``): refused where some rank blocks
    forever, with the cycle of waits; then again with each put waiting for its receive
    (the torch backend), refused where only that hangs."""
    holder = v.ctx
    ends = spans(holder)
    if step.index not in ends:
        return
    steps = holder.schedule.step_list()[step.index:ends[step.index] + 1]
    if not all(chain(holder.semantics[s.index].sync.wait) for s in steps
               if isinstance(s.op, Shift) and s.op.phase == "wait"):
        return  # a ring's wait first: its edge stays, the cycle is the checker's deadlock
    for world in holder.samples.worlds:  # the worlds checked: a module refuses others
        running = running_at(holder.schedule, world)
        _, stuck = span_run(holder, steps, world, running)
        torch = not stuck
        if torch:
            _, stuck = span_run(holder, steps, world, running, rendezvous=True)
        if not stuck:
            continue
        at = _at(world)
        where = (" where a put blocks until its receiver posts the receive (the torch "
                 "backend, gloo or NCCL; the kernels' put does not block)" if torch else "")
        v.error(step.op.mark("phase"), "wait-first-span",
                f"step '{step.name}' waits before its put '{put.name}' (receive, compute, "
                f"send), but the span of waits written before their puts from it to "
                f"'{steps[-1].name}', run rank by rank at {at}, hangs{where}: "
                f"{hang_text(holder, steps, stuck)}",
                "make each rank's waits come after what they wait for: e.g. a forward and a "
                "backward hand-off on one axis each its own span (wait, compute, put), one "
                "after the other")
        return


def _local(holder: Any, step: Step) -> bool:
    """Whether ``step`` runs on its rank alone: no signal or wait but the rank's own flag
    (``to: self`` / ``from: self``: a store into and a poll of its own signal slot, which
    only its own earlier signal sets, and no-ops on the torch backend), no store into or
    read of another rank's buffers (no torch-backend message either)."""
    sem = holder.semantics[step.index]
    return (peerless(sem.sync.signal) and peerless(sem.sync.wait)
            and all(e.region is None and e.root is None for e in sem.effects))


def _verify_apart(v: ShapeRules, step: Step) -> None:
    """A put written before its wait, the two with different ``when:`` (``_apart``: on
    the torch backend the put only sends and the wait only receives): the put's message
    stays on the wire until the receiver's wait (gloo and NCCL match the messages
    between two ranks in order; a gloo send blocks until its receive is posted), so any
    receive or collective between them (a shift, a barrier, a torch step's handshake)
    could take it or block on it: only local steps (``_local``) may stand there."""
    wait = matched(v.ctx).lands.get(step.name)
    if wait is None or wait.index < step.index:
        return
    op: Shift = step.op  # type: ignore[assignment]
    for between in v.ctx.schedule.step_list()[step.index + 1:wait.index]:
        if _local(v.ctx, between):
            continue
        edge, elsewhere = _edge(v.ctx, step, wait, between)
        rule = ("on the torch backend the put only sends and the wait only receives, gloo "
                "and NCCL match the messages between two ranks in order and a send blocks "
                "until its receive is posted")
        why = (f": {rule}, so '{between.name}' would take the put's message or block on it"
               if elsewhere is None else
               f" (it signals, waits or reaches another rank's buffers), though on neither "
               f"end of any such pair at a W checked ({elsewhere}), so it cannot take this "
               "put's message; it is refused by where it stands, not by where it runs: "
               f"{rule}, so a communicating step there takes the message or blocks on it "
               "wherever it runs on an end")
        v.error(op.mark("when"), "wait-first-span",
                f"step '{step.name}' puts and its wait '{wait.name}' has another 'when:' "
                f"({edge}), but step '{between.name}' ({between.kind}) between them "
                f"communicates{why}; only steps that run on their rank alone may stand "
                "between such a put and its wait",
                f"move '{between.name}' before '{step.name}' or after '{wait.name}' (or "
                "give the put and the wait the same 'when:')")
        return


def _edge(holder: Any, put: Step, wait: Step, between: Step) -> tuple[str, str | None]:
    """The first W checked and a sender and its receiver of the apart pair ``put``,
    ``wait`` there, preferring a pair where ``between`` runs on either end; and, where it
    runs on neither end of any pair, the ranks it runs on at that W (None: on an end, or
    no pair)."""
    found = []
    for world in holder.samples.worlds:
        running = running_at(holder.schedule, world)
        for p, q in sorted(sources(holder.schedule, wait.op, world).items()):
            if _runs(running, put, q) and _runs(running, wait, p):
                found.append((_runs(running, between, p) or _runs(running, between, q),
                              world, q, p))
    if not found:
        return "no rank runs both ends at a W checked", None
    on_end, world, q, p = max(found, key=lambda f: f[0])
    edge = f"at {_at(world)} rank {q} puts at '{put.name}' and rank {p} receives it at " \
           f"'{wait.name}'"
    if on_end:
        return edge, None
    ranks = sorted(running_at(holder.schedule, world).get(between.index, ()))
    shown = ", ".join(map(str, ranks[:4])) + (", ..." if len(ranks) > 4 else "")
    return edge, (f"at {_at(world)} it runs on rank{'s' if len(ranks) > 1 else ''} {shown}"
                  if ranks else f"at {_at(world)} it runs on no rank")


def _runs(running: Mapping[int, Set[int]], step: Step, rank: int) -> bool:
    """Whether ``step`` runs on ``rank`` by ``running`` (dcpc.lang.when ``running``'s
    table at one W: a step not in it has no ``when:`` and runs on every rank)."""
    ranks = running.get(step.index)
    return ranks is None or rank in ranks


def _at(world: Any) -> str:
    """A world checked, as words: ``W=4``, ``W=4 (mesh 2x2)``."""
    return f"W={int(world)}" + (f" (mesh {'x'.join(map(str, shape_of(world)))})"
                                if len(shape_of(world)) > 1 else "")


def _between(holder: Any, op: Shift, between: Step) -> str | None:
    """Why ``between`` (a communicating step between the wait first ``op`` and its put)
    breaks the chain's liveness, or None: it is another wait first (of any chain) or the
    put of one, which the span's run decides (docs/hb-checker.md, "A wait before its
    put")."""
    other = between.op
    if not isinstance(other, Shift) or other.phase is None:
        return "communicates (it signals, waits or reaches another rank's buffers)"
    if other.phase == "wait" and wait_first(holder, between) is None:
        return ("waits for a put written before it (only waits written before their "
                "puts, with those puts, may stand there)")
    if other.phase == "put" and not _first(holder, between):
        return ("puts for a wait written after it (on the torch backend its exchange "
                "would be taken by this wait's receive: only the puts of waits written "
                "before them may stand there)")
    return None


def _verify_put_order(v: ShapeRules, step: Step, put: Step) -> None:
    """Two waits written before their puts, interleaved, their puts the other way round
    (wait A, wait B, put B, put A): live where the span's run says so, and the torch
    backend receives put B's message at wait A where it comes from the same rank
    (``_early``), but only where both waits run on every rank: refused where either has a
    ``when:`` (the rank that would receive early may skip the later wait)."""
    for other in v.ctx.schedule.step_list()[step.index + 1:put.index]:
        theirs = wait_first(v.ctx, other) if isinstance(other.op, Shift) else None
        if theirs is None or theirs.index > put.index or (
                step.op.when is None and other.op.when is None):
            continue
        v.error(theirs.op.mark("phase"), "wait-first-span",
                f"step '{theirs.name}' puts before '{put.name}', but their waits come the "
                f"other way round ('{step.name}' waits before '{other.name}') and one of "
                "them has a 'when:': the torch backend (gloo or NCCL matches the messages "
                f"between two ranks in order) receives '{theirs.name}''s message at "
                f"'{step.name}' only where both waits run on every rank",
                f"put '{put.name}' before '{theirs.name}', or wait for '{other.name}' "
                f"before '{step.name}'")
        return


def _team_size(schedule: ScheduleView, op: Shift, world: int) -> int:
    """The size of ``op``'s team at ``world`` (W without ``axis:``)."""
    return torus(shape_of(world)).team_size(mesh_of(schedule).team_axes(op))


def sources(schedule: ScheduleView, op: Shift, world: int) -> dict[int, int]:
    """Each rank that receives (at ``world``, a mesh shape for a team along an axis) ->
    the rank whose src it receives: member r - k of its team (dcpc.topology
    ``Torus.peer``), or a perm's source."""
    if op.perm is not None:
        return {d: s for d, s in enumerate(perm_sources(table(op))) if s >= 0}
    t, axes = torus(shape_of(world)), mesh_of(schedule).team_axes(op)
    found = {r: t.peer(r, axes, -delta(op), op.wrap) for r in range(t.size)}
    return {r: s for r, s in found.items() if s is not None}


def spans(holder: Any) -> dict[int, int]:
    """The spans that run along chains: from a shift's wait written before its put to
    that put (``wait_first``), overlapping spans merged (wait A, wait B, compute, put B,
    put A: one span, of one chain or several): first step index -> last."""
    found = sorted((s.index, p.index) for s in holder.schedule.step_list()
                   if isinstance(s.op, Shift) and (p := wait_first(holder, s)) is not None)
    out: dict[int, int] = {}
    first = -1
    for start, end in found:
        if first >= 0 and start <= out[first]:
            out[first] = max(out[first], end)
        else:
            out[start] = end
            first = start
    return out


def receiver(holder: Any, steps: list[Step], world: Any, k: int) -> dict[int, int]:
    """Sender -> receiving rank of the put ``steps[k]`` at ``world`` (by its wait's
    ``sources``)."""
    wait = matched(holder).lands[steps[k].name]
    return {q: r for r, q in sources(holder.schedule, wait.op, world).items()}


def span_run(holder: Any, steps: list[Step], world: Any, running: Mapping[int, Set[int]],
             *, rendezvous: bool = False) -> tuple[list[tuple[int, int]], Stuck]:
    """A merged span (``spans``: the waits written before their puts, those puts, the
    local steps between) run under its blocking semantics at ``world``: each rank runs
    its steps in order (the ones its ``when:`` runs, ``running``), a wait on a rank that
    receives by it returns once its source ran the put it polls (the k-th of the edge),
    a put and a local step never block; ``rendezvous``: a put also waits until its
    receiver has posted the receive (the torch backend: gloo, NCCL), which the receiver
    does at its first wait for that sender on the put's group (team axes) whose put the
    sender makes at or after this one (``collectives.shift`` receives there every
    earlier message of that sender on the group: ``_early``).
    Each rank runs as far as it can, over and over, until none moves. Returns the steps
    run, in an order that respects every wait ((rank, position in ``steps``)), and the
    ranks that block forever: rank -> (position, the rank it waits for). Exact: the
    blocking is monotone (a step that may run stays so), so the order tried is
    immaterial."""
    found, n = matched(holder), int(world)
    at = {s.index: k for k, s in enumerate(steps)}
    waits = {k: sources(holder.schedule, s.op, world) for k, s in enumerate(steps)
             if isinstance(s.op, Shift) and s.op.phase == "wait"}
    polls = {k: at[found.polls[steps[k].name].index] for k in waits}
    to = {k: receiver(holder, steps, world, k) for k, s in enumerate(steps)
          if isinstance(s.op, Shift) and s.op.phase == "put"}
    pos = [0] * n

    def runs(k: int, r: int) -> bool:
        return _runs(running, steps[k], r)

    team = mesh_of(holder.schedule).team_axes
    group = {k: team(found.lands[s.name].op) for k, s in enumerate(steps) if k in to}

    def posted(k: int, r: int, p: int) -> int | None:
        """Where rank ``p`` posts the receive of rank ``r``'s put ``steps[k]``: its first
        wait on the put's group (team axes) from ``r`` whose put comes at or after it."""
        return next((w for w in sorted(waits) if runs(w, p) and waits[w].get(p) == r
                     and polls[w] >= k and team(steps[w].op) == group[k]), None)

    def blocker(r: int) -> int | None:
        k = pos[r]
        if not runs(k, r):
            return None
        if k in waits and (q := waits[k].get(r)) is not None:
            return None if pos[q] > polls[k] else q
        if rendezvous and k in to and (p := to[k].get(r)) is not None:
            w = posted(k, r, p)
            return None if w is None or pos[p] >= w else p
        return None

    events: list[tuple[int, int]] = []
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pos[r] < len(steps) and blocker(r) is None:
                if runs(pos[r], r):
                    events.append((r, pos[r]))
                pos[r] += 1
                moved = True
    return events, {r: (pos[r], q) for r in range(n) if pos[r] < len(steps)
                    and (q := blocker(r)) is not None}


def hang_text(holder: Any, steps: list[Step], stuck: Stuck) -> str:
    """The cycle of waits of a span that hangs (``span_run``), as words."""
    r, seen = min(stuck), []
    while r not in seen and r in stuck:
        seen.append(r)
        r = stuck[r][1]
    cycle = seen[seen.index(r):] if r in seen else seen
    parts = []
    for q in cycle:
        k, peer = stuck[q]
        step = steps[k]
        parts.append(f"rank {q} waits at '{step.name}' for rank {peer}'s "
                     f"'{matched(holder).polls[step.name].name}'" if step.op.phase == "wait"
                     else f"rank {q}'s put '{step.name}' waits for rank {peer} to post its "
                     "receive")
    ring = " -> ".join(map(str, [*cycle, cycle[0]]))
    return f"{'; '.join(parts)} (the cycle of waits {ring})"


def reference(sim: SimView, step: Step) -> None:
    """Put: every rank's src leaves (held until its wait); wait: it lands; whole: both.
    ``wrap: false``: a rank whose source r - k is not a rank gets nothing (dst kept)."""
    op: Shift = step.op  # type: ignore[assignment]
    k, w = delta(op), sim.world
    found = [along(r, w, -k, op.wrap) for r in range(w)]
    if op.perm is not None:  # rank r gets perm^-1(r)'s src, where r is a destination
        dests = table(op)  # over ranks; a team's view (sim.members) reads it per team
        members = getattr(sim, "members", None)
        dests = tuple(team_table(dests, members)) if members is not None else dests
        found = [None if s < 0 else s for s in perm_sources(dests)]
    source = {r: s for r, s in enumerate(found) if s is not None}
    fed = sorted(source)
    if op.phase == "wait":
        put = matched(sim).polls[step.name]
        for r in fed:
            sim.store(r, op.dst, sim.bufs[r][f"{put.name}@inflight"])
        return
    moved = {r: sim.bufs[source[r]][op.src].clone() for r in fed}
    for r in fed:
        if op.phase == "put":
            sim.stash(r, f"{step.name}@inflight", moved[r], like=op.dst)
        else:
            sim.store(r, op.dst, moved[r])


def io(op: Shift) -> IO:
    if op.phase == "wait":
        return [], [op.dst]
    if op.phase == "put":
        return [op.src], []
    return [op.src], [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    """A direct push of src into the peer's whole dst, one signal (no staging copy). A
    ``phase: wait`` step launches the grid its put launched (same scalars, the put's
    tuning: program i polls the put's program i) and returns dst."""
    op = typed(step, Shift)
    k = delta(op)
    shape = ctx.shape(op.src)
    put = matched(ctx).polls.get(step.name) if op.phase == "wait" else step
    plan = ctx.plan(
        step,
        params=[] if op.phase == "wait" else ctx.engine([op.src]),
        returns=[] if op.phase == "put" else [op.dst],
        roles={"dst": op.dst} if op.phase == "wait" else {"src": op.src, "dst": op.dst},
        scalars=[("rows", shape[0]), ("row_len", product(shape[1:]))],
        tiles=[product(shape[1:])],
        attrs={"offset": k,
               "signal": op.phase != "wait", "wait": op.phase != "put",
               "tune_of": put.name if put is not None else step.name,
               # only when false: the plans of cyclic shifts stay as they were
               **({} if op.wrap else {"wrap": False}),
               # a wait written before its put: on the torch backend the wait receives
               # and the put only sends (its receiver waits already); only when so; also
               # a pair guarded apart (when:), whose put and wait run on other ranks
               **({"first": True} if _first(ctx, step) or _apart(ctx, step) else {}),
               # a wait first inside another's span (interleaved pairs): no torch-backend
               # handshake there, a message every rank must reach (its predecessor is
               # still before its puts); only when so
               **({"handshake": False} if _inner(ctx, step) else {}),
               # a put written before its wait: the torch backend moves the data and
               # handshakes there, not at the wait (dcpc.ops._split.torch_handshake)
               **torch_handshake(ctx, step),
               # a span whose puts some sender makes in another order than their
               # waits: on the torch backend a wait receives the earlier messages too
               **_early(ctx, step),
               **(_perm_attrs(ctx.schedule, op) if op.perm is not None else {})},
        signalling=True,
    )
    if op.phase != "wait":
        ctx.layout(plan, "src", 0, 1)
    return plan


def _first(holder: Any, step: Step) -> bool:
    """Whether ``step`` is half of a pair whose wait is written before its put."""
    if step.op.phase == "wait":
        return wait_first(holder, step) is not None
    wait = matched(holder).lands.get(step.name) if step.op.phase == "put" else None
    return wait is not None and wait.index < step.index


def _apart(holder: Any, step: Step) -> bool:
    """Whether ``step`` is half of a split pair whose put and wait have different
    ``when:`` (a rank may run one half and not the other: on the torch backend each half
    then moves its own side, the put sends and the wait receives, as a chain's do)."""
    found = matched(holder)
    other = (found.lands.get(step.name) if step.op.phase == "put" else
             found.polls.get(step.name) if step.op.phase == "wait" else None)
    return other is not None and other.op.when != step.op.when


def _inner(holder: Any, step: Step) -> bool:
    """Whether ``step`` is a wait written before its put that stands between an earlier
    such wait and its put (the second receive of two interleaved pairs)."""
    if (not isinstance(step.op, Shift) or step.op.phase != "wait"
            or wait_first(holder, step) is None):
        return False
    return any(put.index > step.index for other in holder.schedule.step_list()[:step.index]
               if isinstance(other.op, Shift) and (put := wait_first(holder, other)))


def _early(holder: Any, step: Step) -> dict[str, Any]:
    """At a wait written before its put, in a span where two such waits on one group
    (the same team axes) have their puts the other way round: ``early``, the indices of
    the later waits of the span on its group whose puts come before its put, in the
    order of those puts (the torch backend receives their messages here where they
    come from the same rank: ``collectives.shift``); else nothing (every plan as it was)."""
    if wait_first(holder, step) is None:
        return {}
    ends = spans(holder)
    start = max(s for s in ends if s <= step.index)
    found, team = matched(holder), mesh_of(holder.schedule).team_axes
    firsts = [s for s in holder.schedule.step_list()[start:ends[start] + 1]
              if isinstance(s.op, Shift) and wait_first(holder, s) is not None]

    def put(s: Step) -> int:
        return found.polls[s.name].index

    if not any(put(a) > put(b) for a in firsts for b in firsts
               if a.index < b.index and team(a.op) == team(b.op)):
        return {}
    return {"early": [b.index for b in sorted(firsts, key=put) if b.index > step.index
                      and put(b) < put(step) and team(b.op) == team(step.op)]}


def _perm_attrs(schedule: ScheduleView, op: Shift) -> dict[str, Any]:
    """A perm's launch constants, indexed by rank in the module (tuples of constants: no
    work per call): the table (along an axis, the team's: the torch backend runs on the
    team's group with the member index), each rank's TO and FROM (global ranks; itself
    where it has none: its lane masked off) and whether it sends (a rank that is no
    source stores no tile)."""
    dests = table(op)
    back = perm_sources(dests)
    axes = mesh_of(schedule).team_axes(op)
    members = dests if axes is None else tuple(
        team_table(dests, torus(perm_shape(schedule, dests)).team(0, axes)))
    return {"perm": list(members),
            "perm_to": tuple(d if d >= 0 else r for r, d in enumerate(dests)),
            "perm_from": tuple(s if s >= 0 else r for r, s in enumerate(back)),
            "perm_sends": tuple(d >= 0 for d in dests)}


DEF = define(OpDef("shift", Shift, semantics, verify, reference, io, lower, teams=True,
                   exact=True))
