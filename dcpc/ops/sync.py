"""The sync ops: ``barrier`` (signal every peer, wait for every peer) and the
split-phase ``signal`` (publish this step's epoch, no wait) and ``wait`` (poll the
slots of ONE signal step, matched by ``dcpc.ops.common.channels``). They move no data:
their float64 reference does nothing.
Peers: ``to``/``from`` (all, next, prev, or ``self``: the rank's own flag, a signal on
its own slot that a ``from: self`` wait of the same rank polls: the credit of its own
block, no peer), or one peer per rank as a shift names it
(NCCL's device API signals any peer of a team): ``offset: k`` (an integer or an
expression of W, hop indices and integer sizes, evaluated by the unroller) or ``perm:``
(dcpc.ops._perm: an expression of r and W, pairs, a destination per rank; a partial
perm signals nobody from a rank with no destination). A wait names its signal's
offset or perm (as a shift's ``phase: wait`` names its put's): it waits for rank r - k,
or perm^-1(r) (dcpc.topology ``perm_sources``; none: it waits for nothing). ``peers``
gives the sync spec every stage reads (dcpc.ops.common ``Sync``): a perm that is one
translation of the torus at the W unrolled (``(r + W / 2) % W``) is that offset, which
the happens-before checker proves exactly; any other perm's wait orders nothing there
(as a shift's perm, docs/hb-checker.md).
Lowerings: ``lower_barrier``/``lower_signal``/``lower_wait`` below + templates/ops/ (one
program of one warp: dcpc.codegen.ctx.OP_TUNING);
dcpc/runtime/collectives.py ``barrier`` (the torch backend's signal/wait: its handshake).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from dcpc.lang.mesh import mesh_of
from dcpc.lang.nodes import ChannelName, Int, OpBase, Peers, Step
from dcpc.ops._perm import WRITTEN, perm_shape, table, verify_perm
from dcpc.ops.common import (
    Scope,
    Semantics,
    Sync,
    chain,
    exchange,
    inverse_peers,
    offset_peers,
    peer_offset,
    peerless,
    perm_peers,
    perm_table,
    typed,
)
from dcpc.ops.registry import IO, OpDef, define
from dcpc.topology import torus

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, SimView


class Barrier(OpBase):
    op: Literal["barrier"]


class Signal(OpBase):
    """Split-phase sync: publish this step's epoch to peers (no wait)."""

    op: Literal["signal"]
    to: Peers = Peers.all
    # instead of `to`: one peer per rank, r + offset (mod W), or perm(r) (-1: nobody)
    offset: Int | str | None = None
    perm: str | list[Int] | list[list[Int]] | None = None
    written: SkipJsonSchema[Any] = Field(default=None, alias=WRITTEN, exclude=True)  # the perm
    channel: ChannelName

    def peers(self, schedule: Any) -> str:
        """The sync spec of the peers this signal goes to (dcpc.ops.common ``Sync``)."""
        return _spec(self, schedule, self.to, inverse=False)


class Wait(OpBase):
    """Split-phase sync: wait for the matching signal of peers on a channel."""

    op: Literal["wait"]
    from_: Peers = Field(default=Peers.all, alias="from")
    # instead of `from`: the offset or perm of the signal it polls (it waits for rank
    # r - offset, or perm^-1(r); none: for nobody)
    offset: Int | str | None = None
    perm: str | list[Int] | list[list[Int]] | None = None
    written: SkipJsonSchema[Any] = Field(default=None, alias=WRITTEN, exclude=True)  # the perm
    channel: ChannelName

    def peers(self, schedule: Any) -> str:
        """The sync spec of the peers this wait polls (dcpc.ops.common ``Sync``)."""
        return _spec(self, schedule, self.from_, inverse=True)


def _spec(op: Signal | Wait, schedule: Any, named: Peers, inverse: bool) -> str:
    """``named`` (all, next, prev), or the one peer of each rank at ``op``'s offset or
    perm (``inverse``: the rank it receives from): "+k" / "-k" (next / prev for 1), or
    "perm:<table>" over ranks, or "+k" where the perm is one translation along its team."""
    if op.perm is not None:
        spec = _translation(schedule, op, table(op))
    elif op.offset is not None:
        spec = offset_peers(op.offset if isinstance(op.offset, int) else
                            peer_offset(op.offset)[0] if op.offset in ("next", "prev")
                            else 1)  # an expression left: its error is reported
    else:
        return named.value
    return inverse_peers(spec) if inverse else spec


def _translation(schedule: Any, op: Signal | Wait, peers: tuple[int, ...]) -> str:
    """A perm's peers spec: "+k" (an offset along its team of one axis, or of the one
    axis of the world) where every rank has a peer and all are one translation of the
    torus at the shape unrolled (dcpc.topology), else "perm:<table>"."""
    spec = perm_peers(peers)
    if not peers or min(peers) < 0:
        return spec
    topo = torus(perm_shape(schedule, peers))
    axes = mesh_of(schedule).team_axes(op)
    along = topo.axes(axes)
    moves = {topo.sub(d, r) for r, d in enumerate(peers)}
    if len(along) != 1 or len(moves) != 1 or moves == {0}:
        return spec
    (d,), (axis,) = moves, along
    coords = topo.coords(d)
    if any(c for a, c in enumerate(coords) if a != axis):
        return spec
    return offset_peers(coords[axis])


def barrier_semantics(c: Scope, step: Step) -> Semantics:
    return exchange([], [], step)


def signal_semantics(c: Scope, step: Step) -> Semantics:
    return Semantics((), Sync(signal=typed(step, Signal).peers(c.schedule)))


def wait_semantics(c: Scope, step: Step) -> Semantics:
    polled = c.channels.polls.get(step.name)
    return Semantics((), Sync(wait=typed(step, Wait).peers(c.schedule),
                              polls=polled.index if polled is not None else None))


def own_flag_hint(kind: str) -> str:
    """The hint of a signal's (``kind``) or a wait's offset that names the rank itself
    (``offset: 0``, ``offset: self``): its own flag."""
    key = "to" if kind == "signal" else "from"
    return (f"write '{key}: self' instead of 'offset' (the rank's own flag: 'to: self' "
            "signals it, 'from: self' polls it)")


def verify(v: Any, step: Step) -> None:
    """``bad-perm`` (a perm next to ``to``/``from`` or ``offset``), ``bad-offset`` (an
    offset next to ``to``/``from``: one way to name the peers)."""
    op = step.op
    key = "to" if step.kind == "signal" else "from"
    named = [k for k in (key, "offset") if k in op.src_marks]
    verify_perm(v, step, named)
    polled = v.ctx.channels.polls.get(step.name) if step.kind == "wait" else None
    if polled is not None and polled.index > step.index and chain(op.peers(v.ctx.schedule)):
        # a chain's wait before its signal: live on a line, but proved only for a shift's
        # span (dcpc.ops.shift span_run); the checker would drop its dependency
        v.error(op.mark("perm"), "wait-first-span",
                f"step '{step.name}' waits by a perm with no cycle before the signal it "
                f"polls ('{polled.name}'); only a shift's wait may come before its put",
                f"move '{step.name}' after '{polled.name}', or send the data by a shift "
                "with 'phase: wait' before its put")
    if op.offset == 0:
        v.error(op.mark("offset"), "bad-offset",
                f"step '{step.name}' names offset {op.offset}; an offset is a nonzero "
                "integer, next, prev or an expression of W (one peer per rank), and the "
                "rank itself is no peer",
                own_flag_hint(step.kind))
    if op.perm is None and op.offset is not None and key in op.src_marks:
        v.error(op.mark("offset"), "bad-offset",
                f"step '{step.name}' has both '{key}' and 'offset'; name its peers one way",
                f"drop '{key}' (an offset of 1 is '{key}: {'next' if key == 'to' else 'prev'}')")


def no_data(sim: SimView, step: Step) -> None:
    """A sync op moves no data."""


def no_io(op: Any) -> IO:
    return [], []


def lower_barrier(ctx: LowerRules, step: Step) -> Any:
    return ctx.plan(
        step,
        attrs={"peers": "all", "wait_index": step.index, "signal": True, "wait": True},
        signalling=True,
    )


def lower_signal(ctx: LowerRules, step: Step) -> Any:
    return ctx.plan(
        step,
        attrs={**_lanes(ctx, typed(step, Signal)), "signal": True, "wait": False},
        signalling=True,
    )


def lower_wait(ctx: LowerRules, step: Step) -> Any:
    return ctx.plan(
        step,
        attrs={**_lanes(ctx, typed(step, Wait)), "signal": False, "wait": True},
        signalling=True,
    )


def _lanes(ctx: LowerRules, op: Signal | Wait) -> dict[str, Any]:
    """The kernel's peers (templates/sync.j2 prologue): all, next, prev, self (the rank's
    own lane); else "one", the lane of member RANK + PEER of its team (mod its size; 0:
    none), PEER computed per launch from ``peer_k`` (an offset: every rank alike, any W)
    or read off ``peer_of`` (a perm's, one per global rank).
    ``peerless: True`` (self, dcpc.ops.common ``peerless``): the step meets no other
    rank, the one fact the templates read for it: a no-op on the torch backend
    (templates/sync.j2 sync_torch), no handshake and no team settle there
    (templates/module.py.j2)."""
    spec = op.peers(ctx.schedule)
    if peerless(spec):
        return {"peers": spec, "peerless": True}
    if spec in Peers.__members__:
        return {"peers": spec}
    found = perm_table(spec)
    if found is None:
        return {"peers": "one", "peer_k": peer_offset(spec)[0]}
    topo = torus(perm_shape(ctx.schedule, found))
    axes = mesh_of(ctx.schedule).team_axes(op)
    size = topo.team_size(axes)
    return {"peers": "one", "peer_of": tuple(
        (topo.member(p, axes) - topo.member(r, axes)) % size if p >= 0 else 0
        for r, p in enumerate(found))}


BARRIER = define(OpDef("barrier", Barrier, barrier_semantics, None, no_data, no_io, lower_barrier,
                           teams=True))
SIGNAL = define(OpDef("signal", Signal, signal_semantics, verify, no_data, no_io, lower_signal,
                          teams=True))
WAIT = define(OpDef("wait", Wait, wait_semantics, verify, no_data, no_io, lower_wait,
                        teams=True))
