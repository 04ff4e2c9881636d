"""What the reductions and the rooted ops share: all_reduce (sum, max), reduce_scatter,
reduce and broadcast.

A helper of the op modules, not an op: it imports only what an op may import
(tests/codegen/test_layers.py), so that no op module imports another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dcpc.lang import expr as ex
from dcpc.lang.expr import W, product
from dcpc.lang.mesh import mesh_of, shape_of, torus

if TYPE_CHECKING:
    from dcpc.lang.nodes import Step
    from dcpc.ops.iface import LowerRules, ShapeRules

MERGE_KEYS = ("mask_empty", "return_lse", "lse_base")  # all_reduce's reduce: lse only
# the kernels' REDUCE: an index into this
REDUCTIONS = ("sum", "max", "lse")


def via_of(step: Step) -> tuple[str, str]:
    """A sum/max reduction's receive buffer and its key (implicit: ``<step>_recv``)."""
    via = step.op.via  # type: ignore[attr-defined]
    return (via, "via") if via else (f"{step.name}_recv", "")


def floats_only(v: ShapeRules, step: Step, refs: list[Any],
                why: str = "it reduces in fp32, so it reads and writes floating-point "
                           "buffers") -> None:
    """A reduction's buffers are floats it computes on: it sums (or takes the max) in
    fp32, which an integer does not survive, and fp8e5m2 is not summed either (only the
    moves carry integers and fp8e5m2, bit for bit: ``DType.computes``); its ``dst`` may be
    any float (an fp8 one through ``output_scale``: dcpc.check.ops); ``why``: what the
    error says of the op (weighted_combine's sum says its own)."""
    for ref in refs:
        buf = v.buffer(ref.name)
        ok = buf is None or (buf.dtype.is_float if ref.role == "dst" else buf.dtype.computes)
        if buf is not None and not ok:
            only = (" (fp8e5m2 is summed into, through output_scale, never read by a sum)"
                    if buf.dtype.is_float else "")
            v.error(ref.mark, "non-float-output",
                    f"{ref.role} '{ref.name}' of {step.kind} '{step.name}' is "
                    f"{buf.dtype.value}{only}; {why}",
                    hint=f"declare '{ref.name}' with dtype bf16, f16 or f32")


def verify_elementwise(v: ShapeRules, step: Step) -> None:
    """sum/max of one ``src`` into ``dst`` through ``via`` (all_reduce, reduce); an fp8
    ``dst``'s ``output_scale``: the rule every computed result shares (dcpc.check.ops)."""
    op = step.op
    for key in ("src", "via", *MERGE_KEYS):
        value = getattr(op, key, None)
        if (key in MERGE_KEYS and value is not None) or isinstance(value, list):
            v.error(op.mark(key), "bad-reduce",
                    f"{step.kind} '{step.name}' with reduce: {op.reduce} takes one buffer "
                    f"as src and via and no {', '.join(MERGE_KEYS)}; '{key}' is for "
                    "reduce: lse", hint="use 'reduce: lse' with 'src: [o, lse]', or drop it")
            return
    (src,), (dst,) = v.refs("src"), v.refs("dst")
    floats_only(v, step, [src, dst])
    shape = v.shape(src.name)
    if shape is not None and v.shape(dst.name) is not None:
        v.expect(dst, shape, f"the reduction of src '{src.name}' over ranks")
    if op.via is not None and shape is not None:  # type: ignore[attr-defined]
        (via,) = v.refs("via")
        v.transfer(src, via, symmetric=True)
        if v.shape(via.name) is not None:
            v.expect(via, [v.W, *shape], f"src '{src.name}' of every rank, along a leading "
                     "W axis")


def verify_root(v: ShapeRules, step: Step) -> None:
    """``root`` names a member of the step's team at every group size checked: a rank
    without ``axis:``, a member index (0 .. G-1) of each team over ``axis:`` (broadcast,
    reduce)."""
    root = step.op.root  # type: ignore[attr-defined]
    worlds = v.ctx.samples.worlds
    if not worlds:
        return
    axes = mesh_of(v.ctx.schedule).team_axes(step.op)
    if axes is None:
        if root >= min(worlds):
            # int(): a mesh shape prints as "2x2", its rank count is 4
            v.error(step.op.mark("root"), "root-out-of-range",
                    f"step '{step.name}' has root {root}, but the group has only "
                    f"{_ranks(int(min(worlds)))} at W={min(worlds)} (checked: W "
                    f"{min(worlds)}..{max(worlds)})",
                    hint=f"use a root below {int(min(worlds))}, or check larger groups only")
        return
    size, world = min((torus(shape_of(w)).team_size(axes), w) for w in worlds)
    if root >= size:
        names = ", ".join(mesh_of(v.ctx.schedule).names(axes))
        v.error(step.op.mark("root"), "root-out-of-range",
                f"step '{step.name}' has root {root} (a member index of its team over "
                f"{names}), but its team has only {_ranks(size)} at W={world}",
                hint=f"use a root below {size}, or check larger meshes only")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def receive_buffer(ctx: LowerRules, step: Step, outer: ex.Expr, part: ex.Expr) -> str:
    """A sum/max reduction's ``via``: the schedule's, or the implicit ``<step>_recv``
    [W, outer * part] (symmetric, src's dtype), which the module then owns."""
    op: Any = step.op
    via = via_of(step)[0]
    if op.via is None:
        ctx.add_buffer(via, [W, product([outer, part])], ctx.buffers[op.src].dtype, "symmetric")
    return via


def lower_elementwise(ctx: LowerRules, step: Step) -> Any:
    """all_reduce (sum, max) and reduce: src pushed whole into via, reduced into dst."""
    op: Any = step.op
    assert isinstance(op.src, str)
    shape = ctx.shape(op.src)
    # src seen as [outer, part]: part its last dim (one tile row), outer the rest
    outer, part = product(shape[:-1]), shape[-1]
    via = receive_buffer(ctx, step, outer, part)
    plan = ctx.plan(
        step,
        params=ctx.engine([op.src]),
        returns=[op.dst],
        roles={"src": op.src, "via": via, "dst": op.dst},
        scalars=[("outer", outer), ("part", part)],
        tiles=[part],
        scratch={"acc": (product(shape), "f32")},
        attrs={"reduce": REDUCTIONS.index(op.reduce)},
        signalling=True,
    )
    ctx.output_scale(op, plan)
    return plan
