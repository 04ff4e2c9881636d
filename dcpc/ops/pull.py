"""pull: a remote read (one-sided get). Rank r reads the symmetric ``src`` of every rank p
straight out of p's memory into index p of its own ``dst`` along ``dim`` (all_gather's
stack form, read instead of pushed: vLLM's one-shot custom all-reduce reads its peers'
inputs so).

Sync: the read needs the peer's ``src`` written, so every rank first signals every peer
("ready": its ``src`` was written by earlier steps, in stream order) and waits for every
peer's ready; the reads and the store into ``dst`` come after the wait. The op signals
nothing after its reads: a peer must not overwrite ``src`` (the next call's write) until
every puller has read it, and that order is the schedule's to give, by a credit after the
pull (``signal`` to all after it, ``wait`` from all before the next write of ``src``: a
split-phase barrier) or a barrier. The read is modelled as what it is, a read of EVERY
rank's ``src`` by every rank after its wait (``Region("whole")``), so a schedule that
rewrites ``src`` without the credit is a write-after-read race of the checker's.
``axis:`` (the op's team, dcpc.lang.mesh): r and p are team members, W the team's size;
the rules are written for the team (``on_team`` gives the region and the sync its axes,
the reference runs once per team).
Lowerings: ``lower`` below + templates/ops/pull.py.j2 (signal, wait, then loads through
the peers' pointers of ``src``); on the torch backend the template's body is an
all_gather of the stack form (complete on return, as every torch step).

Split forms (issue 33: vLLM's two-shot custom all-reduce): a ``dst`` of ``src``'s rank
splits the dim ``dim`` of S rows in W parts, part p the rows ``p * (S // W)`` on, S // W
of them, and the last part also the remainder (``split: last``, vLLM's
cross_device_reduce_2stage rule; ``split: even``, the default: S must divide, as every
other split of the language). The concat form reads part p out of rank p's ``src`` (its
first rows) into part p of ``dst`` (all_gather's concat form, read); ``reduce: sum``
reads part r (this rank's) out of every rank's ``src`` and sums it in fp32 in the order
r, r + 1, .., r - 1 (vLLM's ``packed_reduce`` over its rotated pointers), from the first
value, rounded once into ``dst``'s part. The part side of ``split: last`` (the concat's
``src``, the reduce's ``dst``) is sized S, the whole dim: the largest part, S // W + S % W,
has no shape expression; rows past the part are not read (concat) or written +0 (reduce).
The effects stay a read of every rank's whole ``src`` (a superset of the parts: sound).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang import expr as ex
from dcpc.lang.expr import ONE, W, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
from dcpc.ops._reduce import floats_only
from dcpc.ops.common import (
    AFTER,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    effects,
    exchange,
    keyed,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    import torch

    from dcpc.ops.iface import LowerRules, ShapeRules, SimView, TorchComm


class Pull(OpBase):
    """Read every rank's symmetric ``src`` into ``dst[p]`` (a new W axis at ``dim``)."""

    op: Literal["pull"]
    src: Name
    dst: Name
    dim: Int = 0
    reduce: Literal["sum"] | None = Field(
        default=None, description="sum this rank's part of every rank's src (dst: the part)")
    split: Literal["even", "last"] = Field(
        default="even", description="parts of dim: equal, or floor with the rest on the last")


def parts(rows: int, world: int) -> list[tuple[int, int]]:
    """(start, length) of the W parts of ``rows``: ``rows // W`` each, the remainder on the
    last (vLLM's ``part = size / ngpus``, ``end = rank == ngpus - 1 ? size : start + part``);
    rows that W divides get equal parts, the same rule."""
    part = rows // world
    return [(p * part, part if p < world - 1 else rows - p * part) for p in range(world)]


_pull_parts = parts  # the name torch_body calls it by in a generated module (OpDef.torch_uses)


def form(op: Pull, src_dims: int, dst_dims: int) -> str:
    """"stack" (dst: src with a new W axis), "reduce" (``reduce: sum``) or "concat" (dst of
    src's rank: the parts of every rank side by side)."""
    if op.reduce is not None:
        return "reduce"
    return "stack" if dst_dims == src_dims + 1 else "concat"


def semantics(c: Scope, step: Step) -> Semantics:
    op = typed(step, Pull)
    after = effects(READ, AFTER, keyed(op, "src"), Region("whole", 0))
    after += effects(WRITE, AFTER, keyed(op, "dst"))
    return exchange([], after, step)


def verify(v: ShapeRules, step: Step) -> None:
    op = typed(step, Pull)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    source = v.buffer(src.name)
    if source is not None and not source.is_symmetric:
        v.error(src.mark, "not-symmetric",
                f"step '{step.name}' reads src '{src.name}' out of every peer's memory, so "
                "it must be in symmetric memory, but it is engine-owned",
                hint=f"add 'symmetric: true' to buffer '{src.name}'")
    v.transfer(src, dst, symmetric=False)
    if op.reduce is not None:
        floats_only(v, step, [src, dst], "with reduce: sum it sums in fp32, so it reads "
                    "and writes floating-point values")
        target = v.buffer(dst.name)
        if target is not None and target.dtype.is_fp8:
            v.error(op.mark("reduce"), "bad-reduce",
                    f"pull '{step.name}' sums into {target.dtype.value} dst '{dst.name}', but "
                    "it takes no "
                    "output_scale", hint="sum into bf16, f16 or f32 and cast after")
    s, d = v.shape(src.name), v.shape(dst.name)
    if s is None or d is None:
        return
    shape = form(op, len(s), len(d))
    if shape == "stack":
        if "split" in op.src_marks:  # nothing is split: every rank's whole src is read
            v.error(op.mark("split"), "bad-split",
                    f"pull '{step.name}' stacks every rank's whole src '{src.name}' into "
                    f"'{dst.name}' (one more dim), so nothing is split by 'split: {op.split}'",
                    hint=f"drop 'split', or give dst '{dst.name}' src's {len(s)} dims "
                    "(the parts side by side)")
            return
        dim = v.dim(dst, len(d))
        if dim is None:
            return
        v.expect(dst, [*s[:dim], v.W, *s[dim:]],
                 f"src '{src.name}' of every rank stacked {ex.unparse(v.W)} times at dim "
                 f"{op.dim}")
        return
    if len(d) != len(s):
        v.error(dst.mark, "shape-mismatch",
                f"dst '{dst.name}' of pull '{step.name}' has {len(d)} dims; it needs "
                f"{len(s) + 1}: src '{src.name}' ({len(s)} dims) stacked along a new W axis, "
                f"or {len(s)}: the parts side by side" + (
                    " (reduce: sum: this rank's part)" if shape == "reduce" else ""))
        return
    dim = v.dim(src, len(s))
    if dim is None:
        return
    if op.split == "last":  # the part side is sized for the whole dim (module docstring)
        side = dst.name if shape == "reduce" else src.name
        v.expect(dst, s, f"split: last, so the part side '{side}' is sized for the whole dim")
    elif shape == "reduce":
        part = v.part(src)  # S / W, or inexact-division
        if part is not None:
            v.expect(dst, part, f"this rank's part of src '{src.name}' along dim {op.dim}")
    else:
        v.expect(dst, [*s[:dim], product([v.W, s[dim]]), *s[dim + 1:]],
                 f"src '{src.name}' of every rank side by side along dim {op.dim}")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op = typed(step, Pull)
    shape = form(op, len(sim.shape(op.src)), len(sim.shape(op.dst)))
    world = sim.world
    if shape == "stack":
        pulled = torch.stack([sim.bufs[p][op.src] for p in range(world)], dim=op.dim)
        for r in range(world):
            sim.store(r, op.dst, pulled.clone())
        return
    whole = sim.shape(op.src if shape == "reduce" else op.dst)[op.dim]
    split = parts(whole, world)
    if shape == "concat":  # part p is the first rows of rank p's src
        pulled = torch.cat([sim.bufs[p][op.src].narrow(op.dim, 0, n)
                            for p, (_, n) in enumerate(split)], dim=op.dim)
        for r in range(world):
            sim.store(r, op.dst, pulled.clone())
        return
    for r, (start, n) in enumerate(split):  # this rank's part of every rank's src, from r on
        total = sim.bufs[r][op.src].narrow(op.dim, start, n).clone()
        for k in range(1, world):
            total = total + sim.bufs[(r + k) % world][op.src].narrow(op.dim, start, n)
        out = torch.zeros(sim.shape(op.dst), dtype=torch.float64)  # rows past the part: +0
        out.narrow(op.dim, 0, n).copy_(total)
        sim.store(r, op.dst, out)


def io(op: Pull) -> IO:
    return [op.src], [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    """src as [outer, rows, row_len] (rows: src's dim ``dim``), dst as [outer, W, rows,
    row_len]; both packed (src symmetric, dst written by this module). A split form:
    ``rows`` the whole dim S, ``prows`` the part side's rows (S / W, or S under
    ``split: last``), ``attrs["form"]`` "concat" or "reduce"."""
    op = typed(step, Pull)
    src, dst = ctx.shape(op.src), ctx.shape(op.dst)
    d = op.dim  # of dst's dims (the verifier refuses a negative one)
    shape = form(op, len(src), len(dst))
    if shape == "stack":
        rows = src[d] if d < len(src) else ONE
        scalars = [("outer", product(src[:d])), ("rows", rows),
                   ("row_len", product(src[d + 1:]))]
        attrs: dict[str, Any] = {}
    else:
        whole, side = (src, dst) if shape == "reduce" else (dst, src)
        scalars = [("outer", product(src[:d])), ("rows", whole[d]), ("prows", side[d]),
                   ("row_len", product(src[d + 1:]))]
        attrs = {"form": shape}
    plan = ctx.plan(
        step,
        params=[],
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=scalars,
        tiles=[product(src[d + 1:])],
        signalling=True,
        attrs=attrs,
    )
    # the torch body gathers through a staging buffer, as all_gather's does
    plan.scratch["stage"] = (product([W, *src]), ctx.buffers[op.src].dtype)
    return plan


def moves(op: Pull) -> bool:
    """Whether the step moves bits (compared bit for bit): not a ``reduce: sum``."""
    return op.reduce is None


def torch_body(comm: TorchComm, src: torch.Tensor, dst: torch.Tensor, stage: torch.Tensor,
               outer: int, rows: int, prows: int, row_len: int, world: int,
               reduce: bool) -> None:
    """The split forms on the torch backend (copied into the module as ``_pull_torch``):
    every rank's whole src gathered, then ``reduce``: dst ([outer, prows, row_len]) = this
    rank's part of every src summed in fp32 from this rank's on (the kernel's order),
    rows past it +0; else dst ([outer, rows, row_len]) part p = the first rows of rank p's
    src ([outer, prows, ...])."""
    import torch
    import torch.distributed as dist

    n = outer * (rows if reduce else prows) * row_len
    if n == 0:  # an empty call: nothing moves
        return
    staged = stage[: world * n]
    if world == 1:
        staged.copy_(src.reshape(-1))
    else:
        work = dist.all_gather_into_tensor(
            comm.wire(staged), comm.wire(src.reshape(-1)), group=comm.group, async_op=True
        )
        comm.wait(work, "pull")
    split = _pull_parts(rows, world)  # the op's parts(): (start, length) of each part
    if reduce:
        every = staged.view(world, outer, rows, row_len)
        start, mine = split[comm.rank]
        acc = every[comm.rank, :, start : start + mine].to(torch.float32, copy=True)
        for k in range(1, world):
            acc += every[(comm.rank + k) % world, :, start : start + mine]
        out = dst.view(outer, prows, row_len)
        out.zero_()
        out[:, :mine].copy_(acc)
        return
    every = staged.view(world, outer, prows, row_len)
    out = dst.view(outer, rows, row_len)
    for p, (start, length) in enumerate(split):
        out[:, start : start + length].copy_(every[p, :, :length])


def calls_torch(step: Any) -> bool:
    """A split form's plan calls ``torch_body`` (its parts); a stack, the runtime's
    all_gather."""
    return bool(step.attrs.get("form"))


DEF = define(OpDef("pull", Pull, semantics, verify, reference, io, lower, teams=True,
                   exact=True, computes=lambda op: not moves(op), torch=torch_body,
                   calls_torch=calls_torch, torch_uses=(parts,)))
