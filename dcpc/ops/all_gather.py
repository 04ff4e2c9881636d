"""all_gather: every rank's ``src`` lands in every rank's ``dst``.

``src`` and ``dst`` may be lists of the same length: one exchange of several payloads
(one kernel, one signal), each gathered as follows. Concatenating (dst has src's
rank: block ``rank`` along ``dim``, or with ``interleave`` I the rows
``(j // I) * W * I + rank * I + j % I``) or stacking (dst has one more dim: index
``rank`` of ``dim``, whose size is W).
``phase: put`` / ``phase: wait`` split it as ragged_all_to_all's (dcpc.ops._split: the
k-th wait of the same src, dst, dim, interleave and axis polls the k-th put): the put
pushes and signals, its stores in flight until the wait, which waits for every peer;
the reference lands the gathered dst at the wait; the torch backend moves at the put.
Lowerings: ``lower`` below + templates/ops/all_gather.py.j2;
dcpc/runtime/collectives.py ``all_gather``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from dcpc.lang import expr as ex
from dcpc.lang.expr import ONE, W, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops import _split as split
from dcpc.ops._split import PUT, WAIT
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
    from dcpc.ops.iface import LowerRules, Ref, ShapeRules, SimView


class AllGather(OpBase):
    op: Literal["all_gather"]
    src: Name | Annotated[list[Name], Field(min_length=1)]
    dst: Name | Annotated[list[Name], Field(min_length=1)]
    dim: Int = 0
    interleave: Int | None = Field(default=None, ge=1)
    phase: Literal["put", "wait"] | None = Field(
        default=None, description="put: push and signal, no wait; wait: a later step "
        "naming the same src, dst, dim, interleave and axis polls it (dcpc.ops._split)")

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` shares with the put it polls (dcpc.ops._split)."""
        dst = tuple(names(self.dst))
        return (tuple(names(self.src)), dst, split.dim_key(schedule, dst[0], self.dim),
                self.interleave, split.axis_key(schedule, self))


def _region(c: Scope, op: AllGather, src_name: str | None, dst_name: str) -> Region:
    """The part of every rank's ``dst_name`` that one writer's store covers."""
    s = c.schedule
    if op.interleave:
        return Region("interleave", op.dim, op.interleave)
    src = s.buffers.get(src_name) if src_name is not None else None
    dst = s.buffers.get(dst_name)
    stacked = src is not None and dst is not None and len(dst.shape) == len(src.shape) + 1
    return Region("index" if stacked else "block", op.dim, 0, dim_text(s, dst_name, op.dim))


def semantics(c: Scope, step: Step) -> Semantics:
    op: AllGather = step.op  # type: ignore[assignment]
    srcs = keyed(op, "src")
    before = effects(READ, BEFORE, srcs)
    for k, dst in enumerate(keyed(op, "dst")):  # payload k: src[k] into dst[k]
        src = srcs[k][0] if k < len(srcs) else None  # (unequal lists are reported)
        before += effects(WRITE, BEFORE, [dst], _region(c, op, src, dst[0]))
    return split.exchange(c, step, before, [])


def verify(v: ShapeRules, step: Step) -> None:
    assert isinstance(step.op, AllGather)
    for src, dst in v.pairs(v.refs("src"), v.refs("dst")):
        _verify_pair(v, step, src, dst)
    op = step.op
    split.verify_exchange(v, step, waits=f"for the gather into '{names(op.dst)[0]}'",
                          puts=f"'{names(op.src)[0]}' into every peer's '{names(op.dst)[0]}'",
                          same="src, dst, dim, interleave and axis")


def _verify_pair(v: ShapeRules, step: Step, src: Ref, dst: Ref) -> None:
    op: AllGather = step.op  # type: ignore[assignment]
    v.transfer(src, dst, symmetric=True)
    s, d = v.shape(src.name), v.shape(dst.name)
    if s is None or d is None:
        return
    if len(d) == len(s):  # concat: W blocks along dim
        dim = v.dim(src, len(s))
        if dim is None:
            return
        want = [*s[:dim], ("*", v.W, s[dim]), *s[dim + 1:]]
        v.expect(dst, want, f"{ex.unparse(v.W)} blocks of src '{src.name}' along dim {dim}")
        if op.interleave is not None and dim != 0:
            v.error(op.mark("interleave"), "bad-interleave",
                    f"interleave puts token blocks in sequence order along dim 0, but "
                    f"step '{step.name}' gathers along dim {dim}",
                    hint="gather along 'dim: 0' or drop 'interleave'")
    elif len(d) == len(s) + 1:  # stack: a new axis of size W
        dim = v.dim(dst, len(d))
        if dim is None:
            return
        want = [*s[:dim], v.W, *s[dim:]]
        v.expect(dst, want, f"src '{src.name}' stacked {ex.unparse(v.W)} times at dim {dim}")
        if op.interleave is not None:
            v.error(op.mark("interleave"), "bad-interleave",
                    f"step '{step.name}' stacks along a new axis; interleave needs a "
                    "concatenating gather (dst with the same number of dims as src)",
                    hint="drop 'interleave'")
    else:
        v.error(dst.mark, "shape-mismatch",
                f"dst '{dst.name}' of all_gather '{step.name}' has {len(d)} dims; it needs "
                f"{len(s)} (blocks concatenated along dim) or {len(s) + 1} (stacked), as "
                f"src '{src.name}' has {len(s)}")


def reference(sim: SimView, step: Step) -> None:
    op: AllGather = step.op  # type: ignore[assignment]
    if split.land(sim, step):  # a wait: what its put gathered lands here
        return
    for src, dst in zip(names(op.src), names(op.dst), strict=True):
        _gather(sim, op, src, dst, split.store(sim, step))


def _gather(sim: SimView, op: AllGather, src: str, dst: str, store: Any) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    world = sim.world
    parts = [sim.bufs[r][src] for r in range(world)]
    dst_shape = sim.shape(dst)
    if len(dst_shape) == parts[0].dim() + 1:
        gathered = torch.stack(parts, dim=op.dim)
    elif op.interleave is None:
        gathered = torch.cat(parts, dim=op.dim)
    else:
        n, inter = parts[0].shape[op.dim], op.interleave
        gathered = torch.empty(dst_shape, dtype=parts[0].dtype)  # float64 or int64: exact
        for r, part in enumerate(parts):
            j = torch.arange(n)
            rows = (j // inter) * world * inter + r * inter + j % inter
            gathered.index_copy_(op.dim, rows, part)
    for r in range(world):
        store(r, dst, gathered.clone())


def io(op: AllGather) -> IO:
    return split.io(op, names(op.src), names(op.dst))


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, AllGather)
    srcs, dsts = names(op.src), names(op.dst)
    waits = op.phase == WAIT  # no src: the scalars only (its put's grid)
    plan = ctx.plan(step, params=[] if waits else ctx.engine(srcs),
                    returns=[] if op.phase == PUT else list(dsts), signalling=True)
    stacks = []
    for k, (s, t) in enumerate(zip(srcs, dsts, strict=True)):
        p = str(k) if k else ""  # payload 0 keeps the unsuffixed names
        src, dst = ctx.shape(s), ctx.shape(t)
        d = op.dim
        stack = len(dst) == len(src) + 1
        outer = product(src[:d])
        if stack:  # a concat of W blocks of src[d] rows each (interleave = rows): one layout
            rows = src[d] if d < len(src) else ONE
            row_len, interleave = product(src[d + 1 :]), rows
        else:
            rows, row_len = src[d], product(src[d + 1 :])
            interleave = ("num", op.interleave) if op.interleave else rows
        plan.roles[f"src{p}"], plan.roles[f"dst{p}"] = s, t
        plan.scalars += [
            (f"outer{p}", outer),
            (f"rows{p}", rows),
            (f"row_len{p}", row_len),
            (f"interleave{p}", interleave),
        ]
        plan.tiles.append(row_len)
        if not waits:
            plan.scratch[f"stage{p}"] = (product([W, *src]), ctx.buffers[s].dtype)
            ctx.layout(plan, f"src{p}", d, min(d + 1, len(src)))
        stacks.append(stack)
    plan.attrs["payloads"] = [("" if k == 0 else str(k), stack) for k, stack in enumerate(stacks)]
    plan.attrs |= split.lowered(ctx, step)
    return plan


DEF = define(OpDef("all_gather", AllGather, semantics, verify, reference, io, lower,
                         teams=True, exact=True))
