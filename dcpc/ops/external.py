"""external: an engine step (attention, ...) between dcpc's steps; it reads ``reads``
and writes ``writes`` on this rank. No kernel is emitted: the engine runs it between
the module's method calls. The simulator asks a callback for its writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from dcpc.lang.nodes import Int, Name, OpBase, Step, Str
from dcpc.ops.common import Scope, Semantics, keyed, local, typed
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.ops.iface import LowerRules, SimView

# the reserved key of an unrolled external step's rows by values (``External.rows``)
ROWS = "__rows__"


class External(OpBase):
    op: Literal["external"]
    reads: list[Name] = Field(default_factory=list)
    writes: list[Name] = Field(default_factory=list)
    # which rank's KV shard the partials this step writes belong to, when not its own
    # (a ring's hop attends another rank's block): an expression of r, the hop index
    # and W that the unroller evaluates per rank (dcpc.lang.loops); only the harness's
    # synthetic engine step reads it (its empty-shard rows, docs/language.md)
    shard: Union[Int, Str, None] = Field(  # noqa: UP007
        default=None, description="the rank whose KV shard this step's partials belong "
        "to (an expression of r, the hop index and W), for the harness's synthetic step")
    # rows by values (``q[half1]``, docs/language.md): the unrolled form the unroller
    # (dcpc.lang.loops ``_rows``) writes, never the file: buffer (or slot) -> the 1-d
    # integer buffer whose values name the rows of its axis 0 this step reads / writes;
    # the buffer and the index both stand in ``reads`` (a rows write reads the buffer too:
    # the other rows keep their values), so the checker's models see whole buffers
    rows: SkipJsonSchema[dict[str, str]] = Field(default_factory=dict, alias=ROWS, exclude=True)


def semantics(c: Scope, step: Step) -> Semantics:
    return local(keyed(step.op, "reads"), keyed(step.op, "writes"))


def reference(sim: SimView, step: Step) -> None:
    for r in range(sim.world):
        for name, value in sim.external(step, r, sim.bufs[r]).items():
            sim.store(r, name, value)


def io(op: External) -> IO:
    return list(op.reads), list(op.writes)


def lower(ctx: LowerRules, step: Step) -> Any:
    """No kernel: the engine's own, between calls (the contract names what it touches)."""
    op = typed(step, External)
    return ctx.plan(step, template=None, reads=list(op.reads), writes=list(op.writes))


DEF = define(OpDef("external", External, semantics, None, reference, io, lower, exact=True,
                   engine=True))
