"""reduce_scatter: ``src`` split in W parts along ``dim``; part j of every rank lands
in the symmetric receive buffer ``via`` ([W, part]; implicit ``<step>_recv`` when
omitted) on rank j, which sums them in fp32 into ``dst`` (an fp8 ``dst`` divided by
``output_scale``).
``phase: put`` / ``phase: wait`` split it as all_gather's (dcpc.ops._split: the k-th wait
of the same src, dst, dim, via, output_scale and axis polls the k-th put): the put
pushes the parts into the peers' ``via`` and signals, those stores in flight until the
wait, which waits for every peer and then sums (an implicit ``via`` is the put's,
``<put>_recv``); the torch backend moves at the put and sums at the wait.
Lowerings: ``lower`` below + templates/ops/reduce_scatter.py.j2;
dcpc/runtime/collectives.py ``reduce_scatter``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import div, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops import _split as split
from dcpc.ops._reduce import floats_only, receive_buffer, via_of
from dcpc.ops._split import PUT, WAIT
from dcpc.ops.common import (
    AFTER,
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    buffers_of,
    effects,
    keyed,
    merge_input_rules,
    merge_inputs,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    import torch

    from dcpc.lang.nodes import ScheduleView
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView



class ReduceScatter(OpBase):
    op: Literal["reduce_scatter"]
    src: Name
    dst: Name
    dim: Int = 0
    via: Name | None = Field(
        default=None, description="symmetric receive buffer [W, part]; implicit if omitted"
    )
    output_scale: Name | None = Field(
        default=None, description="[1] f32: dst = clamp(out / scale) for an fp8 dst"
    )
    phase: Literal["put", "wait"] | None = Field(
        default=None, description="put: push the parts and signal, no wait; wait: a later "
        "step naming the same src, dst, dim, via, output_scale and axis polls it, then sums")

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` shares with the put it polls (dcpc.ops._split)."""
        return (self.src, self.dst, split.dim_key(schedule, self.src, self.dim), self.via,
                self.output_scale, split.axis_key(schedule, self))


def _via(holder: Any, step: Step) -> tuple[str, str]:
    """The receive buffer (and its key) of ``step``: a wait's is its put's (an implicit
    one is named after the put)."""
    put = split.matched(holder).polls.get(step.name) if step.op.phase == WAIT else None
    return via_of(put or step)


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    via = [_via(c, step)]
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, via, Region("index", 0))
    after = effects(READ, AFTER, via + merge_inputs(op)) + effects(WRITE, AFTER, keyed(op, "dst"))
    return split.exchange(c, step, before, after)


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, ReduceScatter)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    if op.via is not None:
        (via,) = v.refs("via")
        part = v.scatter(src, via)
    else:
        part = v.part(src) if v.buffer(src.name) is not None else None
    floats_only(v, step, [src, dst])  # summed in fp32, rounded once into dst
    if part is not None and v.shape(dst.name) is not None:
        v.expect(dst, part, f"this rank's part of src '{src.name}'")
    split.verify_exchange(v, step, waits=f"for the parts of '{op.src}' to sum into '{op.dst}'",
                          puts=f"the parts of '{op.src}' to every peer",
                          same="src, dst, dim, via, output_scale and axis")


def reference(sim: SimView, step: Step) -> None:
    """The parts pushed (held, with an explicit via's landing, from a put until its
    wait: dcpc.ops._split), then summed where the op waits (reading output_scale then)."""
    op: ReduceScatter = step.op  # type: ignore[assignment]
    pushed = step
    if op.phase == WAIT:
        split.land(sim, step)  # an explicit via lands here
        pushed = split.matched(sim).polls[step.name]
    else:
        store = split.store(sim, step)

        def keep(r: int, name: str, value: torch.Tensor) -> None:
            # rounded as via stores (an implicit one has src's dtype)
            sim.stash(r, f"{step.name}@parts", value, like=op.via or op.src)

        sim.all_to_all(op.src, op.via or f"{op.dst}__via", op.dim, keep)
        for r in range(sim.world):
            if op.via:
                store(r, op.via, sim.bufs[r][f"{step.name}@parts"])
        if op.phase == PUT:
            return
    for r in range(sim.world):
        parts = sim.bufs[r].pop(f"{pushed.name}@parts")
        sim.store(r, op.dst, sim.scaled(op, r, parts.sum(dim=0), sim.fp32_error(
            len(parts), parts.abs().sum(dim=0))))


def io(op: ReduceScatter) -> IO:
    """A split pair: the put reads src, its wait reads the output scale (the sum's) and
    writes dst (and via)."""
    sent, scale = [op.src], buffers_of(merge_inputs(op))
    landed = [op.dst] + ([op.via] if op.via else [])
    if op.phase == PUT:
        return sent, []
    return (scale, landed) if op.phase == WAIT else (sent + scale, landed)


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, ReduceScatter)
    shape = ctx.shape(op.src)
    outer, part = product(shape[: op.dim]), div(product(shape[op.dim :]), ctx.team_w(step))
    # a split pair's: the put pushes src into via, its wait sums via into dst
    pushes, sums = op.phase != WAIT, op.phase != PUT
    via = receive_buffer(ctx, step, outer, part) if pushes else _via(ctx, step)[0]
    roles = {"via": via} | ({"src": op.src} if pushes else {}) | ({"dst": op.dst} if sums else {})
    plan = ctx.plan(
        step,
        params=ctx.engine([op.src]) if pushes else [],
        returns=[op.dst] if sums else [],
        roles=roles,
        scalars=[("outer", outer), ("part", part)],
        tiles=[part],
        scratch={k: v for k, v, kept in (
            ("send", (product(shape), ctx.buffers[op.src].dtype), pushes),
            ("acc", (product(ctx.shape(op.dst)), "f32"), sums)) if kept},
        signalling=True,
        attrs=split.lowered(ctx, step),
    )
    if sums:  # only the sum reads output_scale: a put takes no scale
        ctx.output_scale(op, plan)
    else:
        plan.attrs["scale"] = False
    return plan


DEF = define(OpDef("reduce_scatter", ReduceScatter, semantics, verify, reference, io, lower,
                         teams=True, inputs=merge_input_rules))
