"""Rank-dependent steps (``when:``, dcpc.lang.when): the condition parses, names only
what a rank knows and evaluates on every rank of every W checked. On a step that
communicates it must leave no rank waiting, decided rank by rank at every W (and mesh
shape) checked: every signal a running rank sends is waited for by its receiver, which
runs the waiting step, and every wait a running rank makes is signalled by a sender
that runs the signalling step (``_matched``). For a collective that is the same value
on every member of each team; for a shift (or its split put and wait halves) every edge
rank -> peer run at both ends or at neither."""

from __future__ import annotations

from dcpc.check.context import Context
from dcpc.check.mesh import one_coordinate_peers
from dcpc.diagnostics import Mark, clipped, did_you_mean
from dcpc.lang import expr as ex
from dcpc.lang import when as wh
from dcpc.lang.loops import names_the_rank
from dcpc.lang.semantics import Semantics
from dcpc.ops.common import peers_of
from dcpc.topology import shape_of

COMMUNICATION_HINT = ("a guarded exchange must run at both ends of every signal: on a "
                      "collective, a condition with one value on every member of its team "
                      "(the hop, W, sizes, the coordinates of axes outside the team: "
                      "'node == 0' on an all_gather along 'gpu'); on a shift, guards that "
                      "hold on a sender exactly where they hold on its receiver")


def local(sem: Semantics) -> bool:
    """Whether a step runs on its rank alone: no signal, no wait, and every access on
    its own instance (what ``when:`` may guard)."""
    return (sem.sync.signal is None and sem.sync.wait is None
            and all(e.region is None and e.root is None for e in sem.effects))


def check_when(ctx: Context) -> None:
    """Every ``when:`` condition: ``bad-when`` (syntax, a name no rank knows, a value that
    cannot be computed on some rank) or ``when-on-communication``."""
    known = wh.names(ctx.schedule)
    owned: set[tuple[str, Mark]] = set()  # the written steps whose copies were refused
    checked: list[int] = []  # the guarded communication steps whose condition evaluates
    for step, sem in zip(ctx.steps, ctx.semantics, strict=True):
        text = getattr(step.op, "when", None)
        if text is None:
            continue
        mark = step.op.mark("when")
        copy = step.op.src_copy
        if not local(sem) and copy is not None:
            # a copy the unroller made of a step whose index names the rank: said once,
            # of the step as written (its first copy)
            if (copy.step, step.op.mark(wh.OWNER_MARK)) in owned:
                continue
            owned.add((copy.step, step.op.mark(wh.OWNER_MARK)))
            ctx.error(step.op.mark(wh.OWNER_MARK), "bad-index",
                      f"step '{copy.step}' ({step.kind}) has an index that "
                      f"{names_the_rank(copy.index)}"
                      f"{f' ({copy.why})' if copy.why else ''}, but it communicates (it signals, "
                      "waits or reaches another rank's buffers): a slice that depends on "
                      "the rank is taken per rank "
                      "by a copy of the step that runs there alone, and every rank must run "
                      "a communication step",
                      hint="index by the rank in the local steps (the attention that writes "
                      "a partial, a copy), and keep the exchange's buffers whole or indexed "
                      "by the hop; or index a symmetric buffer whose leading axis is W by a "
                      "rotation of the rank ('parts[(r - h) % W]': r + c mod W, one c on "
                      "every rank), and by nothing else: one step every rank runs")
            continue
        if not local(sem) and sem.sync.signal is None and sem.sync.wait is None:
            ctx.error(mark, "when-on-communication",
                      f"step '{step.name}' ({step.kind}) has 'when:', but it reaches "
                      "another rank's buffers with no signal or wait of its own: which "
                      "ranks skip it cannot be matched with its peers",
                      hint="guard the steps that signal and wait around it")
            continue
        try:
            cond = ex.parse_condition(text)
        except ex.ExprSyntaxError as err:
            ctx.error(mark, "bad-when", f"step '{step.name}': when '{clipped(text)}': {err} "
                      f"(at character {err.column + 1} of the condition)",
                      hint="a condition compares expressions of rank, the hop indices, W "
                      "and integer sizes (+ - * / %) with < <= > >= == !=, joined by and, "
                      "or, not: e.g. 'h <= rank'")
            continue
        unknown = sorted(ex.symbols(cond) - known)
        if unknown:
            ctx.error(mark, "bad-when",
                      f"step '{step.name}': when '{clipped(text)}' names '{unknown[0]}', "
                      "which is not rank, W, an integer size, a mesh axis or the hop index "
                      "of a loop around the step",
                      hint=did_you_mean(unknown[0], known) or
                      f"a condition may name {', '.join(sorted(known))} and the hop "
                      "indices of the loops around the step")
            continue
        if _evaluates(ctx, step, cond, text) and not local(sem):
            checked.append(step.index)
    if checked:
        _matched(ctx, set(checked))


def _evaluates(ctx: Context, step: object, cond: ex.Expr, text: str) -> bool:
    """The condition has a value on every rank of every W checked (no '/' or '%' that
    divides by zero or inexactly)."""
    for world in ctx.samples.worlds:
        for rank, env in enumerate(wh.envs(ctx.schedule, world)):
            try:
                ex.holds(cond, env)
            except (ArithmeticError, ValueError) as err:
                where = f"rank {rank}, W={world}"
                if len(shape_of(world)) > 1:
                    where += f" (mesh {world})"
                ctx.error(step.op.mark("when"), "bad-when",  # type: ignore[attr-defined]
                          f"step '{step.name}': when '{clipped(text)}' has no value on "  # type: ignore[attr-defined]
                          f"{where}: {err}",
                          hint="a division in a condition must be exact on every rank; "
                          "'%' by zero has no value")
                return False
    return True


def _matched(ctx: Context, guarded: set[int]) -> None:
    """Every signal of a step that is guarded, or polled by a guarded wait, has both its
    ends run on every rank of every W checked: a rank that waits (a running waiting
    step) needs its sender to run the signalling step (else it waits forever), and a
    rank that signals and stores needs its receiver to run the waiting step (else the
    data lands in a buffer no wait ever returns and a later call's wait passes on this
    call's signal). ``when-on-communication`` names W, the two ranks and what hangs,
    once per step as written."""
    sems = ctx.semantics
    # a step whose next/prev/offset spans several axes has no peers (its axis-required
    # error, check/mesh.py): no edge of it is matched, so that error is said alone
    undefined = {s.index for s in ctx.steps if one_coordinate_peers(ctx, s) is not None}
    waiters: dict[int, list[int]] = {}  # signalling step -> the steps that poll it
    for j, sem in enumerate(sems):
        if sem.sync.wait is not None and sem.sync.polls is not None:
            waiters.setdefault(sem.sync.polls, []).append(j)
    pairs = [(i, j) for i, js in sorted(waiters.items()) for j in js
             if sems[i].sync.signal is not None and (i in guarded or j in guarded)
             and not {i, j} & undefined]
    said: set[str] = set()
    for world in ctx.samples.worlds:
        running = wh.running(ctx.schedule, world)
        for i, j in pairs:
            blame = ctx.steps[j if j in guarded else i]
            key = blame.op.src_copy.step if blame.op.src_copy is not None else blame.name
            if key in said:
                continue
            found = _unmatched(sems[i].sync, sems[j].sync, running.get(i), running.get(j),
                               world)
            if found is not None:
                said.add(key)
                ctx.error(blame.op.mark("when"), "when-on-communication",
                          _counterexample(ctx, ctx.steps[i], ctx.steps[j], world, *found),
                          hint=COMMUNICATION_HINT)


def _unmatched(send: object, recv: object, senders: frozenset[int] | None,
               receivers: frozenset[int] | None, world: int
               ) -> tuple[int, int, bool] | None:
    """The first edge one end of which runs and the other does not: (rank that runs,
    its peer that skips, whether the running rank is the waiting one), or None."""
    def on(ranks: frozenset[int] | None, r: int) -> bool:
        return ranks is None or r in ranks

    for r in range(int(world)):
        if on(receivers, r):  # r waits for each peer its wait names
            for q in peers_of(recv.wait, r, world, recv.axes):  # type: ignore[attr-defined]
                if not on(senders, q) and r in peers_of(send.signal, q, world,  # type: ignore[attr-defined]
                                                        send.axes):  # type: ignore[attr-defined]
                    return r, q, True
        if on(senders, r):  # r stores into and signals each peer its signal names
            for p in peers_of(send.signal, r, world, send.axes):  # type: ignore[attr-defined]
                if not on(receivers, p) and r in peers_of(recv.wait, p, world, recv.axes):  # type: ignore[attr-defined]
                    return r, p, False
    return None


def _counterexample(ctx: Context, send: object, recv: object, world: int, runs: int,
                    skips: int, waiting: bool) -> str:
    """The message of an unmatched edge: the steps, W (the mesh shape), the two ranks and
    what hangs."""
    at = f"W={int(world)}" + (f" (mesh {'x'.join(map(str, shape_of(world)))})"
                              if len(shape_of(world)) > 1 else "")
    s, w = send.name, recv.name  # type: ignore[attr-defined]
    both = s == w
    shown = f"step '{s}' ({send.kind})" if both else \
        f"steps '{s}' ({send.kind}, the signal) and '{w}' ({recv.kind}, its wait)"  # type: ignore[attr-defined]
    whens = {getattr(x.op, "when", None) for x in (send, recv)} - {None}  # type: ignore[attr-defined]
    cond = " / ".join(f"'{clipped(c)}'" for c in sorted(whens))
    if waiting:
        what = (f"rank {skips} skips '{s}'; rank {runs} runs '{w}' and waits for rank "
                f"{skips}'s signal forever")
    else:
        what = (f"rank {runs} runs '{s}' and stores into and signals rank {skips}, which "
                f"skips '{w}': its data lands unseen and that signal is left over for a "
                "later call's wait")
    team = " (one team)" if both and send.op.axis is not None else ""  # type: ignore[attr-defined]
    if runs == skips:  # a rank's own flag (to: self): its two steps' conditions differ
        what = (f"it skips '{s}' and runs '{w}', which waits for its own signal forever"
                if waiting else f"it runs '{s}' and skips '{w}': its own signal is left "
                "over for a later call's wait")
        return (f"{shown} with when: {cond} communicate, but at {at} the condition "
                f"differs between them on rank {runs}, whose own flag they are: {what}")
    return (f"{shown} with when: {cond} communicate{'s' if both else ''}, but at {at} the "
            f"condition differs between ranks {min(runs, skips)} and {max(runs, skips)}"
            f"{team}, which it connects: {what}")
