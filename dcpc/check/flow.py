"""Order within a call: reads of buffers nothing wrote, and signal/wait channels."""

from __future__ import annotations

from dcpc.check.context import Context, Ref, mask_refs, refs
from dcpc.diagnostics import did_you_mean
from dcpc.lang.model import OpBase, Peers, Signal, Step, Wait

# A wait from `prev` is satisfied by the previous rank signalling its `next`.
PARTNER = {Peers.all: Peers.all, Peers.prev: Peers.next, Peers.next: Peers.prev}


def accesses(op: OpBase) -> list[tuple[str, Ref]]:
    """The buffer accesses of one op, in the order they happen ("r" or "w")."""
    out: list[tuple[str, Ref]] = [("r", ref) for ref in refs(op, "src") + refs(op, "reads")]
    out += [("r", ref) for ref in mask_refs(op)]
    for ref in refs(op, "via"):  # peers store into via, then this rank reads it
        out += [("w", ref), ("r", ref)]
    out += [("w", ref) for ref in refs(op, "dst") + refs(op, "return_lse") + refs(op, "writes")]
    return out


def check_reads(ctx: Context) -> None:
    """A symmetric buffer is read only after a step of the call wrote it; an
    engine-owned buffer is not read before the step that writes it (one that no step
    writes is an input)."""
    first_writer: dict[str, Step] = {}
    for step in ctx.steps:
        for mode, ref in accesses(step.op):
            if mode == "w":
                first_writer.setdefault(ref.name, step)
    written: set[str] = set()
    reported: set[str] = set()
    for step in ctx.steps:
        for mode, ref in accesses(step.op):
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
    """Every wait has a signal on its channel, with peers that match."""
    signals: dict[str, list[tuple[Step, Signal]]] = {}
    waits: dict[str, list[tuple[Step, Wait]]] = {}
    for step in ctx.steps:
        if isinstance(step.op, Signal):
            signals.setdefault(step.op.channel, []).append((step, step.op))
        elif isinstance(step.op, Wait):
            waits.setdefault(step.op.channel, []).append((step, step.op))
    for channel, items in waits.items():
        for step, wait in items:
            sent = signals.get(channel)
            if not sent:
                ctx.error(wait.mark("channel"), "unmatched-wait",
                          f"step '{step.name}' waits on channel '{channel}', but no step "
                          "signals it; the wait can never finish",
                          hint=did_you_mean(channel, signals)
                          or f"add a step '{{op: signal, channel: {channel}}}' before it")
                continue
            need = PARTNER[wait.from_]
            if all(signal.to != need for _, signal in sent):
                other, signal = sent[0]
                mark = wait.mark("from") if "from" in wait.src_marks else step.mark()
                ctx.error(mark, "peer-mismatch",
                          f"step '{step.name}' waits for '{wait.from_.value}' peers on channel "
                          f"'{channel}', but step '{other.name}' signals "
                          f"'{signal.to.value}' peers",
                          hint=f"use 'to: {need.value}' on '{other.name}' or "
                          f"'from: {PARTNER[signal.to].value}' here")
    for channel, items in signals.items():
        if channel not in waits:
            step, signal = items[0]
            ctx.error(signal.mark("channel"), "unmatched-signal",
                      f"step '{step.name}' signals channel '{channel}', but no step waits "
                      "on it", severity="warning",
                      hint=did_you_mean(channel, waits) or "add a wait or drop the signal")
