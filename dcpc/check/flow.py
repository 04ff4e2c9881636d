"""Order within a call: reads of buffers nothing wrote, and signal/wait channels."""

from __future__ import annotations

from dcpc.check.context import Context, Ref
from dcpc.diagnostics import did_you_mean
from dcpc.lang.model import Signal, Step
from dcpc.lang.semantics import READ, channels, effect_mark, table


def accesses(ctx: Context) -> list[tuple[Step, list[tuple[str, Ref]]]]:
    """Per step, its buffer accesses in the order they happen ("r" or "w"), with marks
    (dcpc.lang.semantics: the one definition of what an op reads and writes)."""
    effects = table(ctx.schedule)
    return [(step, [("r" if e.kind == READ else "w",
                     Ref(e.buffer, e.key or "implicit", effect_mark(step, e)))
                    for e in effects[step.index].effects])
            for step in ctx.steps]


def check_reads(ctx: Context) -> None:
    """A symmetric buffer is read only after a step of the call wrote it; an
    engine-owned buffer is not read before the step that writes it (one that no step
    writes is an input)."""
    steps = accesses(ctx)
    first_writer: dict[str, Step] = {}
    for step, found in steps:
        for mode, ref in found:
            if mode == "w":
                first_writer.setdefault(ref.name, step)
    written: set[str] = set()
    reported: set[str] = set()
    for step, found in steps:
        for mode, ref in found:
            buffer = ctx.buffer(ref.name)
            if mode == "w":
                written.add(ref.name)
                continue
            if buffer is None or ref.name in written or ref.name in reported:
                continue
            writer = first_writer.get(ref.name)
            if writer is step:
                continue  # read and written by one step: an in-place update
            if buffer.is_symmetric:
                reported.add(ref.name)
                ctx.error(ref.mark, "read-before-write",
                          f"step '{step.name}' reads symmetric buffer '{ref.name}', but no "
                          "earlier step of the call writes it",
                          hint=f"move step '{writer.name}' before '{step.name}'" if writer
                          else "write it in an earlier step, or make it engine-owned "
                          "(drop 'symmetric: true') so the engine passes it in")
            elif writer is not None and writer.index > step.index:
                reported.add(ref.name)
                ctx.error(ref.mark, "read-before-write",
                          f"step '{step.name}' reads '{ref.name}' before step "
                          f"'{writer.name}' writes it",
                          hint=f"move step '{step.name}' after '{writer.name}'")


def check_channels(ctx: Context) -> None:
    """Every wait polls one signal step whose peers reach it; every signal is polled."""
    found = channels(ctx.schedule)
    for err in found.errors:
        op = err.step.op
        mark = op.mark(err.key) if err.key and err.key in op.src_marks else err.step.mark()
        hint = err.hint
        if err.code == "unmatched-wait" and hint is None:
            names = {s.op.channel for s in ctx.steps if isinstance(s.op, Signal)}
            hint = did_you_mean(op.channel, names) or (  # type: ignore[attr-defined]
                f"add a step '{{op: signal, channel: {op.channel}}}' before it")  # type: ignore[attr-defined]
        ctx.error(mark, err.code, err.message, hint=hint,
                  severity="warning" if err.code == "unmatched-signal" else "error")
