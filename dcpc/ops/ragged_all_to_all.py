"""ragged_all_to_all: the MoE dispatch/combine move (DeepEP low-latency layout).

``src`` [W, capacity, *row] holds one block of ``capacity`` rows per peer (peer-major,
as DeepEP's low-latency receive buffer keeps one ``num_max_dispatch_tokens_per_rank``
block per source rank); ``counts`` [W] (integers, read on this rank) says how many rows
of block j are live. Rank p sends rows ``[0, counts[j])`` of block j to rank j, where
they land in ``dst[p, :counts[j]]`` (``dst`` [W, capacity, *row], symmetric), and the
count travels with the payload into ``recv_counts[p]`` ([W] i32, symmetric). Rows of
``dst`` past the count are never written (the reference holds NaN there, or for an
integer payload, such as top-k expert ids, ``UNSENT_INT`` of dcpc.harness.simulate, so a
reader that takes them for data shows as a mismatch).

A count over ``capacity`` (or negative) is not truncated: that part is not sent at all,
its receiver gets the count as sent (the flag) and the sender records a kernel error
that its call raises (``DcpcArgumentError``, code ``OVER_CAPACITY``); the torch backend
raises before it sends. ``scale``: a cast inside the move (dcpc/ops/cast.py: bf16 ->
fp8 e4m3 with per-token or per-tensor scales, and back).

``src``/``dst`` may be lists of the same length (DeepEP's dispatch: the tokens, their
top-k expert ids and weights): every payload [W, capacity, *row_k] moves the same rows
with the one ``counts``, in one kernel and one signal; a cast applies to the FIRST
payload only (cast.payload), the others move bit for bit in their own dtype.
``axis:`` (a team): W is the team's size, j and p member indices (the kernel's
RANK/WORLD); the error record names the peer's global rank (dcpc.runtime.errors,
OVER_CAPACITY).
``phase: put`` / ``phase: wait`` split it as shift's (dcpc.ops._split matches them): the put
pushes and signals, its stores in flight (``Effect.lands``) until the wait, which waits
for every peer and then reads the counts; the reference holds the rows at the put and
lands them at the wait; the torch backend moves them at the put, and handshakes there
(dcpc.ops._split.torch_handshake).
Lowerings: ``lower`` below + templates/ops/ragged_all_to_all.py.j2;
dcpc/runtime/collectives.py ``ragged_all_to_all``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang import expr as ex
from dcpc.lang.expr import product
from dcpc.lang.nodes import Name, OpBase, SizeExpr, Step
from dcpc.ops import _split as split
from dcpc.ops import cast
from dcpc.ops._split import PUT, WAIT
from dcpc.ops.cast import Scale
from dcpc.ops.common import (
    AFTER,
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    effects,
    keyed,
    typed,
)
from dcpc.ops.iface import Counts, Unsent
from dcpc.ops.registry import IO, OpDef, define, names

if TYPE_CHECKING:
    from dcpc.lang.nodes import ScheduleView
    from dcpc.ops.iface import InputRule, LowerRules, OutputRule, ShapeRules, SimView


class RaggedAllToAll(OpBase):
    op: Literal["ragged_all_to_all"]
    src: Name | list[Name] = Field(
        description="[W, capacity, *row] (one or a list): block j holds the rows for peer j")
    dst: Name | list[Name] = Field(
        description="[W, capacity, *row], symmetric, one per src: block p from peer p")
    counts: Name = Field(description="[W] integers: live rows of each block of src")
    recv_counts: Name = Field(description="[W] i32, symmetric: counts[rank] of each peer")
    capacity: SizeExpr = Field(description="rows of one block: src and dst dim 1")
    scale: Scale | None = Field(default=None, description="a cast inside the move")
    phase: Literal["put", "wait"] | None = Field(
        default=None, description="put: push and signal, no wait; wait: a later step "
        "naming the same payloads polls it (dcpc.ops._split)")

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` names as the put it polls does (dcpc.ops._split)."""
        try:  # the expression, not its spelling: `N*C` is `N * C` (a bad one: verify's error)
            capacity: Any = ex.parse(self.capacity)
        except ex.ExprSyntaxError:
            capacity = str(self.capacity)
        return (tuple(names(self.src)), tuple(names(self.dst)), self.counts,
                self.recv_counts, capacity,
                self.scale.buffer if self.scale is not None else None,
                split.axis_key(schedule, self))


def semantics(c: Scope, step: Step) -> Semantics:
    """Split (``phase``): the put pushes and signals every peer, its stores in flight
    until the wait that polls it (``Effect.lands``); the wait waits for every peer's
    put, then reads the counts (dcpc.ops._split.exchange)."""
    op = step.op
    # after the wait the receiver reads every peer's count (its over-capacity check)
    after = effects(READ, AFTER, keyed(op, "recv_counts"))
    before = effects(READ, BEFORE, keyed(op, "src") + keyed(op, "counts"))
    # over-approximated: the whole block p of every peer's dst, whatever the count
    before += effects(WRITE, BEFORE, keyed(op, "dst") + keyed(op, "recv_counts"),
                      Region("index", 0))
    before += cast.effects(c.schedule, op)
    return split.exchange(c, step, before, after)


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, RaggedAllToAll)
    (counts,), (recv,) = v.refs("counts"), v.refs("recv_counts")
    v.transfer(recv, recv, symmetric=True)  # peers write dst and recv_counts: symmetric
    cap = ex.parse(op.capacity) if isinstance(op.capacity, str) else ("num", op.capacity)
    for k, (src, dst) in enumerate(v.pairs(v.refs("src"), v.refs("dst"))):
        v.transfer(dst, dst, symmetric=True)
        cast.verify(v, src, dst, cast=k == 0)  # the first payload is the one cast
        _verify_rows(v, step, src, dst, cap)
    for ref, dtypes, what in ((counts, ("i32", "i64"), "integers"), (recv, ("i32",), "i32")):
        buf = v.buffer(ref.name)
        if buf is None:
            continue
        if buf.dtype.value not in dtypes:
            v.error(ref.mark, "bad-counts",
                    f"{ref.role} '{ref.name}' of step '{step.name}' is {buf.dtype.value}; "
                    f"row counts are {what}, one per peer",
                    hint=f"declare '{ref.name}' as {{shape: [W], dtype: i32}}")
        v.expect(ref, [v.W], "one row count per peer")
    split.verify_exchange(v, step, waits=f"for the rows of '{names(op.dst)[0]}'",
                          puts=f"the rows of '{names(op.src)[0]}' to every peer",
                          same="src, dst, counts, recv_counts, capacity, scale and axis")


def _verify_rows(v: ShapeRules, step: Step, src: Any, dst: Any, cap: ex.Expr) -> None:
    """A payload: [W, capacity, *row], its dst the same shape."""
    shape = v.shape(src.name)
    if shape is not None:
        if len(shape) < 2:
            v.error(src.mark, "shape-mismatch",
                    f"src '{src.name}' of step '{step.name}' has {len(shape)} dims; a ragged "
                    "all_to_all needs [W, capacity, ...]: one block of capacity rows per peer")
        else:
            v.expect(src, [v.W, cap, *shape[2:]], "one block of capacity rows per peer")
            if v.shape(dst.name) is not None:
                v.expect(dst, [v.W, cap, *shape[2:]],
                         f"one block of capacity rows per peer, rows as in src '{src.name}'")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: RaggedAllToAll = step.op  # type: ignore[assignment]
    if split.land(sim, step):  # a wait: what the put it polls pushed lands here
        return
    store = split.store(sim, step)
    srcs, dsts = names(op.src), names(op.dst)
    cap = sim.shape(srcs[0])[1]
    counts = [[int(c) for c in sim.bufs[p][op.counts].reshape(-1)] for p in range(sim.world)]
    for p, row in enumerate(counts):
        for j, n in enumerate(row):
            if not 0 <= n <= cap:
                raise ValueError(f"simulator: step {step.name}: rank {p}'s counts[{j}] = {n} "
                                 f"is outside [0, capacity {cap}]")
    for k, (src, dst) in enumerate(zip(srcs, dsts, strict=True)):
        _move(sim, op, src, dst, counts, cast.direction(sim.schedule, op) if k == 0 else None,
              store)
    for j in range(sim.world):
        store(j, op.recv_counts,
                  torch.tensor([counts[p][j] for p in range(sim.world)], dtype=torch.int64))


def _move(sim: SimView, op: RaggedAllToAll, src: str, dst: str, counts: list[list[int]],
          way: str | None, store: Any) -> None:
    """One payload's rows, cast on the way when ``way`` says so (``store``: the
    simulator's, or a put's holder: dcpc.ops._split.store)."""
    import torch

    sent, scales = [], []  # every sender's src as it travels (cast), and its row scales
    for p in range(sim.world):
        x, s = sim.bufs[p][src], None
        if way == "quantise":  # per token: the scales are made here, not read
            tensor = sim.bufs[p].get(op.scale.buffer)  # type: ignore[union-attr]
            x, s = cast.quantise_rows(x, op.scale.per, tensor)  # type: ignore[union-attr]
        elif way == "dequantise":
            x = cast.dequantise_rows(x, op.scale.per, sim.bufs[p][op.scale.buffer])  # type: ignore[union-attr]
        sent.append(x)
        scales.append(s)
    for j in range(sim.world):
        # rows past a count: never written (NaN, or an int payload's UNSENT_INT), so
        # that whoever reads them as data mismatches; the mask says which they are
        out = sim.unsent(dst)
        got = torch.full(sim.shape(dst)[:-1], math.nan, dtype=torch.float64)
        unsent = torch.ones(sim.shape(dst)[:2], dtype=torch.bool)  # [W, capacity]
        for p in range(sim.world):
            n = counts[p][j]
            out[p, :n] = sent[p][j, :n]
            unsent[p, :n] = False
            if scales[p] is not None:
                got[p, :n] = scales[p][j, :n]  # type: ignore[index]
        store(j, dst, out, unsent=_by_row(unsent, out.shape))
        if scales[0] is not None:
            store(j, op.scale.buffer, got,  # type: ignore[union-attr]
                      unsent=_by_row(unsent, got.shape))


def _by_row(rows: Any, shape: Any) -> Any:
    """A [W, capacity] mask of rows spread over every element of those rows."""
    return rows.reshape(tuple(rows.shape) + (1,) * (len(shape) - 2)).expand(shape)


def io(op: RaggedAllToAll) -> IO:
    """A per-token quantise's receiving scale buffer is listed as read (io cannot tell
    the cast's direction without the dtypes): it is symmetric, so never an engine input,
    and the method does not return it (``module.buffer`` reads it, as ``via``)."""
    scale = [op.scale.buffer] if op.scale is not None else []
    sent, landed = [*names(op.src), op.counts, *scale], [*names(op.dst), op.recv_counts]
    return split.io(op, sent, landed)


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, RaggedAllToAll)
    srcs, dsts = names(op.src), names(op.dst)
    shape = ctx.shape(srcs[0])
    # payload 0 keeps the roles and scalars of a one-payload step (its module unchanged)
    roles = {"src": srcs[0], "dst": dsts[0], "counts": op.counts,
             "recv_counts": op.recv_counts}
    scalars = [("cap", shape[1]), ("row_len", product(shape[2:]))]
    for k in range(1, len(srcs)):
        roles[f"src{k}"], roles[f"dst{k}"] = srcs[k], dsts[k]
        scalars.append((f"row_len{k}", product(ctx.shape(srcs[k])[2:])))
    scale = op.scale.buffer if op.scale is not None else None
    if scale is not None:
        roles["scale"] = scale
    more = {"payloads": len(srcs)} if len(srcs) > 1 else {}
    more |= split.lowered(ctx, step)  # a wait launches its put's grid (program i polls i)
    return ctx.plan(
        step,
        params=[] if op.phase == WAIT else ctx.engine([*srcs, op.counts, scale]),
        returns=[] if op.phase == PUT else [*dsts, op.recv_counts],
        roles=roles,
        scalars=scalars,
        tiles=[product(shape[2:])],
        signalling=True,
        attrs={"ragged": True, **cast.cast_attrs(ctx, op), **more},
    )


def inputs(op: RaggedAllToAll) -> dict[str, InputRule]:
    """Counts within the capacity (an engine sends no more rows than a block holds), and
    the cast's per-tensor scale."""
    return {op.counts: Counts(str(op.capacity)), **cast.input_rules(op)}


def outputs(op: RaggedAllToAll) -> dict[str, OutputRule]:
    """The rows past a count were never sent (``reference`` leaves them unsent): in
    ``dst`` and in a per-token cast's scale buffer (either direction: the op cannot tell
    which without the dtypes, and a read buffer's rule compares what it compared)."""
    scale = [op.scale.buffer] if op.scale is not None else []
    return {name: Unsent() for name in (*names(op.dst), *scale)}


DEF = define(OpDef("ragged_all_to_all", RaggedAllToAll, semantics, verify, reference, io, lower,
                   teams=True, exact=True, inputs=inputs, outputs=outputs))
