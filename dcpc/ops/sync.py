"""The sync ops: ``barrier`` (signal every peer, wait for every peer) and the
split-phase ``signal`` (publish this step's epoch, no wait) and ``wait`` (poll the
slots of ONE signal step, matched by ``dcpc.ops.common.channels``). They move no data:
their float64 reference does nothing.
Lowerings: ``lower_barrier``/``lower_signal``/``lower_wait`` below + templates/ops/ (one
program of one warp: dcpc.codegen.ctx.OP_TUNING);
dcpc/runtime/collectives.py ``barrier`` (the torch backend's signal/wait: its handshake).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang.nodes import ChannelName, OpBase, Peers, Step
from dcpc.ops.common import Scope, Semantics, Sync, exchange, typed
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, SimView


class Barrier(OpBase):
    op: Literal["barrier"]


class Signal(OpBase):
    """Split-phase sync: publish this step's epoch to peers (no wait)."""

    op: Literal["signal"]
    to: Peers = Peers.all
    channel: ChannelName


class Wait(OpBase):
    """Split-phase sync: wait for the matching signal of peers on a channel."""

    op: Literal["wait"]
    from_: Peers = Field(default=Peers.all, alias="from")
    channel: ChannelName


def barrier_semantics(c: Scope, step: Step) -> Semantics:
    return exchange([], [], step)


def signal_semantics(c: Scope, step: Step) -> Semantics:
    return Semantics((), Sync(signal=step.op.to.value))  # type: ignore[attr-defined]


def wait_semantics(c: Scope, step: Step) -> Semantics:
    polled = c.channels.polls.get(step.name)
    return Semantics((), Sync(wait=step.op.from_.value,  # type: ignore[attr-defined]
                              polls=polled.index if polled is not None else None))


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
        attrs={"peers": typed(step, Signal).to.value, "signal": True, "wait": False},
        signalling=True,
    )


def lower_wait(ctx: LowerRules, step: Step) -> Any:
    op = typed(step, Wait)
    return ctx.plan(
        step,
        attrs={"peers": op.from_.value, "signal": False, "wait": True},
        signalling=True,
    )


BARRIER = define(OpDef("barrier", Barrier, barrier_semantics, None, no_data, no_io, lower_barrier,
                           teams=True))
SIGNAL = define(OpDef("signal", Signal, signal_semantics, None, no_data, no_io, lower_signal,
                          teams=True))
WAIT = define(OpDef("wait", Wait, wait_semantics, None, no_data, no_io, lower_wait,
                        teams=True))
