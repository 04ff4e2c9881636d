"""all_to_all: ``src`` split in W parts along ``dim``; part j of rank p lands in
``dst[p]`` on rank j (dst has a leading W axis). ``src``/``dst`` may be lists of the
same length: one exchange of several payloads. ``scale``: a cast inside the move
(dcpc/ops/cast.py; one payload split along dim 0, lowered with ragged_all_to_all's
kernel at full counts; not with split_dim/concat_dim). Every form takes ``axis:``.

With ``split_dim`` and ``concat_dim`` (both, and no ``dim``; JAX's
``all_to_all(x, split_axis, concat_axis)``): ``dst`` has src's rank; ``src`` split in W
parts along ``split_dim``, part j of rank p lands on rank j as block p along
``concat_dim`` (DeepSpeed-Ulysses' sequence <-> head exchange lands in token order).
``phase: put`` / ``phase: wait`` split it as all_gather's (dcpc.ops._split: the k-th
wait of the same src, dst, dim, split_dim, concat_dim and axis polls the k-th put; not
with ``scale``): the put pushes and signals, its stores in flight until the wait, which
waits for every peer; the reference lands dst there; the torch backend moves at the put.
Lowerings: ``lower`` below + templates/ops/all_to_all.py.j2;
dcpc/runtime/collectives.py ``all_to_all``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.expr import div, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops import _split as split
from dcpc.ops import cast
from dcpc.ops._split import PUT, WAIT
from dcpc.ops.cast import Scale
from dcpc.ops.common import (
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    dim_text,
    effects,
    keyed,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define, names

if TYPE_CHECKING:
    from dcpc.lang.nodes import ScheduleView
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class AllToAll(OpBase):
    op: Literal["all_to_all"]
    src: Name | list[Name]
    dst: Name | list[Name]
    dim: Int = 0
    scale: Scale | None = None
    split_dim: Int | None = Field(default=None, description="with concat_dim: dst has src's rank")
    concat_dim: Int | None = Field(default=None, description="where rank p's part lands: block p")
    phase: Literal["put", "wait"] | None = Field(
        default=None, description="put: push and signal, no wait; wait: a later step "
        "naming the same src, dst, dims and axis polls it (dcpc.ops._split)")

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` shares with the put it polls (dcpc.ops._split)."""
        src, dst = tuple(names(self.src)), tuple(names(self.dst))
        return (src, dst, *(split.dim_key(schedule, b[0], d) for b, d in (
            (src, self.dim), (src, self.split_dim), (dst, self.concat_dim))),
                split.axis_key(schedule, self))


def concat(op: AllToAll) -> bool:
    """Whether the exchange concatenates (split_dim/concat_dim) rather than stacks."""
    return op.concat_dim is not None


def dims(op: AllToAll, rank: int) -> tuple[int, int]:
    """(split, concat) dims normalised for a buffer of ``rank`` dims (verified in range)."""
    assert op.split_dim is not None and op.concat_dim is not None
    return op.split_dim % rank, op.concat_dim % rank


def semantics(c: Scope, step: Step) -> Semantics:
    op: AllToAll = step.op  # type: ignore[assignment]
    before = effects(READ, BEFORE, keyed(op, "src"))
    if not concat(op):
        before += effects(WRITE, BEFORE, keyed(op, "dst"), Region("index", 0))
        return split.exchange(c, step, before + cast.effects(c.schedule, op), [])
    for dst in keyed(op, "dst"):  # writer p: block p along concat_dim of every rank's dst
        spec = c.schedule.buffers.get(dst[0])
        d = op.concat_dim % len(spec.shape) if spec is not None and spec.shape else 0
        region = Region("block", d, 0, dim_text(c.schedule, dst[0], d))
        before += effects(WRITE, BEFORE, [dst], region)
    return split.exchange(c, step, before, [])


def verify(v: ShapeRules, step: Step) -> None:
    op: AllToAll = step.op  # type: ignore[assignment]
    if op.scale is not None and op.phase is not None:
        v.error(op.mark("phase"), "bad-cast",
                f"all_to_all '{step.name}' casts ('scale'); a cast does not split in "
                "'phase: put' / 'phase: wait'",
                hint="split an all_to_all without 'scale', or drop 'phase'")
    else:
        split.verify_exchange(v, step, waits=f"for the parts into '{names(op.dst)[0]}'",
                              puts=f"the parts of '{names(op.src)[0]}' to every peer",
                              same="src, dst, dim, split_dim, concat_dim and axis")
    _verify_forms(v, step)


def _verify_forms(v: ShapeRules, step: Step) -> None:
    op: AllToAll = step.op  # type: ignore[assignment]
    if op.scale is not None and (op.split_dim is not None or op.concat_dim is not None):
        v.error(op.mark("scale"), "bad-cast",
                f"all_to_all '{step.name}' casts ('scale') only with dim (one payload split "
                "along dim 0), not with split_dim/concat_dim",
                hint="cast in a separate all_to_all with dim, or drop split_dim/concat_dim")
        return
    if op.scale is not None:
        cast.verify_move(v)
        return
    if op.split_dim is None and op.concat_dim is None:
        for src, dst in v.pairs(v.refs("src"), v.refs("dst")):
            v.scatter(src, dst)
        return
    given = [k for k in ("split_dim", "concat_dim") if getattr(op, k) is not None]
    if len(given) == 1 or "dim" in op.src_marks:
        key = "dim" if "dim" in op.src_marks else given[0]
        v.error(op.mark(key), "bad-dims",
                f"all_to_all '{step.name}' needs both split_dim and concat_dim (JAX's "
                "split_axis, concat_axis) and then no dim; it has "
                + ", ".join(k for k in ("dim", "split_dim", "concat_dim")
                            if k in op.src_marks),
                hint="give split_dim and concat_dim (dst has src's rank), or dim alone "
                "(dst stacks the W parts on a leading W axis)")
        return
    for src, dst in v.pairs(v.refs("src"), v.refs("dst")):
        _verify_concat(v, step, src, dst)


def _verify_concat(v: ShapeRules, step: Step, src: Any, dst: Any) -> None:
    op: AllToAll = step.op  # type: ignore[assignment]
    v.transfer(src, dst, symmetric=True)
    shape = v.shape(src.name)
    if shape is None:
        return
    n = len(shape)
    for key in ("split_dim", "concat_dim"):
        value = getattr(op, key)
        if not -n <= value < n:
            v.error(op.mark(key), "dim-out-of-range",
                    f"{key} {value} is out of range for src '{src.name}', which has {n} dims "
                    f"(valid: {-n}..{n - 1})")
            return
    along, cat = dims(op, n)
    part = v.part_along(src, along)
    if part is None or v.shape(dst.name) is None:
        return
    want = list(part)
    want[cat] = ("*", v.W, want[cat])
    v.expect(dst, want, f"src '{src.name}' split in W parts along dim {along}, rank p's part "
             f"as block p along dim {cat}")


def reference(sim: SimView, step: Step) -> None:
    op: AllToAll = step.op  # type: ignore[assignment]
    if op.scale is not None:
        cast.all_to_all_reference(sim, op)
        return
    if split.land(sim, step):  # a wait: what its put moved lands here
        return
    store = split.store(sim, step)
    for src, dst in zip(names(op.src), names(op.dst), strict=True):
        if not concat(op):
            sim.all_to_all(src, dst, op.dim, store)
            continue
        import torch  # the compiler imports no torch; only the simulator runs this

        along, cat = dims(op, sim.bufs[0][src].dim())
        parts = [torch.chunk(sim.bufs[p][src], sim.world, dim=along) for p in range(sim.world)]
        for j in range(sim.world):
            store(j, dst, torch.cat([parts[p][j] for p in range(sim.world)], dim=cat))


def io(op: AllToAll) -> IO:
    scale = [op.scale.buffer] if op.scale is not None else []  # read, or sent (symmetric)
    return split.io(op, names(op.src) + scale, names(op.dst))


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, AllToAll)
    if op.scale is not None:  # a cast: ragged_all_to_all's kernel at full counts
        return cast.lower_move(ctx, step)
    srcs, dsts = names(op.src), names(op.dst)
    waits = op.phase == WAIT  # no src: the scalars only (its put's grid)
    plan = ctx.plan(step, params=[] if waits else ctx.engine(srcs),
                    returns=[] if op.phase == PUT else list(dsts), signalling=True)
    concatenating = concat(op)
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        shape = ctx.shape(s)
        d, cat = dims(op, len(shape)) if concatenating else (op.dim, 0)
        plan.roles[f"src{k}"], plan.roles[f"dst{k}"] = s, t
        part = div(product(shape[d:]), ctx.team_w(step))
        plan.scalars += [
            (f"outer{k}", product(shape[:d])),
            (f"part{k}", part),
            (f"inner{k}", product(shape[d + 1 :])),
        ]
        if concatenating:  # a part's dims [cat:] make one block of dst, rank p's at block p
            chunk = [div(x, ctx.team_w(step)) if i == d else x for i, x in enumerate(shape)]
            plan.scalars.append((f"block{k}", product(chunk[cat:])))
            if not waits:
                plan.scratch[f"recv{k}"] = (product(shape), ctx.buffers[s].dtype)
        plan.tiles.append(part)
        if not waits:
            ctx.layout(plan, f"src{k}", d, d + 1)
            plan.scratch[f"send{k}"] = (product(shape), ctx.buffers[s].dtype)
    plan.attrs["payloads"] = len(srcs)
    plan.attrs |= split.lowered(ctx, step)
    if concatenating:  # absent otherwise: a stacking exchange's plan and module stay as they were
        plan.attrs["concat"] = True
    return plan


DEF = define(OpDef("all_to_all", AllToAll, semantics, verify, reference, io, lower,
                   teams=True, exact=True, inputs=cast.input_rules))
