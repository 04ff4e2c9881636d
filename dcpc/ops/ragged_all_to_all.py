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
``groups: G`` (DeepEP's low-latency layout, G local experts per rank): a slot of
``capacity`` rows and a count per (peer, group). src [W, G*capacity, *row] (slot (j, g):
the rows for group g of rank j), counts [W, G]; they land group-major in dst
[G, W*capacity, *row] (slot (g, p): rows p*capacity .. of group g, DeepEP's
packed_recv_x) with the count in recv_counts [G, W]. ``direction: combine`` is the
inverse (src [G, W*capacity], counts [G, W]; dst [W, G*capacity], recv_counts [W, G]);
dcpc.exprs ``ragged_slot`` is the one definition of where a slot goes:
the simulator (``_slots``) and the torch backend evaluate it, ``lower`` renders the
kernel's indices from it (``_kernel_slots``). Not derived from it: ``semantics``'s
regions (a dispatch stores block p of dst's dim 1, a combine index p of dim 0: the slots
of sender p, over-approximated) and tests/support/hb_oracle.py (a brute force, separate
on purpose); tests/ops/test_ragged_groups.py ties them to the simulator (the checker and
both oracles agree, at W = 2 and 3). G = 1 is the plain form, bytes
and all.
``offset: k`` (with ``phase``; JAX's ``ragged_all_to_all`` restricted to ONE peer per rank,
the peer named as a shift's or a credit's: an integer, or an expression the unroller
evaluates, such as a loop's hop index): rank r sends only its slots for member r + k
(mod W: block r + k, or that peer's G group slots), which land in dst and recv_counts of
r + k as in the whole exchange; every other part of the receiver's dst and recv_counts
is left as it was. The put signals r + k only, the wait polls r - k only, so a loop over
k can interleave a credit from r + k with the put to r + k (DeepEP normal's sender, which
spins on its destination's head only). k = 0 (or a multiple of W) is this rank's own
slots, a local copy: no signal, no wait. The stores' region is the whole op's with
``Region.peer`` = k (dcpc.ops.common: writer p's part, in rank p + k's instance only). The
wait reads no count (no receiver's over-capacity check: a read of the whole recv_counts
would meet the other peers' puts in flight, and the model has no read of one peer's
part of this rank's own instance); a count over capacity is the sender's error (its put
records it, its call raises).
``index`` (src's first two dims, integers: DeepEP's src_info, which its low-latency
combine writes each row at): live row i of a slot lands at row ``index[slot, i]`` of its
destination slot, not row i; a value outside [0, capacity) stores nothing of that row
and the sender's call raises (OUTSIDE_SLOT, dcpc.runtime.errors; the torch backend and
the reference refuse it before anything moves). Rows no index names are never written;
two rows placed alike race (DeepEP's too): the reference and the torch backend keep the
later in row order, the kernel one of them. The checker's footprint stays the whole
slot (where in it a row lands is data). ``dcpc run`` draws an index (and a move's src
that lands in one: DeepEP's token indices) as distinct rows per slot (``Placement``).
``recv_counts`` is optional: without it no count is stored and no receiver checks one
(DeepEP's combine sends a finish flag only: the step's signal).
Lowerings: ``lower`` below + templates/ops/ragged_all_to_all.py.j2;
dcpc/runtime/collectives.py ``ragged_all_to_all``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.exprs import ragged_slot
from dcpc.lang import expr as ex
from dcpc.lang.expr import product
from dcpc.lang.nodes import Int, Name, OpBase, SizeExpr, Step
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
    integer_index,
    keyed,
    offset_peers,
    typed,
)
from dcpc.ops.iface import Counts, Placement, Unsent
from dcpc.ops.registry import IO, OpDef, define, names
from dcpc.topology import along

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
    recv_counts: Name | None = Field(
        default=None, description="[W] i32, symmetric: counts[rank] of each peer (none: "
        "no count is sent, the receiver knows its rows, as DeepEP's combine)")
    index: Name | None = Field(
        default=None, description="src's [W, capacity] integers (DeepEP's src_info): the "
        "row of its destination slot each live row lands at, in [0, capacity) (none: "
        "packed from the slot's start)")
    capacity: SizeExpr = Field(description="rows of one block: src and dst dim 1")
    scale: Scale | None = Field(default=None, description="a cast inside the move")
    phase: Literal["put", "wait"] | None = Field(
        default=None, description="put: push and signal, no wait; wait: a later step "
        "naming the same payloads polls it (dcpc.ops._split)")
    groups: SizeExpr | None = Field(
        default=None, description="G slots of capacity rows per peer, one per group (the "
        "peer's local experts): src [W, G*capacity, *row], counts [W, G]; dst "
        "[G, W*capacity, *row] (group g's block: peer p's rows at p*capacity), "
        "recv_counts [G, W]")
    offset: Int | str | None = Field(
        default=None, description="with phase: one peer per rank, member r + offset "
        "(mod W): only its slots are sent, the wait polls r - offset (0: this rank's "
        "own slots, a local copy)")
    direction: Literal["dispatch", "combine"] = Field(
        default="dispatch", description="combine: the inverse of a grouped dispatch "
        "(src [G, W*capacity, *row], counts [G, W]; dst [W, G*capacity, *row], "
        "recv_counts [W, G])")

    def split_key(self, schedule: ScheduleView) -> tuple[Any, ...]:
        """What a ``phase: wait`` names as the put it polls does (dcpc.ops._split)."""
        return (tuple(names(self.src)), tuple(names(self.dst)), self.counts,
                self.recv_counts, self.index, _parsed(self.capacity),
                self.scale.buffer if self.scale is not None else None,
                split.axis_key(schedule, self), _parsed(self.groups), self.direction,
                self.offset)


def peer(op: RaggedAllToAll) -> int | None:
    """The offset of a one-peer step (None: every peer; an offset not unrolled to an
    integer is the verifier's error, 0 here)."""
    if op.offset is None:
        return None
    return op.offset if isinstance(op.offset, int) else 0


def _parsed(size: SizeExpr | None) -> Any:
    """A size as ``split_key`` compares it: the expression, not its spelling (`L*C` is
    `L * C`); a bad one as written (verify's error)."""
    try:
        return ex.parse(size) if size is not None else None
    except ex.ExprSyntaxError:
        return str(size)


def _slots(op: RaggedAllToAll, world: int, groups: int) -> Any:
    """``slot(p, j, g)``: dcpc.exprs.ragged_slot for this step's direction."""
    combine = op.direction == "combine"
    return lambda p, j, g: ragged_slot(combine, world, groups, p, j, g)


class _Name:
    """A kernel name that ``ragged_slot``'s arithmetic builds an expression of (lower
    renders the slot indices into the template from the one definition)."""

    def __init__(self, e: ex.Expr) -> None:
        self.e = e

    def __add__(self, other: _Name) -> _Name:
        return _Name(("+", self.e, other.e))

    def __mul__(self, other: _Name) -> _Name:
        return _Name(("*", self.e, other.e))


def _kernel_slots(combine: bool) -> dict[str, str]:
    """The template's slot indices: the sender's (src_slot, dst_slot: this rank RANK
    sends ``peer`` group ``g``) and the receiver's (recv_slot: where peer ``p``'s count
    for group ``g`` landed on RANK), rendered from ``ragged_slot``."""
    world, groups, rank, peer, p, g = (_Name(("sym", n)) for n in
                                       ("WORLD", "groups", "RANK", "peer", "p", "g"))
    src, dst = ragged_slot(combine, world, groups, rank, peer, g)
    recv = ragged_slot(combine, world, groups, p, rank, g)[1]
    return {"src_slot": ex.unparse(src.e, spaced=True),
            "dst_slot": ex.unparse(dst.e, spaced=True),
            "recv_slot": ex.unparse(recv.e, spaced=True)}


def semantics(c: Scope, step: Step) -> Semantics:
    """Split (``phase``): the put pushes and signals every peer, its stores in flight
    until the wait that polls it (``Effect.lands``); the wait waits for every peer's
    put, then reads the counts (dcpc.ops._split.exchange)."""
    op = step.op
    # after the wait the receiver reads every peer's count (its over-capacity check)
    after = effects(READ, AFTER, keyed(op, "recv_counts"))
    before = effects(READ, BEFORE, keyed(op, "src") + keyed(op, "counts") + keyed(op, "index"))
    # over-approximated: the whole block p of every peer's dst, whatever the count (and,
    # with index, wherever in its slot a row lands: data-dependent); a grouped
    # dispatch's dst [G, W*C]: block p of dim 1 (every group's slot p)
    rows, counts = (Region("block", 1), Region("index", 1)) if _grouped_dst(op) else (
        Region("index", 0), Region("index", 0))
    k = peer(op)
    if k is not None:  # one peer's instance only (the stores' partition unchanged)
        rows, counts = replace(rows, peer=k), replace(counts, peer=k)
    before += effects(WRITE, BEFORE, keyed(op, "dst"), rows)
    before += effects(WRITE, BEFORE, keyed(op, "recv_counts"), counts)  # none: no count
    # a per-token quantise's scales land as dst's rows do
    before += [replace(e, region=rows) if e.region is not None else e
               for e in cast.effects(c.schedule, op)]
    if k is None:
        return split.exchange(c, step, before, after)
    # one peer: the put signals r + k, the wait polls r - k's put and reads no count
    # (the kernel has no receiver's check: the sender's put records one over capacity)
    whole = split.exchange(c, step, before, [])
    if op.phase == WAIT:
        return replace(whole, sync=replace(whole.sync, wait=offset_peers(-k)))
    return replace(whole, sync=replace(whole.sync, signal=offset_peers(k)))


def _grouped_dst(op: RaggedAllToAll) -> bool:
    """A grouped dispatch: dst (and recv_counts) group-major, [G, W*capacity, ...]."""
    return op.groups is not None and op.direction == "dispatch"


def verify(v: ShapeRules, step: Step) -> None:
    op = step.op
    assert isinstance(op, RaggedAllToAll)
    (counts,), received = v.refs("counts"), v.refs("recv_counts")
    for recv in received:  # peers write dst and recv_counts: symmetric
        v.transfer(recv, recv, symmetric=True)
    _verify_offset(v, step)
    cap, g = _size(v, step, "capacity"), _size(v, step, "groups")
    if cap is None or (g is None and op.groups is not None):
        return  # not a size expression: reported
    if g is not None and not ex.symbols(g) and ex.evaluate(g, {}) < 1:
        v.error(op.mark("groups"), "bad-counts",
                f"groups {op.groups} of step '{step.name}': groups must be >= 1 (a slot of "
                "capacity rows per (peer, group))",
                hint="give the groups (local experts) of each rank, at least 1; 1 is the "
                "plain form's layout")
        return
    if op.direction == "combine" and g is None:
        v.error(op.mark("direction"), "bad-counts",
                f"step '{step.name}' has 'direction: combine' but no 'groups': a combine is "
                "the inverse of a grouped dispatch, and without groups the plain form is "
                "its own inverse",
                hint="add the dispatch's 'groups', or drop 'direction'")
        return
    # (lead, rows) of src and dst, and the counts' shape on each side
    lead, rows, sent, got = (v.W, v.W), (cap, cap), [v.W], [v.W]
    if g is not None:
        lead, rows = (v.W, g), (("*", g, cap), ("*", v.W, cap))
        sent, got = [v.W, g], [g, v.W]
        if op.direction == "combine":
            lead, rows, sent, got = lead[::-1], rows[::-1], got, sent
    for k, (src, dst) in enumerate(v.pairs(v.refs("src"), v.refs("dst"))):
        v.transfer(dst, dst, symmetric=True)
        cast.verify(v, src, dst, cast=k == 0)  # the first payload is the one cast
        _verify_rows(v, step, src, dst, lead, rows)
    for ref, dtypes, what, want in ((counts, ("i32", "i64"), "integers", sent),
                                    *((recv, ("i32",), "i32", got) for recv in received)):
        buf = v.buffer(ref.name)
        if buf is None:
            continue
        if buf.dtype.value not in dtypes:
            v.error(ref.mark, "bad-counts",
                    f"{ref.role} '{ref.name}' of step '{step.name}' is {buf.dtype.value}; "
                    f"row counts are {what}, one per "
                    f"{'peer' if len(want) == 1 else '(peer, group)'}",
                    hint=f"declare '{ref.name}' as {{shape: "
                    f"[{', '.join(ex.unparse(e) for e in want)}], dtype: i32}}")
        v.expect(ref, want, "one row count per peer" if len(want) == 1 else
                 "one row count per (peer, group)")
    _verify_index(v, step, lead[0], rows[0])
    split.verify_exchange(v, step, waits=f"for the rows of '{names(op.dst)[0]}'",
                          puts=f"the rows of '{names(op.src)[0]}' to " + (
                              "every peer" if op.offset is None else
                              f"rank r + {op.offset} (offset {op.offset})"),
                          same="src, dst, counts, recv_counts, index, capacity, scale, "
                          "groups, direction, offset and axis")


def _verify_index(v: ShapeRules, step: Step, lead: ex.Expr, rows: ex.Expr) -> None:
    """``index``: one integer per row of src ([lead, rows], src's first two dims), the
    row of its destination slot it lands at (its bound is the kernel's check: a value
    outside [0, capacity) is the call's OUTSIDE_SLOT error, never a store)."""
    for ref in v.refs("index"):
        integer_index(v, step, ref, "the row of its slot each row of src lands at")
        v.expect(ref, [lead, rows], "one row of the destination slot per row of src")


def _verify_offset(v: ShapeRules, step: Step) -> None:
    """``bad-offset``: a one-peer step (``offset``) is split (its put signals one peer,
    its wait polls another: two kernels), and its offset is an integer once unrolled.
    ``when-on-communication``: a one-peer step has no ``when:`` (the float64 reference
    reads the counts of every rank, and the torch backend runs it as one exchange of the
    whole team, which a rank that skips never joins)."""
    op = step.op
    if op.offset is None:
        return
    if getattr(op, "when", None) is not None:
        v.error(op.mark("when"), "when-on-communication",
                f"step '{step.name}' sends to one peer (offset {op.offset}) and has 'when:'; "
                "a ragged_all_to_all to one peer runs on every rank (the torch backend "
                "exchanges with the whole team, which a rank that skips never joins)",
                hint="drop 'when:' here and guard the local steps around it; a rank with "
                "nothing to send sends counts of 0")
    if op.phase is None:
        v.error(op.mark("offset"), "bad-offset",
                f"step '{step.name}' sends to one peer (offset {op.offset}) but has no "
                "'phase'; a ragged_all_to_all to one peer is split: its put signals rank "
                "r + offset, its wait polls rank r - offset",
                hint="add 'phase: put' here and a 'phase: wait' step with the same keys "
                "after it, or drop 'offset' to exchange with every peer")
    elif not isinstance(op.offset, int):
        v.error(op.mark("offset"), "bad-offset",
                f"step '{step.name}' sends to one peer by offset '{op.offset}', which was "
                "not unrolled to an integer",
                hint="an offset is an integer, or an expression of W, a loop's hop index "
                "and integer sizes; check or compile with --world N")


def _size(v: ShapeRules, step: Step, key: str) -> ex.Expr | None:
    """The op's size expression ``key`` (capacity, groups), parsed; None where it is
    unset or does not parse (then a located ``shape-syntax``)."""
    value = getattr(step.op, key)
    if value is None or not isinstance(value, str):
        return None if value is None else ("num", value)
    try:
        return ex.parse(value)
    except ex.ExprSyntaxError as err:
        v.error(step.op.mark(key), "shape-syntax",
                f"{key} {value!r} of step '{step.name}' is not a size expression: {err}",
                hint="use integers, size names, + - * / and parentheses, e.g. 'L*C'")
        return None


def _verify_rows(v: ShapeRules, step: Step, src: Any, dst: Any, lead: Any, rows: Any) -> None:
    """A payload: src [lead[0], rows[0], *row], dst [lead[1], rows[1], *row] (without
    groups both [W, capacity, *row])."""
    shape = v.shape(src.name)
    why = ("one block of capacity rows per peer" if step.op.groups is None  # type: ignore[attr-defined]
           else "one slot of capacity rows per (peer, group)")
    if shape is not None:
        if len(shape) < 2:
            v.error(src.mark, "shape-mismatch",
                    f"src '{src.name}' of step '{step.name}' has {len(shape)} dims; a ragged "
                    "all_to_all needs [W, capacity, ...]: one block of capacity rows per peer")
        else:
            v.expect(src, [lead[0], rows[0], *shape[2:]], why)
            if v.shape(dst.name) is not None:
                v.expect(dst, [lead[1], rows[1], *shape[2:]],
                         f"{why}, rows as in src '{src.name}'")


def reference(sim: SimView, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: RaggedAllToAll = step.op  # type: ignore[assignment]
    if split.land(sim, step):  # a wait: what the put it polls pushed lands here
        return
    store = split.store(sim, step)
    srcs, dsts = names(op.src), names(op.dst)
    counts = [[int(c) for c in sim.bufs[p][op.counts].reshape(-1)] for p in range(sim.world)]
    groups = len(counts[0]) // sim.world
    cap = math.prod(sim.shape(srcs[0])[:2]) // len(counts[0])  # rows of one slot
    for p, row in enumerate(counts):
        for j, n in enumerate(row):
            if not 0 <= n <= cap:
                raise ValueError(f"simulator: step {step.name}: rank {p}'s counts[{j}] = {n} "
                                 f"is outside [0, capacity {cap}]")
    slot = _slots(op, sim.world, groups)
    to = peer(op)
    # sends[j]: (p, src slot, dst slot) of every part that lands on rank j (one peer:
    # from member j - offset only)
    sends = [[(p, *slot(p, j, g)) for p in range(sim.world) for g in range(groups)
              if to is None or along(p, sim.world, to) == j] for j in range(sim.world)]
    at = _placed(sim, step.name, op, counts, cap, sends)
    for k, (src, dst) in enumerate(zip(srcs, dsts, strict=True)):
        _move(sim, op, src, dst, counts, cast.direction(sim.schedule, op) if k == 0 else None,
              store, sends, at)
    if op.recv_counts is None:
        return  # no count travels (DeepEP's combine: its receiver knows its rows)
    for j in range(sim.world):
        recv = torch.zeros(len(counts[0]), dtype=torch.int64)
        part = torch.zeros(len(counts[0]), dtype=torch.bool)
        for p, a, b in sends[j]:
            recv[b], part[b] = counts[p][a], True
        shape = sim.shape(op.recv_counts)
        store(j, op.recv_counts, recv.reshape(shape),
              **({} if to is None else {"part": part.reshape(shape)}))


def _placed(sim: SimView, name: str, op: RaggedAllToAll, counts: list[list[int]], cap: int,
            sends: list[list[tuple[int, int, int]]]) -> list[list[list[int]]]:
    """``at[p][a]``: the rows of its destination slot that the live rows of sender p's
    slot a land at: ``index``'s values, else 0, 1, ... (packed). A sent slot's value
    outside [0, cap) is the simulator's error (as a count over capacity)."""
    if op.index is None:
        return [[list(range(n)) for n in row] for row in counts]
    at = []
    for p, row in enumerate(counts):
        index = sim.bufs[p][op.index].reshape(len(row), -1)
        at.append([[int(i) for i in index[a, :n]] for a, n in enumerate(row)])
    for p, a, _ in (part for parts in sends for part in parts):
        bad = [i for i in at[p][a] if not 0 <= i < cap]
        if bad:
            raise ValueError(f"simulator: step {name}: rank {p}'s index of slot {a} holds "
                             f"{bad[0]}, outside [0, capacity {cap})")
    return at


def _move(sim: SimView, op: RaggedAllToAll, src: str, dst: str, counts: list[list[int]],
          way: str | None, store: Any, sends: list[list[tuple[int, int, int]]],
          at: list[list[list[int]]]) -> None:
    """One payload's rows, cast on the way when ``way`` says so (``store``: the
    simulator's, or a put's holder: dcpc.ops._split.store); ``sends``: ``reference``'s
    parts, by receiver; ``at``: where in its slot each row lands (``_placed``: in row
    order, so of two rows an index places alike the later is the one that stays)."""
    import torch

    sent, scales = [], []  # every sender's src as it travels (cast), and its row scales
    slots = len(counts[0])
    for p in range(sim.world):
        x, s = sim.bufs[p][src], None
        if way == "quantise":  # per token: the scales are made here, not read
            tensor = sim.bufs[p].get(op.scale.buffer)  # type: ignore[union-attr]
            x, s = cast.quantise_rows(x, op.scale.per, tensor,  # type: ignore[union-attr]
                                      sim.schedule.buffers[dst].dtype.value,
                                      op.scale.group, op.scale.rule)  # type: ignore[union-attr]
            s = s.reshape(slots, -1, *s.shape[2:]) if s is not None else None  # by slot
        elif way == "dequantise":
            x = cast.dequantise_rows(x, op.scale.per, sim.bufs[p][op.scale.buffer],  # type: ignore[union-attr]
                                     op.scale.group)  # type: ignore[union-attr]
        sent.append(x.reshape(slots, -1, *x.shape[2:]))  # [slots, capacity, *row]
        scales.append(s)
    for j in range(sim.world):
        # rows past a count: never written (NaN, or an int payload's UNSENT_INT), so
        # that whoever reads them as data mismatches; the mask says which they are
        out = sim.unsent(dst)
        rows = out.view(slots, -1, *out.shape[2:])
        got = torch.full(sim.shape(op.scale.buffer) if scales[0] is not None else (1, 1),  # type: ignore[union-attr]
                         math.nan, dtype=torch.float64)
        unsent = torch.ones(sim.shape(dst)[:2], dtype=torch.bool)  # [W, capacity]
        part = torch.zeros(sim.shape(dst)[:2], dtype=torch.bool)  # the slots sent here
        for p, a, b in sends[j]:
            for i, to in enumerate(at[p][a]):
                rows[b, to] = sent[p][a, i]
                unsent.view(slots, -1)[b, to] = False
                if scales[p] is not None:
                    got.view(slots, -1, *got.shape[2:])[b, to] = scales[p][a, i]  # type: ignore[index]
            part.view(slots, -1)[b] = True
        # one peer (offset): the other slots are left as they were (_split.land)
        one = op.offset is not None
        store(j, dst, out, unsent=_by_row(unsent, out.shape),
              **({"part": _by_row(part, out.shape)} if one else {}))
        if scales[0] is not None:
            store(j, op.scale.buffer, got,  # type: ignore[union-attr]
                  unsent=_by_row(unsent, got.shape),
                  **({"part": _by_row(part, got.shape)} if one else {}))


def _by_row(rows: Any, shape: Any) -> Any:
    """A [W, capacity] mask of rows spread over every element of those rows."""
    return rows.reshape(tuple(rows.shape) + (1,) * (len(shape) - 2)).expand(shape)


def io(op: RaggedAllToAll) -> IO:
    """A per-token quantise's receiving scale buffer is listed as read (io cannot tell
    the cast's direction without the dtypes): it is symmetric, so never an engine input,
    and the method does not return it (``module.buffer`` reads it, as ``via``)."""
    scale = [op.scale.buffer] if op.scale is not None else []
    index = [op.index] if op.index is not None else []
    counted = [op.recv_counts] if op.recv_counts is not None else []
    sent, landed = [*names(op.src), op.counts, *index, *scale], [*names(op.dst), *counted]
    return split.io(op, sent, landed)


def lower(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, RaggedAllToAll)
    srcs, dsts = names(op.src), names(op.dst)
    shape = ctx.shape(srcs[0])
    # payload 0 keeps the roles and scalars of a one-payload step (its module unchanged)
    roles = {"src": srcs[0], "dst": dsts[0], "counts": op.counts,
             "recv_counts": op.recv_counts or dsts[0]}  # none: a pointer never stored to
    scalars = [("cap", shape[1]), ("row_len", product(shape[2:]))]
    for k in range(1, len(srcs)):
        roles[f"src{k}"], roles[f"dst{k}"] = srcs[k], dsts[k]
        scalars.append((f"row_len{k}", product(ctx.shape(srcs[k])[2:])))
    scale = op.scale.buffer if op.scale is not None else None
    if scale is not None:
        roles["scale"] = scale
    more: dict[str, Any] = {"payloads": len(srcs)} if len(srcs) > 1 else {}
    if op.index is not None:  # each row lands at the row of its slot index names
        roles["index"] = op.index
        more["placed"] = True
    if op.recv_counts is None:  # no count travels: no receiver's check
        more["counted"] = False
    if op.groups is not None:  # slots of capacity rows, G per peer (the kernel's groups)
        scalars = [("cap", ex.parse(str(op.capacity))), *scalars[1:],
                   ("groups", ex.parse(str(op.groups)))]
        more |= {"groups": op.direction, **_kernel_slots(op.direction == "combine")}
    more |= split.lowered(ctx, step)  # a wait launches its put's grid (program i polls i)
    k = peer(op)
    if k is not None:  # one peer: the put's lane is member r + k, the wait's r - k
        more |= {"peers": "one", "peer_k": k if op.phase == PUT else -k}
    return ctx.plan(
        step,
        params=[] if op.phase == WAIT else ctx.engine([*srcs, op.counts, op.index, scale]),
        # a wait from one peer returns nothing: the engine's read of the whole dst would
        # meet the other peers' puts still in flight (it reads dst once all landed)
        returns=[] if op.phase == PUT or op.offset is not None else [
            *dsts, *([op.recv_counts] if op.recv_counts is not None else [])],
        roles=roles,
        scalars=scalars,
        tiles=[product(shape[2:])],
        signalling=True,
        attrs={"ragged": True, **cast.cast_attrs(ctx, op), **more},
    )


def inputs(op: RaggedAllToAll) -> dict[str, InputRule]:
    """Counts within the capacity (an engine sends no more rows than a block holds), an
    index's rows distinct within each slot and inside it, and the cast's per-tensor
    scale."""
    index = {op.index: Placement(str(op.capacity))} if op.index is not None else {}
    return {op.counts: Counts(str(op.capacity)), **index, **cast.input_rules(op)}


def round_trip(schedule: ScheduleView, rows: str) -> tuple[str, str, str] | None:
    """Where the rows of ``rows`` that land on a rank come from when they make a round
    trip (DeepEP's low-latency combine): ``rows`` is a step's dst placed by an ``index``
    that an earlier ragged step landed from this rank's own src ``sent`` with its
    ``counts`` (the dispatch's token indices, src_info): on each rank slot s of ``rows``
    then holds rows ``sent[s, i]`` for i < counts[s] (the combine's slot s on the owner is
    the dispatch's slot s: the inverse layout). (sent, counts, the combine's capacity),
    or None (dcpc.harness.synth draws a weighted_combine's index into those rows)."""
    steps = schedule.step_list()
    for step in steps:
        op = step.op
        if isinstance(op, RaggedAllToAll) and op.index is not None and rows in names(op.dst):
            for back in steps:
                out = back.op
                if isinstance(out, RaggedAllToAll) and op.index in names(out.dst):
                    sent = names(out.src)[names(out.dst).index(op.index)]
                    return sent, out.counts, str(op.capacity)
    return None


def outputs(op: RaggedAllToAll) -> dict[str, OutputRule]:
    """The rows past a count were never sent (``reference`` leaves them unsent): in
    ``dst`` and in a per-token cast's scale buffer (either direction: the op cannot tell
    which without the dtypes, and a read buffer's rule compares what it compared)."""
    scale = [op.scale.buffer] if op.scale is not None else []
    return {name: Unsent() for name in (*names(op.dst), *scale)}


DEF = define(OpDef("ragged_all_to_all", RaggedAllToAll, semantics, verify, reference, io, lower,
                   teams=True, exact=True, inputs=inputs, outputs=outputs))
