"""A cast inside a move: ``scale: {per: tensor | token, buffer: s}`` on a move op whose
``dst`` dtype differs from its ``src``'s (``ragged_all_to_all``; ``all_to_all`` of one
payload along dim 0, lowered with ragged_all_to_all's kernel at full counts).

Two casts, by the pair of dtypes (anything else is ``bad-cast``; a dtype change without
``scale`` stays ``dtype-mismatch``):

- quantise (bf16, f16 or f32 ``src`` -> fp8e4m3 or fp8e5m2 ``dst``; top = 448 or
  57344, its largest finite value), on the push:
  ``per: token``: each row (the last dim) gets ``scale = max(amax, 1e-4) / top`` and is
  sent as ``round_fp8(row * (top / max(amax, 1e-4)))``; the scale travels with it
  into ``s`` on the receiver (``s`` symmetric f32, ``dst``'s shape without its last dim:
  DeepEP's ``recv_x_scales``). ``group: G`` (with ``per: token``): the same rule per G
  consecutive channels of a row (DeepEP's and DeepSeek-V3's per-128-channel scales),
  ``s`` with ``dst``'s shape, its last dim divided by G (dcpc.numerics.token_scales: the
  whole row is the one-group case). ``per: tensor``: ``s`` is a ``[1]`` f32 scale read
  on the sender (a static scale): ``round_fp8(x * (1 / s[0]))``. ``rule:`` (per token):
  how the scales are made and the values round, ``dcpc`` (the above) or DeepEP's
  ``deepep`` / ``deepep_round_scale`` (dcpc.numerics.SCALE_RULES, token_scales).
- dequantise (fp8e4m3 or fp8e5m2 ``src`` -> bf16, f16 or f32 ``dst``), on the push: ``dst = q *
  scale`` in fp32, rounded once into dst (to nearest even); ``per: token``: ``s`` is
  f32 with ``src``'s shape without its last dim (with ``group``: its last dim divided
  by G, ``q * s[row, c // G]``), read on the sender (the scales the quantising move
  delivered); ``per: tensor``: ``s`` is ``[1]`` f32.

``round_fp8`` (dcpc.numerics, FP8_FORMATS): clamp to +-top (an inf too: saturated),
round half away from zero to the format's grid (e4m3: 2**-9 below 2**-6; e5m2: 2**-16
below 2**-14), NaN stays NaN (byte 0x7F): the kernels' rule, which the float64 reference
applies bit for bit. A dequantised e5m2 inf stays inf (times the scale), a NaN NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dcpc.lang import expr as ex
from dcpc.lang.expr import div, product
from dcpc.lang.nodes import Int, Name, Node, OpBase, int_sizes
from dcpc.numerics import FP8_FORMATS, SCALE_RULES, ScaleRule, inverse_top
from dcpc.ops.common import BEFORE, READ, WRITE, Effect, Region
from dcpc.ops.iface import Ref, TensorScale

if TYPE_CHECKING:
    import torch

    from dcpc.lang.nodes import ScheduleView, Step
    from dcpc.ops.iface import InputRule, LowerRules, ShapeRules, SimView

WIDE = ("bf16", "f16", "f32")
FP8 = tuple(FP8_FORMATS)  # the formats a cast quantises into and dequantises from


class Scale(Node):
    per: Literal["tensor", "token"] = Field(description="one scale per tensor or per row")
    buffer: Name = Field(description="f32: [1] (tensor), or the rows' shape (token)")
    group: Int | None = Field(default=None, description="per token: one scale per this "
                              "many channels (a power of two, e.g. DeepEP's 128)")
    rule: ScaleRule = Field(default="dcpc", description="how a per-token quantise makes "
                            "its scales and rounds (dcpc.numerics.SCALE_RULES)")


def _pair(a: str, b: str) -> str | None:
    """'quantise' | 'dequantise' for a supported (src, dst) dtype pair, else None."""
    if a in WIDE and b in FP8:
        return "quantise"
    if a in FP8 and b in WIDE:
        return "dequantise"
    return None


def payload(op: OpBase) -> tuple[str, str] | None:
    """(src, dst) of the payload a move's ``scale`` casts: its one payload, or the FIRST of
    a ragged_all_to_all's list (the tokens; the ids and weights beside them move as they
    are); None for an all_to_all's list (verify_move refuses a cast there)."""
    src, dst = op.src, op.dst  # type: ignore[attr-defined]
    if isinstance(src, str) and isinstance(dst, str):
        return src, dst
    if op.op == "ragged_all_to_all" and isinstance(src, list) and isinstance(dst, list):
        return (src[0], dst[0]) if src and dst else None
    return None


def direction(schedule: ScheduleView, op: OpBase) -> str | None:
    """'quantise' | 'dequantise' for a move with a supported cast, else None."""
    scale = getattr(op, "scale", None)
    pair = payload(op)
    if scale is None or pair is None:
        return None
    a, b = schedule.buffers.get(pair[0]), schedule.buffers.get(pair[1])
    if a is None or b is None:
        return None
    return _pair(a.dtype.value, b.dtype.value)


def effects(schedule: ScheduleView, op: OpBase) -> list[Effect]:
    """The scale buffer's access: a per-token quantise stores the senders' scales into
    every peer's ``s`` (block p, like dst); every other cast reads ``s`` on the sender."""
    scale = getattr(op, "scale", None)
    if scale is None:
        return []
    if scale.per == "token" and direction(schedule, op) == "quantise":
        return [Effect(scale.buffer, WRITE, BEFORE, Region("index", 0), "scale.buffer")]
    return [Effect(scale.buffer, READ, BEFORE, None, "scale.buffer")]


def input_rules(op: OpBase) -> dict[str, InputRule]:
    """A move's synthetic-input rules (``OpDef.inputs``): a ``per: tensor`` scale is one
    fp8 scale (a per-token one is the move's own output)."""
    scale: Scale | None = getattr(op, "scale", None)
    if scale is None or scale.per != "tensor":
        return {}
    return {scale.buffer: TensorScale(payload(op) or ())}


def verify(v: ShapeRules, src: Ref, dst: Ref, cast: bool = True) -> None:
    """A move's dtypes: the same without ``scale``; a supported cast and its scale with.
    ``cast`` False: a payload the step's ``scale`` does not cast (not the first)."""
    op = v.step.op
    scale: Scale | None = getattr(op, "scale", None) if cast else None
    if scale is None:
        a, b = v.buffer(src.name), v.buffer(dst.name)
        if a is not None and b is not None and a.dtype != b.dtype and _pair(a.dtype.value,
                                                                          b.dtype.value):
            v.error(dst.mark, "dtype-mismatch",
                    f"step '{v.step.name}' moves {a.dtype.value} data from '{src.name}' into "
                    f"'{dst.name}', which is {b.dtype.value}",
                    hint=f"declare '{dst.name}' with dtype {a.dtype.value}, or cast in the "
                    "move: add 'scale: {per: token, buffer: <f32 scales>}' (docs/language.md)"
                    if cast else f"declare '{dst.name}' with dtype {a.dtype.value}: 'scale' "
                    "casts the first payload only (list the one to cast first)")
            return
        v.same_dtype(src, dst)
        return
    a, b = v.buffer(src.name), v.buffer(dst.name)
    s = v.buffer(scale.buffer)
    if a is None or b is None:
        return
    way = direction(v.ctx.schedule, op)
    if way is None:
        v.error(op.mark("scale"), "bad-cast",
                f"{v.step.kind} '{v.step.name}' casts {a.dtype.value} '{src.name}' into "
                f"{b.dtype.value} '{dst.name}'; a move casts bf16, f16 or f32 to fp8e4m3 "
                "or fp8e5m2, or an fp8 back to one of them",
                hint="drop 'scale' for a move without a cast" if a.dtype == b.dtype else
                f"dequantise '{src.name}' to bf16, f16 or f32 first (a move into a buffer of "
                f"one), then quantise that into '{dst.name}'"
                if a.dtype.value in FP8 and b.dtype.value in FP8 else
                f"declare '{dst.name}' with dtype fp8e4m3 (or '{src.name}')")
        return
    _rule(v, scale, way)
    if s is None:
        return
    mark = scale.mark("buffer")
    rows_of = dst if way == "quantise" else src
    shape = v.shape(rows_of.name)
    if scale.per == "tensor":
        want, why = [("num", 1)], "one f32 scale for the whole tensor"
    else:
        want = shape[:-1] if shape is not None else None
        why = f"one f32 scale per row of '{rows_of.name}' (its shape without the last dim)"
    if scale.group is not None:
        want, why = _grouped(v, scale, rows_of, shape)
    elif shape is not None and middle_dims(op, shape) and tile_group(v.ctx.schedule, op,
                                                                     shape) is None:
        _no_tile(v, scale, rows_of, shape)
    if s.dtype.value != "f32":
        v.error(mark, "bad-scale",
                f"scale '{scale.buffer}' of step '{v.step.name}' is {s.dtype.value}; scales "
                "are f32", hint=f"declare '{scale.buffer}' with dtype f32")
    ref = Ref(scale.buffer, "scale.buffer", mark)
    if want is not None:
        v.expect(ref, want, why)
    sent = scale.per == "token" and way == "quantise"
    if sent and not s.is_symmetric:
        v.error(mark, "bad-scale",
                f"scale '{scale.buffer}' of step '{v.step.name}' receives every sender's "
                "per-token scales, so it must be symmetric",
                hint=f"add 'symmetric: true' to buffer '{scale.buffer}'")


def _rule(v: ShapeRules, scale: Scale, way: str) -> None:
    """A ``rule`` other than dcpc's names how a per-token quantise makes its scales and
    rounds (SCALE_RULES; another name is the parser's ``bad-value``); on a cast that
    makes no scale (per tensor, a dequantise) it is refused at ``rule``."""
    if scale.rule != "dcpc" and (scale.per != "token" or way != "quantise"):
        v.error(scale.mark("rule"), "bad-scale",
                f"step '{v.step.name}' gives its {way} per {scale.per} the rule "
                f"'{scale.rule}'; a rule makes the scales of a quantise per token",
                hint="drop 'rule' (it belongs on the quantising move, per token)")


def _grouped(v: ShapeRules, scale: Scale, rows_of: Ref, shape: list | None
             ) -> tuple[list | None, str]:
    """The shape of a ``group: G`` cast's ``s`` (the rows' shape, the last dim divided
    by G) and why; a G that is no power of two up to 1024 (the kernel's column tile),
    ``per: tensor``, or a row not a whole number of groups is refused."""
    g, mark = scale.group, scale.mark("group")
    why = (f"one f32 scale per {g} channels of each row of '{rows_of.name}': its shape "
           f"with the last dim divided by {g}")
    if scale.per != "token" or g is None or not _tile(g):
        v.error(mark, "bad-scale",
                f"step '{v.step.name}' groups its scales by {g} channels"
                + ("" if scale.per == "token" else " with 'per: tensor'")
                + "; a group is a power of two up to 1024, with 'per: token'",
                hint="write 'scale: {per: token, group: 128, buffer: s}' (DeepEP's "
                "per-128-channel scales), or drop 'group'")
        return None, why
    if shape is None:
        return None, why
    last = div(shape[-1], ("num", g))
    example = v.ctx.samples.inexact(last)
    if v.ctx.undecided(mark, f"whether {g} channels divide the rows of '{rows_of.name}' "
                       f"({ex.unparse(shape[-1])})", example):
        return None, why
    if example is not None:
        names = example.names([shape[-1]])  # type: ignore[attr-defined]
        world = example.world  # type: ignore[attr-defined]
        where = (f" for W={world}" if ex.symbols(shape[-1]) else "") + (
            f" ({names})" if names else "")  # a literal length: no W, no sizes
        v.error(mark, "inexact-division",
                f"step '{v.step.name}' groups the rows of '{rows_of.name}' by {g} channels, "
                f"but their length {ex.unparse(shape[-1])} is not a multiple of {g}{where}",
                hint=f"make the last dim of '{rows_of.name}' a multiple of {g}")
        return None, why
    return [*shape[:-1], last], why


def middle_dims(op: OpBase, shape: list) -> bool:
    """A per-token cast without ``group`` on a ragged_all_to_all whose rows have more than
    one dim after the capacity (``[W, C, 2, H]``): one scale per row of the LAST dim (the
    reference's rule), which the kernel, whose row is every dim after the capacity, takes
    as ``group`` = the last dim (``tile_group``)."""
    scale: Scale | None = getattr(op, "scale", None)
    return (op.op == "ragged_all_to_all" and scale is not None and scale.per == "token"
            and scale.group is None and len(shape) > 3)


def _tile(g: int) -> bool:
    """A group the kernel tiles: a power of two up to 1024 (its column tile)."""
    return 1 <= g <= 1024 and not g & (g - 1)


def tile_group(schedule: ScheduleView, op: OpBase, shape: list) -> int | None:
    """The channels per scale of the kernel's grouped tile: ``group``, or for a cast with
    ``middle_dims`` its last dim, when that is an integer (of sizes declared as plain
    integers) the kernel tiles; None otherwise (one scale per kernel row, or refused)."""
    scale: Scale | None = getattr(op, "scale", None)
    if scale is None or not middle_dims(op, shape):
        return scale.group if scale is not None else None
    fixed = int_sizes(schedule)
    last = shape[-1]
    g = ex.evaluate(last, fixed) if ex.symbols(last) <= fixed.keys() else None
    return g if g is not None and _tile(g) else None


def _no_tile(v: ShapeRules, scale: Scale, rows_of: Ref, shape: list) -> None:
    """A ``middle_dims`` cast whose last dim the kernel cannot tile: refused, located."""
    dims = ", ".join(ex.unparse(d) for d in shape)
    v.error(scale.mark("per"), "bad-scale",
            f"step '{v.step.name}' scales '{rows_of.name}' [{dims}] per token: one scale per "
            f"row of its last dim {ex.unparse(shape[-1])}, which the kernel takes as a group "
            "of channels, so that dim must be a power of two up to 1024, of integer sizes",
            hint=f"make the last dim of '{rows_of.name}' a power of two up to 1024 (a size "
            "declared as an integer, e.g. 'H: 128'), or give its rows one dim after the "
            "capacity (one scale per whole row)")


def quantise_rows(x: torch.Tensor, per: str, scale: torch.Tensor | None, dtype: str,
                  group: int | None = None, rule: ScaleRule = "dcpc"
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the fp8 ``dtype`` values of rows ``x`` as a float64 tensor, the per-row scales
    sent) for a quantising move; ``scale`` is the ``[1]`` tensor scale (per tensor);
    ``group``: per token, one scale per ``group`` channels (the scales' last dim H / group);
    ``rule``: per token, how the scales are made and the values round (SCALE_RULES)."""

    from dcpc.numerics import quantise_tokens, quantize_fp8, reference_scale

    if per == "token":
        q, sent = quantise_tokens(x, dtype, group, rule)
        return q.double(), sent.double()
    assert scale is not None
    s = reference_scale(scale, "the cast's per-tensor scale")
    return quantize_fp8(x, s, dtype).double(), None


def dequantise_rows(q: torch.Tensor, per: str, scale: torch.Tensor,
                    group: int | None = None) -> torch.Tensor:
    """``q * scale`` in fp32 (per token: one scale per row, or per ``group`` channels),
    as float64."""
    import torch

    from dcpc.numerics import reference_scale, spread

    s = scale.to(torch.float32)
    s = spread(s, group) if per == "token" else reference_scale(s, "the cast's per-tensor scale")
    return (q.float() * s).double()


def verify_move(v: ShapeRules) -> None:
    """An all_to_all with a cast: one payload, split along dim 0 (rows: the last dim),
    dst [W, *part] symmetric, and the cast's own rules."""
    op = v.step.op
    srcs, dsts = v.refs("src"), v.refs("dst")
    if len(srcs) != 1 or len(dsts) != 1 or getattr(op, "dim", 0) != 0:
        v.error(op.mark("scale"), "bad-cast",
                f"step '{v.step.name}' casts in an all_to_all of {len(srcs)} payload(s) "
                f"along dim {getattr(op, 'dim', 0)}; a cast moves one payload split along "
                "dim 0 (rows of its last dim)",
                hint="give the cast its own all_to_all step, split along dim 0")
        return
    (src,), (dst,) = srcs, dsts
    v.transfer(dst, dst, symmetric=True)  # peers write it: symmetric
    verify(v, src, dst)
    part = v.part(src) if v.buffer(src.name) is not None else None
    if part is not None and v.shape(dst.name) is not None:
        v.expect(dst, [v.W, *part],
                 f"W parts of src '{src.name}', one per peer, along a leading W axis")


def all_to_all_reference(sim: SimView, op: OpBase) -> None:
    """An all_to_all with a cast, in float64: every rank's src cast as it travels
    (``quantise_rows``/``dequantise_rows``), then moved; per-token scales alongside."""
    src, dst = op.src, op.dst  # type: ignore[attr-defined]
    scale: Scale = op.scale  # type: ignore[attr-defined]
    way = direction(sim.schedule, op)
    sent = f"{src}__cast"
    scales = f"{scale.buffer}__sent"
    for p in range(sim.world):
        x = sim.bufs[p][src]
        if way == "quantise":
            x, s = quantise_rows(x, scale.per, sim.bufs[p].get(scale.buffer),
                                 sim.schedule.buffers[dst].dtype.value, scale.group,
                                 scale.rule)
            if s is not None:
                sim.stash(p, scales, s, like=scale.buffer)
        else:
            x = dequantise_rows(x, scale.per, sim.bufs[p][scale.buffer], scale.group)
        sim.stash(p, sent, x, like=dst)
    sim.all_to_all(sent, dst, 0)
    if scales in sim.bufs[0]:
        sim.all_to_all(scales, scale.buffer, 0)


# CAST of ragged_all_to_all's kernel: 0 none, 1 quantise per token (the scales travel),
# 2 quantise per tensor, 3 dequantise per token, 4 dequantise per tensor
CAST_MODES = {("quantise", "token"): 1, ("quantise", "tensor"): 2,
              ("dequantise", "token"): 3, ("dequantise", "tensor"): 4}


def cast_attrs(ctx: LowerRules, op: Any) -> dict[str, Any]:
    """The attrs of a move's cast in ragged_all_to_all's kernel (none: ``cast`` 0);
    ``fp8_top``: the quantised dst's largest finite value (dcpc.numerics.FP8_FORMATS)."""

    way = direction(ctx.schedule, op)
    mode = CAST_MODES[(way, op.scale.per)] if way is not None and op.scale is not None else 0
    pair = payload(op)
    assert pair is not None
    out = ctx.buffers[pair[1]].dtype
    group = op.scale.group if op.scale is not None else None  # s's shape (torch's call)
    tile = tile_group(ctx.schedule, op, ctx.shape(pair[1]))  # the kernel's channels per scale
    rule = op.scale.rule if op.scale is not None else "dcpc"
    return {"cast": mode, "scale": op.scale.per if op.scale is not None else None,
            "bf16_out": out == "bf16", "fp8_top": FP8_FORMATS.get(out, (None,))[0],
            **({"group": group} if group is not None else {}),
            **(_rule_attrs(rule, out) if mode == 1 else {}),
            **({"tile": tile} if tile is not None else {})}


def _rule_attrs(rule: ScaleRule, out: str) -> dict[str, Any]:
    """A quantise per token's rule for the kernel: its properties (SCALE_RULES:
    ``skips_nan``, ``scale_by``, ``even``), the template's branches; ``fp8_inverse_top``
    (numerics.inverse_top) where the scale multiplies; ``rule`` (the torch backend's
    argument) where it is not dcpc's."""
    props = SCALE_RULES[rule]
    return {"skips_nan": props.skips_nan, "scale_by": props.scale, "even": props.even,
            **({"fp8_inverse_top": inverse_top(out)} if props.scale != "divide" else {}),
            **({"rule": rule} if rule != "dcpc" else {})}


def lower_move(ctx: LowerRules, step: Step) -> Any:
    """An all_to_all with a cast (one payload along dim 0): src seen as [W, cap, row_len],
    every row live: ragged_all_to_all's kernel without counts."""
    op: Any = step.op
    assert isinstance(op.src, str) and isinstance(op.dst, str) and op.scale is not None
    shape = ctx.shape(op.src)
    row_len = shape[-1]
    return ctx.plan(
        step,
        template="ops/ragged_all_to_all.py.j2",
        params=ctx.engine([op.src, op.scale.buffer]),
        returns=[op.dst],
        roles={"src": op.src, "dst": op.dst, "scale": op.scale.buffer},
        scalars=[("cap", div(product(shape[:-1]), ctx.team_w(step))), ("row_len", row_len)],
        tiles=[row_len],
        signalling=True,
        attrs={"ragged": False, **cast_attrs(ctx, op)},
    )
