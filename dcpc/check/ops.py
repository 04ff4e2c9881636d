"""Per-op rules: shapes, dtypes, dims, symmetric destinations and LSE bases.

Each op's verifier is defined with the rest of the op in dcpc/ops/<op>.py
(``OpDef.verify``) and gets a ``Verify``: this module's shared rules bound to its
step and the check context. ``RULES`` is the registry's view of them. A rule compares shapes
symbolically, by evaluation on the sampled bindings of every W checked, and names a
counterexample binding when they differ. Buffers that are unknown or whose shape
did not parse are skipped: their error is reported once, elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dcpc.check.context import Context, Ref, mask_refs, refs, show, team_expr
from dcpc.diagnostics import Mark
from dcpc.lang import expr as ex
from dcpc.lang.model import Buffer, OpBase, Step
from dcpc.lang.nodes import BUFFER_KEYS
from dcpc.ops import OPS
from dcpc.ops.common import OUTPUT_SCALE

LSE_DTYPES = ("f32", "f16", "bf16")
BASE_HINT = "add 'lse_base: e' (natural log, e.g. FlashMLA) or 'lse_base: 2' (FlashInfer)"


def _where(ctx: Context, example: object, nodes: Sequence[ex.Expr]) -> str:
    binding = example.names(nodes)  # type: ignore[attr-defined]
    world = example.world  # type: ignore[attr-defined]
    return f"W={world}" + (f" ({binding})" if binding else "")


def _dim(ctx: Context, step: Step, ref: Ref, rank: int) -> int | None:
    """The op's ``dim``, in range for a buffer of ``rank`` dims and counted from the front:
    the semantics, the lowerings and the references read ``dim`` as it is written, so a
    negative one (which a run read as another dim, or past the buffer) is refused here,
    with the index it means."""
    dim = getattr(step.op, "dim", 0)
    if 0 <= dim < rank:
        return dim
    means = f"; write {dim % rank} (dim {dim} of {rank} dims, counted from the end)" \
        if -rank <= dim < 0 else ""
    ctx.error(step.op.mark("dim"), "dim-out-of-range",
              f"dim {dim} is out of range for {ref.role} '{ref.name}', which has {rank} "
              f"dims (valid: 0..{rank - 1}{means})")
    return None


def _expect(ctx: Context, step: Step, ref: Ref, want: list[ex.Expr], why: str) -> None:
    """``ref``'s buffer must have the shape ``want``; report rank or value differences."""
    have = ctx.shape(ref.name)
    if have is None:
        return
    if len(have) != len(want):
        ctx.error(ref.mark, "shape-mismatch",
                  f"{ref.role} '{ref.name}' of step '{step.name}' has {len(have)} dims "
                  f"{show(have)} but must have {len(want)}, {show(want)} ({why})")
        return
    example = ctx.samples.shapes_differ(want, have)
    if ctx.undecided(ref.mark, f"whether {ref.role} '{ref.name}' of step '{step.name}' has "
                     f"shape {show(want)} ({why})", example):
        return
    if example is not None:
        ctx.error(ref.mark, "shape-mismatch",
                  f"{ref.role} '{ref.name}' of step '{step.name}' has shape {show(have)} but "
                  f"must be {show(want)} ({why}); they differ for "
                  f"{_where(ctx, example, [*want, *have])}: {example.detail}")


def _g(size: ex.Expr) -> str:
    """A team size as a divisor in a message: ``W``, ``G``, ``(N*G)``."""
    text = ex.unparse(size)
    return text if size[0] in ("sym", "num") else f"({text})"


def _part(ctx: Context, step: Step, ref: Ref, along: int | None = None) -> list[ex.Expr] | None:
    """``ref``'s shape split in G (the op's team size; W without a mesh) equal parts along
    the op's dim (which must divide), or along dim ``along`` (in range)."""
    W = team_expr(ctx, step)  # noqa: N806  (the team size G: W without a mesh)
    shape = ctx.shape(ref.name)
    if shape is None:
        return None
    dim = _dim(ctx, step, ref, len(shape)) if along is None else along
    if dim is None:
        return None
    part = ("/", shape[dim], W)
    example = ctx.samples.inexact(part)
    key = "dim" if along is None else "split_dim"
    mark = step.op.mark(key) if key in step.op.src_marks else ref.mark
    if ctx.undecided(mark, f"whether step '{step.name}' splits {ref.role} '{ref.name}' in "
                     f"{ex.unparse(W)} whole parts ({ex.unparse(shape[dim])})", example):
        return None
    if example is not None:
        ctx.error(mark,
                  "inexact-division",
                  f"step '{step.name}' splits {ref.role} '{ref.name}' in {ex.unparse(W)} parts "
                  f"along dim {dim}, but {ex.unparse(shape[dim])}/{_g(W)} is not a whole "
                  "number for "
                  f"{_where(ctx, example, [shape[dim]])}",
                  hint="split along a dim that is a multiple of W, e.g. heads "
                  "('H: {multiple_of: W}')")
        return None
    return [*shape[:dim], part, *shape[dim + 1:]]


def _same_dtype(ctx: Context, step: Step, src: Ref, dst: Ref) -> None:
    a, b = ctx.buffer(src.name), ctx.buffer(dst.name)
    if a is not None and b is not None and a.dtype != b.dtype:
        ctx.error(dst.mark, "dtype-mismatch",
                  f"step '{step.name}' moves {a.dtype.value} data from '{src.name}' into "
                  f"'{dst.name}', which is {b.dtype.value}",
                  hint=f"declare '{dst.name}' with dtype {a.dtype.value}")


def _symmetric(ctx: Context, step: Step, ref: Ref) -> None:
    buffer = ctx.buffer(ref.name)
    if buffer is not None and not buffer.is_symmetric:
        ctx.error(ref.mark, "not-symmetric",
                  f"peers write into {ref.role} '{ref.name}' of step '{step.name}', so it must "
                  "be in symmetric memory, but it is engine-owned",
                  hint=f"add 'symmetric: true' to buffer '{ref.name}'")


def _lse_transfer(ctx: Context, step: Step, src: Ref, dst: Ref) -> None:
    """A transfer keeps an LSE's base: both ends declare the same one."""
    a, b = ctx.buffer(src.name), ctx.buffer(dst.name)
    if a is None or b is None or (a.lse_base is None and b.lse_base is None):
        return
    if a.lse_base is not None and b.lse_base is not None:
        if a.lse_base != b.lse_base:
            ctx.error(dst.mark, "lse-base-mismatch",
                      f"step '{step.name}' moves an LSE of base {a.lse_base} from "
                      f"'{src.name}' into '{dst.name}', declared base {b.lse_base}",
                      hint="declare both with the base the attention kernel returns")
        return
    lost, known = (dst, a) if b.lse_base is None else (src, b)
    ctx.error(lost.mark, "missing-lse-base",
              f"step '{step.name}' moves an LSE of base {known.lse_base} between "
              f"'{src.name}' and '{dst.name}', but '{lost.name}' declares no lse_base",
              hint=f"add 'lse_base: {known.lse_base}' to buffer '{lost.name}'")


def _transfer(ctx: Context, step: Step, src: Ref, dst: Ref, *, symmetric: bool) -> None:
    if ctx.buffer(src.name) is None or ctx.buffer(dst.name) is None:
        return
    if symmetric:
        _symmetric(ctx, step, dst)
    _same_dtype(ctx, step, src, dst)
    _lse_transfer(ctx, step, src, dst)


def _pairs(ctx: Context, step: Step, srcs: list[Ref], dsts: list[Ref]) -> list[tuple[Ref, Ref]]:
    if len(srcs) != len(dsts):
        ctx.error(step.op.mark("dst"), "list-length-mismatch",
                  f"step '{step.name}' has {len(srcs)} src buffers but {len(dsts)} dst buffers",
                  hint="give one dst for every src, in the same order")
    return list(zip(srcs, dsts, strict=False))  # the extra ones are reported


def _scatter(ctx: Context, step: Step, src: Ref, recv: Ref) -> list[ex.Expr] | None:
    """src split along dim lands as ``[W, part]`` in the symmetric ``recv``; the part."""
    W = team_expr(ctx, step)  # noqa: N806  (the team size G: W without a mesh)
    _transfer(ctx, step, src, recv, symmetric=True)
    part = _part(ctx, step, src)
    if part is not None and ctx.shape(recv.name) is not None:
        _expect(ctx, step, recv, [W, *part],
                f"{ex.unparse(W)} parts of src '{src.name}', one per peer, along a leading "
                f"{ex.unparse(W)} axis")
    return part


def _output_scale(ctx: Context, step: Step) -> None:
    """The one rule of a computed fp8 result: an op that computes its ``dst`` (its model
    declares ``output_scale``: a reduction, a merge, a weighted sum; a move copies bits
    and refuses a dtype change) writes an fp8 ``dst`` only through ``output_scale``, a
    [1] f32 buffer (e4m3 saturates at 448: a sum past it is no e4m3 value), and takes
    ``output_scale`` for (and only for) an fp8 ``dst``."""
    if OUTPUT_SCALE not in type(step.op).model_fields:
        return
    scale = refs(step.op, OUTPUT_SCALE)
    dsts = refs(step.op, "dst")
    if len(dsts) != 1:
        return  # a list where one buffer goes: reported by the op's own verifier
    (dst,) = dsts
    buf = ctx.buffer(dst.name)
    fp8 = buf is not None and buf.dtype.is_fp8
    if not scale:
        if fp8:
            ctx.error(dst.mark, "missing-output-scale",
                      f"step '{step.name}' writes fp8 output '{dst.name}' without a scale",
                      hint="add 'output_scale: <a [1] f32 buffer>' to the step (dst = "
                      "clamp(out / scale) in the fp8 range)")
        return
    (ref,) = scale
    sbuf, shape = ctx.buffer(ref.name), ctx.shape(ref.name)
    if sbuf is not None and (sbuf.dtype.value != "f32" or shape != [("num", 1)]):
        ctx.error(ref.mark, "bad-output-scale",
                  f"output_scale '{ref.name}' of step '{step.name}' is {sbuf.dtype.value} "
                  f"{show(shape or [])}; it must be one f32 value, shape [1]",
                  hint=f"declare '{ref.name}' as {{shape: [1], dtype: f32}}")
    if buf is not None and not fp8:
        ctx.error(ref.mark, "bad-output-scale",
                  f"step '{step.name}' has output_scale, but its dst '{dst.name}' is "
                  f"{buf.dtype.value}; the scale quantizes an fp8 (fp8e4m3, fp8e5m2) "
                  "output",
                  hint=f"declare '{dst.name}' with dtype fp8e4m3 or fp8e5m2, or drop "
                  "output_scale")


def _merge(ctx: Context, step: Step, o: Ref, lse: Ref, *, stacked: bool) -> None:
    """Shapes, dtypes and bases of a merge of W partials (``o``, ``lse``) into dst."""
    W = team_expr(ctx, step)  # noqa: N806  (the team size G: W without a mesh)
    op = step.op
    (dst,) = refs(op, "dst")
    ret = refs(op, "return_lse")
    lse_buf, o_buf, dst_buf = ctx.buffer(lse.name), ctx.buffer(o.name), ctx.buffer(dst.name)
    if lse_buf is not None:
        if lse_buf.dtype.value not in LSE_DTYPES:
            ctx.error(lse.mark, "bad-lse-dtype",
                      f"LSE '{lse.name}' of step '{step.name}' is {lse_buf.dtype.value}; an LSE "
                      "must be f32, f16 or bf16", hint=f"declare '{lse.name}' with dtype f32")
        if lse_buf.lse_base is None:
            ctx.error(lse.mark, "missing-lse-base",
                      f"step '{step.name}' merges with LSE '{lse.name}', which declares no "
                      "lse_base", hint=f"{BASE_HINT} to buffer '{lse.name}'")
        op_base = getattr(op, "lse_base", None)
        if op_base is not None and lse_buf.lse_base not in (None, op_base):
            ctx.error(op.mark("lse_base"), "lse-base-mismatch",
                      f"step '{step.name}' says lse_base {op_base}, but its LSE "
                      f"'{lse.name}' has base {lse_buf.lse_base}",
                      hint=f"use 'lse_base: {lse_buf.lse_base}' or drop it from the step")
    for ref, buf in ((o, o_buf), (dst, dst_buf)):
        # an integer; an fp8e5m2 partial (e5m2 is merged into, never read by a merge)
        if buf is not None and not (buf.dtype.is_float if ref is dst else buf.dtype.computes):
            what = "output" if ref is dst else "partial output"
            ctx.error(ref.mark, "non-float-output",
                      f"{what} '{ref.name}' of {step.kind} '{step.name}' is "
                      f"{buf.dtype.value}; a merge reads floating-point partials it computes "
                      "on (bf16, f16, f32, fp8e4m3) and writes a float (fp8 through "
                      "output_scale)",
                      hint=f"declare '{ref.name}' with dtype bf16, f16 or f32")
    for r in ret:
        buf = ctx.buffer(r.name)
        if buf is None:
            continue
        if buf.dtype.value != "f32":
            ctx.error(r.mark, "bad-lse-dtype",
                      f"return_lse '{r.name}' of step '{step.name}' is {buf.dtype.value}; the "
                      "merged LSE is f32", hint=f"declare '{r.name}' with dtype f32")
        base = lse_buf.lse_base if lse_buf is not None else None
        if buf.lse_base is None and base is not None:
            ctx.error(r.mark, "missing-lse-base",
                      f"return_lse '{r.name}' of step '{step.name}' declares no lse_base",
                      hint=f"add 'lse_base: {base}' to buffer '{r.name}'")
        elif base is not None and buf.lse_base != base:
            ctx.error(r.mark, "lse-base-mismatch",
                      f"return_lse '{r.name}' has base {buf.lse_base}, but step '{step.name}' "
                      f"merges LSEs of base {base}",
                      hint=f"declare '{r.name}' with 'lse_base: {base}'")
    _mask(ctx, step)
    so, sl = ctx.shape(o.name), ctx.shape(lse.name)
    if so is None or sl is None:
        return
    if len(sl) < 1 or len(so) < 2:
        ctx.error(lse.mark, "shape-mismatch",
                  f"step '{step.name}' needs a leading W axis on its LSE and rows plus a "
                  f"feature dim on its output, but has LSE {show(sl)} and output {show(so)}")
        return
    rows = sl[1:]
    _expect(ctx, step, lse, [W, *rows], f"the LSEs of the {ex.unparse(W)} ranks, stacked")
    if stacked:
        _expect(ctx, step, o, [W, *rows, so[-1]],
                f"the {ex.unparse(W)} partial outputs, rows as in LSE '{lse.name}', then the "
                "head dim")
        out_shape = [*rows, so[-1]]
    else:
        _expect(ctx, step, o, [*rows, so[-1]],
                f"this rank's output, rows as in LSE '{lse.name}' without its W axis")
        out_shape = list(so)
    if dst_buf is not None:
        _expect(ctx, step, dst, out_shape, "one merged output row per LSE row")
    for r in ret:
        if ctx.buffer(r.name) is not None:
            _expect(ctx, step, r, list(rows), f"LSE '{lse.name}' without its W axis")


def _mask(ctx: Context, step: Step) -> None:
    W = team_expr(ctx, step)  # noqa: N806  (the team size G: W without a mesh)
    found = mask_refs(step.op)
    shapes = []
    for ref in found:
        buf, shape = ctx.buffer(ref.name), ctx.shape(ref.name)
        if buf is None:
            return
        local = ref.role == "mask_empty.local_seq_lens"
        dims = 2 if local else 1
        if buf.dtype.value not in ("i32", "i64") or (shape is not None and len(shape) != dims):
            what = "a 2-D integer buffer [B, W]" if local else "a 1-D integer buffer"
            ctx.error(ref.mark, "bad-mask",
                      f"{ref.role} '{ref.name}' of step '{step.name}' must be {what} "
                      f"(i32 or i64), not {buf.dtype.value} {show(shape or [])}")
            return
        if local and shape is not None:
            _expect(ctx, step, ref, [shape[0], W], "every rank's local lengths per request")
        shapes.append(shape[:1] if shape is not None else None)
    if len(shapes) == 2 and shapes[0] is not None and shapes[1] is not None:
        seq, qsl = shapes
        example = ctx.samples.shapes_differ([("+", seq[0], ("num", 1))], qsl)
        if ctx.undecided(found[1].mark, f"whether query_start_loc '{found[1].name}' "
                         f"{show(qsl)} is one longer than {found[0].role.split('.')[-1]} "
                         f"'{found[0].name}' {show(seq)}", example):
            return
        if example is not None:
            ctx.error(found[1].mark, "bad-mask",
                      f"query_start_loc '{found[1].name}' {show(qsl)} must be one longer than "
                      f"{found[0].role.split('.')[-1]} '{found[0].name}' {show(seq)} (B+1 "
                      "offsets for B requests); "
                      f"they differ for {_where(ctx, example, [seq[0], qsl[0]])}")


WRITTEN_KEYS = [key for key, role in BUFFER_KEYS.items() if role == "write"]
READ_KEYS = [key for key, role in BUFFER_KEYS.items() if role == "read"]


def _no_aliasing(ctx: Context, step: Step) -> None:
    """A non-external step never writes a buffer twice, nor writes what it reads."""
    op: OpBase = step.op
    written: dict[str, Mark] = {}
    for key in WRITTEN_KEYS:
        for ref in refs(op, key):
            if ref.name in written:
                ctx.error(ref.mark, "aliased-buffer",
                          f"step '{step.name}' writes buffer '{ref.name}' twice", hint=
                          "give every output its own buffer")
            written.setdefault(ref.name, ref.mark)
    reads = [ref for key in READ_KEYS for ref in refs(op, key)]
    for ref in reads + mask_refs(op):
        if ref.name in written:
            ctx.error(ref.mark, "aliased-buffer",
                      f"step '{step.name}' reads buffer '{ref.name}' ({ref.role}) and also "
                      "writes it; peers' stores would race with the read",
                      hint="write into a separate buffer")


class Verify:
    """What an op's verifier (``OpDef.verify`` in dcpc/ops/) works with: the step, the
    check context and the shared rules above, bound to them."""

    def __init__(self, ctx: Context, step: Step):
        self.ctx, self.step = ctx, step

    @property
    def W(self) -> ex.Expr:  # noqa: N802  (the op's team size G; W without a mesh)
        return team_expr(self.ctx, self.step)

    def refs(self, key: str) -> list[Ref]:
        return refs(self.step.op, key)

    def shape(self, name: str) -> list[ex.Expr] | None:
        return self.ctx.shape(name)

    def buffer(self, name: str) -> Buffer | None:
        return self.ctx.buffer(name)

    def error(self, mark: Mark, code: str, message: str, hint: str | None = None) -> None:
        self.ctx.error(mark, code, message, hint=hint)

    def dim(self, ref: Ref, rank: int) -> int | None:
        return _dim(self.ctx, self.step, ref, rank)

    def expect(self, ref: Ref, want: list[ex.Expr], why: str) -> None:
        _expect(self.ctx, self.step, ref, want, why)

    def part(self, ref: Ref) -> list[ex.Expr] | None:
        return _part(self.ctx, self.step, ref)

    def part_along(self, ref: Ref, dim: int) -> list[ex.Expr] | None:
        return _part(self.ctx, self.step, ref, dim)

    def same_dtype(self, src: Ref, dst: Ref) -> None:
        _same_dtype(self.ctx, self.step, src, dst)

    def transfer(self, src: Ref, dst: Ref, *, symmetric: bool) -> None:
        _transfer(self.ctx, self.step, src, dst, symmetric=symmetric)

    def pairs(self, srcs: list[Ref], dsts: list[Ref]) -> list[tuple[Ref, Ref]]:
        return _pairs(self.ctx, self.step, srcs, dsts)

    def scatter(self, src: Ref, recv: Ref) -> list[ex.Expr] | None:
        return _scatter(self.ctx, self.step, src, recv)

    def merge(self, o: Ref, lse: Ref, *, stacked: bool) -> None:
        _merge(self.ctx, self.step, o, lse, stacked=stacked)


# One verifier per op that names buffers, read from the op registry (dcpc/ops/).
RULES: dict[str, Callable[[Verify, Step], None]] = {
    name: op.verify for name, op in OPS.items() if op.verify is not None
}


def check_ops(ctx: Context) -> None:
    """Run every op's verifier, in step order."""
    for step in ctx.steps:
        rule = RULES.get(step.kind)
        if rule is not None:
            _no_aliasing(ctx, step)
            rule(Verify(ctx, step), step)
            _output_scale(ctx, step)
