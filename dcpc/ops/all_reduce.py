"""all_reduce: every rank gets the elementwise reduction over ranks of ``src``.

``reduce: sum`` (default) or ``max``. Every rank pushes its whole ``src`` into index
``rank`` of every rank's symmetric receive buffer ``via`` ([W, *src shape]; implicit
``<step>_recv`` when omitted), signals, waits, then reduces ``via[0] .. via[W-1]`` IN
THAT ORDER in fp32 into ``dst`` (src's shape): every rank adds the same values in the
same order, so every rank's ``dst`` is bitwise identical.
Lowerings: dcpc/codegen/rules.py ``all_reduce`` + templates/ops/all_reduce.py.j2;
dcpc/runtime/collectives.py ``all_reduce``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from dcpc.lang.nodes import Name, OpBase, Step
from dcpc.ops.common import (
    AFTER,
    BEFORE,
    READ,
    WRITE,
    Region,
    Scope,
    Semantics,
    effects,
    exchange,
    keyed,
)
from dcpc.ops.registry import IO, OpDef, define

if TYPE_CHECKING:
    from dcpc.check.ops import Verify
    from dcpc.harness.simulate import Sim

REDUCTIONS = ("sum", "max")


class AllReduce(OpBase):
    op: Literal["all_reduce"]
    src: Name
    dst: Name
    reduce: Literal["sum", "max"] = "sum"
    via: Name | None = Field(
        default=None, description="symmetric receive buffer [W, *src]; implicit if omitted"
    )


def via_of(step: Step) -> tuple[str, str]:
    """An all_reduce's receive buffer and its key (implicit: ``<step>_recv``)."""
    via = step.op.via  # type: ignore[attr-defined]
    return (via, "via") if via else (f"{step.name}_recv", "")


def semantics(c: Scope, step: Step) -> Semantics:
    op = step.op
    via = [via_of(step)]
    before = effects(READ, BEFORE, keyed(op, "src"))
    before += effects(WRITE, BEFORE, via, Region("index", 0))
    after = effects(READ, AFTER, via) + effects(WRITE, AFTER, keyed(op, "dst"))
    return exchange(before, after, step)


def verify(v: Verify, step: Step) -> None:
    op = step.op
    assert isinstance(op, AllReduce)
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    a, b = v.buffer(src.name), v.buffer(dst.name)
    for ref, buf in ((src, a), (dst, b)):
        if buf is not None and not buf.dtype.is_float:
            v.error(ref.mark, "non-float-output",
                    f"{ref.role} '{ref.name}' of all_reduce '{step.name}' is "
                    f"{buf.dtype.value}; it reduces in fp32, so it reads and writes "
                    "floating-point buffers",
                    hint=f"declare '{ref.name}' with dtype bf16, f16 or f32")
    shape = v.shape(src.name)
    if shape is not None and v.shape(dst.name) is not None:
        v.expect(dst, shape, f"the reduction of src '{src.name}' over ranks")
    if op.via is not None and shape is not None:
        (via,) = v.refs("via")
        v.transfer(src, via, symmetric=True)
        if v.shape(via.name) is not None:
            v.expect(via, [v.W, *shape], f"src '{src.name}' of every rank, along a leading "
                     "W axis")


def reference(sim: Sim, step: Step) -> None:
    import torch  # the compiler imports no torch; only the simulator runs this

    op: AllReduce = step.op  # type: ignore[assignment]
    parts = torch.stack([sim.bufs[r][op.src].to(torch.float64) for r in range(sim.world)])
    for r in range(sim.world):
        if op.via is not None:
            sim.store(r, op.via, parts.clone())
        total = parts.sum(dim=0) if op.reduce == "sum" else parts.amax(dim=0)
        sim.store(r, op.dst, total)


def io(op: AllReduce) -> IO:
    return [op.src], [op.dst] + ([op.via] if op.via else [])


DEF = define(OpDef("all_reduce", AllReduce, semantics, verify, reference, io))
