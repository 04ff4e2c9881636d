"""Rank-dependent steps (``when:``, dcpc.lang.when): the condition parses, names only
what a rank knows, evaluates on every rank of every W checked, and guards a step that
runs on its rank alone (so every signal and wait still runs on every rank: liveness
is untouched)."""

from __future__ import annotations

from dcpc.check.context import Context
from dcpc.diagnostics import Mark, clipped, did_you_mean
from dcpc.lang import expr as ex
from dcpc.lang import when as wh
from dcpc.lang.loops import names_the_rank
from dcpc.lang.semantics import Semantics
from dcpc.topology import shape_of

COMMUNICATION_HINT = ("guard the local work around it (its attention, its merge) and keep "
                      "the exchange unconditional, or use 'wrap: false' on a shift whose "
                      "edge ranks skip")


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
                      f"{names_the_rank(copy.index)}, but it communicates (it signals, "
                      "waits or reaches another rank's buffers): a slice that depends on "
                      "the rank is taken per rank "
                      "by a copy of the step that runs there alone, and every rank must run "
                      "a communication step", hint="index by the rank in the local steps "
                      "(the attention that writes a partial, a copy), and keep the "
                      "exchange's buffers whole or indexed by the hop")
            continue
        if not local(sem):
            ctx.error(mark, "when-on-communication",
                      f"step '{step.name}' ({step.kind}) has 'when:', but it communicates "
                      "(it signals, waits or reaches another rank's buffers): every rank "
                      "must run it, or its peers wait forever", hint=COMMUNICATION_HINT)
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
        _evaluates(ctx, step, cond, text)


def _evaluates(ctx: Context, step: object, cond: ex.Expr, text: str) -> None:
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
                return
