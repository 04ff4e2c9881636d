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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dcpc.lang import expr as ex
from dcpc.lang.expr import ONE, W, product
from dcpc.lang.nodes import Int, Name, OpBase, Step
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
    from dcpc.ops.iface import LowerRules, ShapeRules, SimView


class Pull(OpBase):
    """Read every rank's symmetric ``src`` into ``dst[p]`` (a new W axis at ``dim``)."""

    op: Literal["pull"]
    src: Name
    dst: Name
    dim: Int = 0


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
    s, d = v.shape(src.name), v.shape(dst.name)
    if s is None or d is None:
        return
    if len(d) != len(s) + 1:
        v.error(dst.mark, "shape-mismatch",
                f"dst '{dst.name}' of pull '{step.name}' has {len(d)} dims; it needs "
                f"{len(s) + 1}: src '{src.name}' ({len(s)} dims) stacked along a new W axis")
        return
    dim = v.dim(dst, len(d))
    if dim is None:
        return
    v.expect(dst, [*s[:dim], v.W, *s[dim:]],
             f"src '{src.name}' of every rank stacked {ex.unparse(v.W)} times at dim {op.dim}")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op = typed(step, Pull)
    pulled = torch.stack([sim.bufs[p][op.src] for p in range(sim.world)], dim=op.dim)
    for r in range(sim.world):
        sim.store(r, op.dst, pulled.clone())


def io(op: Pull) -> IO:
    return [op.src], [op.dst]


def lower(ctx: LowerRules, step: Step) -> Any:
    """src as [outer, rows, row_len] (rows: src's dim ``dim``), dst as [outer, W, rows,
    row_len]; both packed (src symmetric, dst written by this module)."""
    op = typed(step, Pull)
    src = ctx.shape(op.src)
    d = op.dim  # of dst's dims (the verifier refuses a negative one)
    rows = src[d] if d < len(src) else ONE
    plan = ctx.plan(
        step,
        params=[],
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst},
        scalars=[("outer", product(src[:d])), ("rows", rows),
                 ("row_len", product(src[d + 1:]))],
        tiles=[product(src[d + 1:])],
        signalling=True,
    )
    # the torch body gathers through a staging buffer, as all_gather's does
    plan.scratch["stage"] = (product([W, *src]), ctx.buffers[op.src].dtype)
    return plan


DEF = define(OpDef("pull", Pull, semantics, verify, reference, io, lower, teams=True,
                   exact=True))
