"""all_gather: every rank's ``src`` lands in every rank's ``dst``.

Concatenating (dst has src's rank: block ``rank`` along ``dim``, or with
``interleave`` I the rows ``(j // I) * W * I + rank * I + j % I``) or stacking (dst
has one more dim: index ``rank`` of ``dim``, whose size is W).
Lowerings: dcpc/codegen/rules.py ``all_gather`` + templates/ops/all_gather.py.j2;
dcpc/runtime/collectives.py ``all_gather``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops.common import (
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    dim_text,
    effects,
    exchange,
    keyed,
)
from dcpc.ops.registry import IO, OpDef, define, names

if TYPE_CHECKING:
    from dcpc.check.ops import Verify
    from dcpc.harness.simulate import Sim


class AllGather(OpBase):
    op: Literal["all_gather"]
    src: Name
    dst: Name
    dim: Int = 0
    interleave: Int | None = Field(default=None, ge=1)


def semantics(c: Scope, step: Step) -> Semantics:
    op: AllGather = step.op  # type: ignore[assignment]
    s = c.schedule
    src, dst = s.buffers.get(op.src), s.buffers.get(op.dst)
    if op.interleave:
        region = Region("interleave", op.dim, op.interleave)
    else:
        stacked = src is not None and dst is not None and len(dst.shape) == len(src.shape) + 1
        region = Region("index" if stacked else "block", op.dim, 0,
                        dim_text(s, op.dst, op.dim))
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, keyed(op, "dst"), region)
    return exchange(before, [], step)


def verify(v: Verify, step: Step) -> None:
    op = step.op
    assert isinstance(op, AllGather)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    v.transfer(src, dst, symmetric=True)
    s, d = v.shape(src.name), v.shape(dst.name)
    if s is None or d is None:
        return
    if len(d) == len(s):  # concat: W blocks along dim
        dim = v.dim(src, len(s))
        if dim is None:
            return
        want = [*s[:dim], ("*", v.W, s[dim]), *s[dim + 1:]]
        v.expect(dst, want, f"W blocks of src '{src.name}' along dim {dim}")
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
        v.expect(dst, want, f"src '{src.name}' stacked W times at dim {dim}")
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


def reference(sim: Sim, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: AllGather = step.op  # type: ignore[assignment]
    world = sim.world
    parts = [sim.bufs[r][op.src] for r in range(world)]
    dst_shape = sim.shape(op.dst)
    if len(dst_shape) == parts[0].dim() + 1:
        gathered = torch.stack(parts, dim=op.dim)
    elif op.interleave is None:
        gathered = torch.cat(parts, dim=op.dim)
    else:
        n, inter = parts[0].shape[op.dim], op.interleave
        gathered = torch.empty(dst_shape, dtype=torch.float64)
        for r, part in enumerate(parts):
            j = torch.arange(n)
            rows = (j // inter) * world * inter + r * inter + j % inter
            gathered.index_copy_(op.dim, rows, part.to(torch.float64))
    for r in range(world):
        sim.store(r, op.dst, gathered.clone())


def io(op: AllGather) -> IO:
    return names(op.src), names(op.dst)


DEF = define(OpDef("all_gather", AllGather, semantics, verify, reference, io))
