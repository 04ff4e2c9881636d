"""A float64 simulator of one call of a schedule over all W ranks.

This is the harness's reference: it reads the schedule model (not the generated
code) and applies each op's float64 reference (``OpDef.reference``, dcpc/ops/) to
every rank's buffers at once. Every buffer write is rounded to the buffer's dtype,
as the generated module stores it; the merge math itself is float64. External steps
come from a callback.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch

from dcpc.lang import expr as ex
from dcpc.lang import model as m
from dcpc.lang import when as wh
from dcpc.lang.mesh import mesh_of, shape_of, torus
from dcpc.numerics import local_seq_len, quantize_fp8, reference_scale  # the facts, once
from dcpc.ops import OPS, shift
from dcpc.ops import _split as split
from dcpc.ops.external import External as ExternalOp
from dcpc.runtime.validate import DTYPES

TORCH_DTYPES = DTYPES  # each dtype of the language as torch stores it (one table)

Buffers = dict[str, torch.Tensor]  # one rank's buffers, float64 (or int64)
# What an integer buffer holds where nothing was written (rows past a ragged count): the
# poison's value (0xFF bytes, dcpc.runtime.heap.poison_), which no drawn integer payload
# takes (dcpc.harness.synth.payload_ints), as NaN marks them in a float buffer
UNSENT_INT = -1
# a trace entry's key for the elements of buffer NAME that its write left unsent: NAME + this
# ('@' is no name's character, as the stash's '@inflight')
UNSENT_KEY = "@unsent"
# a trace entry's key for the interval [lo, hi] (stacked, [2, *shape]) a kernel's fp8
# output_scale value of buffer NAME may take: NAME + this (``fp8_bounds``, ``bounds_at``)
BOUNDS_KEY = "@bounds"
# the 2**-24 units of a computed value's fp32 error beyond its n additions, times its
# magnitude (``fp32_error``, ``merge_error``): each product's own rounding (w_k * x_k), a
# merge's reciprocal 1 / S and the constant part of its exps' error, and a margin (the
# reviewer's emulation of the kernels' merge, CPU and GPU exp, used at most 0.57 of
# ``merge_error``); the operands are exact (inputs, or values stored in their dtype)
FP32_EXTRA_TERMS = 16
External = Callable[[m.Step, int, Buffers], Buffers]  # (step, rank, bufs) -> writes


def buffer_shape(schedule: m.Schedule, name: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(ex.evaluate(_dim(d), sizes) for d in schedule.buffers[name].shape)


@functools.lru_cache(maxsize=4096)
def named_rows(index: torch.Tensor) -> torch.Tensor:
    """Rows by values (``q[idx]``, docs/language.md): the rows of axis 0 that the values of
    the 1-d integer buffer ``index`` name, in its order, as torch's ``q[idx]`` indexes.
    The one rule: the synthetic step (dcpc.harness.synth ``make_external``) reads and
    writes these rows, the worker compares these rows of what an engine step reads."""
    return index.to(torch.int64).reshape(-1)


def _dim(text: str | int) -> ex.Expr:
    """A shape's dimension parsed once (a simulated call asks for shapes thousands of
    times; an expression is an immutable tuple)."""
    return ex.parse(text)


def alias_views(schedule: m.Schedule, bufs: MutableMapping[str, torch.Tensor], name: str,
                blank: Callable[[str], torch.Tensor]) -> list[str]:
    """After ``bufs[name]`` was written: a buffer used whole and by slice
    (``Schedule.slices``) and its slices hold one memory, so write the other side too
    (a slice into index k of the whole, ``blank(whole)`` where the whole is not held yet;
    the whole into each slice). Returns the names it wrote."""
    part = schedule.slice_of(name)
    if part is not None:
        whole, k = part
        value = (bufs[whole] if whole in bufs else blank(whole)).clone()
        schedule.view(whole, value, k).copy_(bufs[name].to(value.dtype))
        bufs[whole] = value
        return [whole]
    if name in schedule.slices:
        views = schedule.cells(name)
        for k, view in enumerate(views):
            bufs[view] = schedule.view(name, bufs[name], k).clone()
        return views
    return []


# How a kernel rounds an fp32 value it stores into bf16, by backend: Triton 3.6's CPU
# interpreter (backends host and local of the harness) truncates (toward zero); torch and
# compiled Triton on a GPU round to nearest even. f16 and fp8 round to nearest on all.
KERNEL_ROUNDING = {"host": "toward_zero", "local": "toward_zero", "torch": "nearest"}


def step_rounding(schedule: m.Schedule, backend: str | Mapping[str, str],
                  device: str = "cpu") -> str | Callable[[m.Step], str]:
    """How each step's stores round into bf16 on ``backend`` (one kind, or one per mesh
    axis: dcpc.runtime.axes runs a communicating step whose axes are all on torch as
    torch collectives, every other step as a kernel of the symmetric kind). On a GPU
    (``device`` cuda) every kernel is compiled: nearest even (KERNEL_ROUNDING is the
    CPU's; the GPU suite found 1-ulp differences with it, e.g. pull's bf16 sum)."""
    if not str(device).startswith("cpu"):
        return "nearest"
    if isinstance(backend, str):
        return KERNEL_ROUNDING.get(backend, "nearest")
    from dcpc.lang.mesh import mesh_of
    from dcpc.lang.semantics import semantics

    mesh = mesh_of(schedule)
    kernel = next((k for k in backend.values() if k != "torch"), "torch")

    def rounding(step: m.Step) -> str:
        sync = semantics(schedule, step).sync
        axes = mesh.team_axes(step.op)
        kinds = {backend.get(mesh.axes[a]) for a in (axes if axes is not None
                                                    else range(len(mesh.axes)))}
        communicates = sync.signal is not None or sync.wait is not None
        return KERNEL_ROUNDING.get("torch" if communicates and kinds == {"torch"} else kernel,
                                   "nearest")

    return rounding


def bf16_toward_zero(value: torch.Tensor) -> torch.Tensor:
    """fp32 ``value`` (float64 is rounded to fp32 first, as a kernel computes in fp32)
    truncated to bf16, as the interpreter stores it; NaN and inf stay."""
    f32 = value.to(torch.float32)
    bits = f32.view(torch.int32) & ~0xFFFF
    out = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero
    return torch.where(torch.isnan(f32), f32.to(torch.bfloat16), out)


def as_stored(schedule: m.Schedule, name: str, value: torch.Tensor,
              rounding: str = "nearest", *, computed: bool = False) -> torch.Tensor:
    """``value`` rounded to the buffer's dtype, back in float64 (int64 for integers);
    ``rounding``: how the kernel that stores it rounds into bf16 (``KERNEL_ROUNDING``);
    ``computed``: an op that computes stores it (its NaNs are plain: ``_untagged``)."""
    dtype = schedule.buffers[name].dtype
    if not dtype.is_float:
        return value.to(torch.int64)
    if computed:
        value = _untagged(value)
    return float_value(float_bits(value, dtype.value, rounding), dtype.value)


# A float NaN's bits kept in the float64 NaN that holds it (torch's conversions keep a
# NaN's sign only: e5m2's 0x7D, bf16's 0x7FC1 come back as 0x7F, 0x7FC0; an f32 signalling
# NaN comes back quiet), so that a move that changes a NaN's payload or sign mismatches:
# the float64 is a quiet NaN with the dtype's tag (``_NAN_TAG``) and the bits' low
# 8 x itemsize - 1 (the sign is the float64's own). Every float a buffer holds is made so
# (``as_stored``). float64 arithmetic keeps a NaN's payload (abs of a tagged NaN, divided
# by a scale, is still tagged), so what an op that computes stores drops the tag first
# (``_untagged``: a plain NaN with its sign); a NaN without this dtype's tag is stored as
# torch stores it (its sign kept, the payload canonical).
_NAN_QUIET, _NAN_MASK = 0x7FF8_0000_0000_0000, 0x7FFF_FFFF_8000_0000
_NAN_TAG = {dtype: _NAN_QUIET | (code << 32) for code, dtype in enumerate(
    ("fp8e4m3", "fp8e5m2", "bf16", "f16", "f32"), 1)}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # a float's bits, by itemsize


def signed_view(bits: Any, width: int) -> Any:
    """The value that the signed view (``BITS``: int16, int32) of ``width``-bit pattern
    ``bits`` (0 .. 2**width - 1: an int, or an int64 tensor) reads."""
    return bits - ((bits >> (width - 1)) & 1) * (1 << width)


def _untagged(value: torch.Tensor) -> torch.Tensor:
    """``value`` with each NaN made a plain quiet NaN of its sign (no payload, no tag)."""
    plain = torch.copysign(torch.full_like(value, math.nan), value)
    return torch.where(torch.isnan(value), plain, value)


def float_value(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float64 of float ``dtype``'s bits ``raw`` (``BITS``: uint8, int16, int32):
    the value, a NaN with its bits (tagged)."""
    width = 8 * TORCH_DTYPES[dtype].itemsize
    value = raw.view(TORCH_DTYPES[dtype]).to(torch.float64)
    nan = torch.isnan(value)
    if not bool(nan.any()):  # no NaN: the value is all (one pass over the tensor)
        return value
    bits = raw.to(torch.int64) & ((1 << width) - 1)
    sign = (bits >> (width - 1)) << 63
    tagged = (sign | _NAN_TAG[dtype] | (bits & ((1 << (width - 1)) - 1))).view(torch.float64)
    return torch.where(nan, tagged, value)


def float_bits(value: torch.Tensor, dtype: str, rounding: str = "nearest") -> torch.Tensor:
    """The bits (``BITS``) of float ``dtype`` that hold float64 ``value``
    (``float_value``'s inverse: a NaN tagged for ``dtype`` as its bits; anything else
    rounded as the kernel that stores it rounds: ``rounding``, ``KERNEL_ROUNDING``)."""
    value = value.to(torch.float64).contiguous()
    stored = (bf16_toward_zero(value) if rounding == "toward_zero" and dtype == "bf16"
              else value.to(TORCH_DTYPES[dtype]))
    width = 8 * stored.element_size()
    raw = stored.view(BITS[stored.element_size()])
    nan = torch.isnan(value)
    if not bool(nan.any()):  # no NaN, no tag: the rounded bits are all (one pass)
        return raw
    bits = value.view(torch.int64)
    tagged = nan & ((bits & _NAN_MASK) == _NAN_TAG[dtype])
    kept = ((bits < 0).to(torch.int64) << (width - 1)) | (bits & ((1 << (width - 1)) - 1))
    if raw.dtype != torch.uint8:
        kept = signed_view(kept, width)
    return torch.where(tagged, kept.to(raw.dtype), raw)


def empty_rows(
    mask: m.MaskEmpty, bufs: Buffers, rank: int, world: int, tokens: int
) -> torch.Tensor:
    """Bool [tokens]: rows whose partial from ``rank`` must not count (empty or padding)."""
    lengths = bufs[mask.lengths].to(torch.int64)
    qsl = bufs[mask.query_start_loc].to(torch.int64)
    rows = torch.arange(tokens)
    request = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)
    padding = rows >= qsl[-1]
    if mask.local_seq_lens is not None:  # [B, W]: every rank's own lengths
        local = lengths[:, rank]
    else:
        local = local_seq_len(lengths, rank, world, mask.interleave)
    if len(local) == 0:
        return torch.ones(tokens, dtype=torch.bool)
    empty = local[request.clamp(max=len(local) - 1)] == 0
    return padding | empty


def output_scale(op: Any, bufs: Buffers, rank: int | None) -> torch.Tensor | None:
    """The op's ``output_scale`` as the kernels read it (numerics.reference_scale: a
    scale that is no positive finite normal is refused, ValueError, as every backend
    does), or None without one."""
    name = getattr(op, "output_scale", None)
    if name is None:
        return None
    who = f"rank {rank}'s" if rank is not None else "the"
    return reference_scale(bufs[name], f"{who} output_scale '{name}'")


def scaled(op: Any, bufs: Buffers, value: torch.Tensor, rank: int | None, dtype: str
           ) -> torch.Tensor:
    """``output_scale``: value (as the kernels' fp32 accumulator) times fl32(1 / scale[0]),
    clamped to the range of fp8 ``dtype`` (dst's) and rounded to its grid by the kernels'
    rule (NaN stays, the sign of zero kept: numerics.quantize_fp8)."""
    s = output_scale(op, bufs, rank)
    return value if s is None else quantize_fp8(value, s, dtype).double()


def fp32_error(terms: int, magnitude: torch.Tensor | float) -> torch.Tensor:
    """A bound of how far an fp32 kernel's sum lies from the float64 one, before its
    output_scale, assuming its operands exact (each an input or a value stored in its
    dtype, which both sides read alike): a sum of ``terms`` products whose magnitudes add
    up to ``magnitude`` (sum_i |x_i| of a sum, sum_k |w_k x_k| of a weighted combine)
    is off by at most (terms + FP32_EXTRA_TERMS) * 2**-24 * magnitude, in any order of
    addition (0 terms: computed exactly, a max); cancellation leaves it whole (issue 33:
    W = 4's merge 0.1006 + 0.4618 - 0.5624 is 4.44e-8 in float64, 5.96e-8 in fp32). A
    merge's weights carry more error: ``merge_error``."""
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    return torch.as_tensor(magnitude, dtype=torch.float64) * (
        (terms + FP32_EXTRA_TERMS) * 2.0**-24)


def merge_error(weights: torch.Tensor, parts: torch.Tensor, only: int | None = None
                ) -> torch.Tensor:
    """A bound of how far an fp32 kernel's LSE merge lies from the float64 one, before
    its output_scale (the one rule of every merge: lse_combine, all_to_all_combine,
    all_reduce's ``reduce: lse``, lse_correct): sum_p w_p o_p over the P partials
    (``weights`` [P, ...], ``parts`` [P, ..., Dv]), or with ``only`` = r partial r's term
    w_r o_r alone (``parts`` its o_r [..., Dv]: lse_correct), is off by at most
    2**-24 * sum_p w_p |o_p| (P + FP32_EXTRA_TERMS + 3 |x_p|). The kernel's weight
    w_p = exp(x_p) * fl(1 / S), x_p = lse_p - max (in natural-log units, ln(w_max / w_p),
    whatever the LSE's base), carries the argument's rounding |x_p| 2**-24, the exp's own
    error (a GPU's ex2.approx about 2 + 1.16 |x_p| ulp after fl(x_p * log2 e)) and the
    sum S's (P - 1 additions, the exps'); an empty partial (w_p = 0) adds nothing."""
    w = weights.unsqueeze(-1)
    spread = torch.log(w.max(dim=0).values / w)  # x_p = max - lse_p, natural-log units
    if only is not None:
        w, spread = w[only], spread[only]
    size = torch.where(w == 0, 0.0, w * parts.abs() * (
        len(weights) + FP32_EXTRA_TERMS + 3 * spread))
    return 2.0**-24 * (size if only is not None else size.sum(dim=0))


def fp8_bounds(value: torch.Tensor, err: torch.Tensor, scale: torch.Tensor, dtype: str
               ) -> torch.Tensor:
    """[lo, hi] stacked: what the kernels' quantiser (numerics.quantize_fp8, monotone:
    fp32 rounding, fp32 multiply and fp8 rounding with saturation each keep order) gives
    for an fp32 value within ``err`` of ``value``: quantize(value - err) and
    quantize(value + err). A NaN value (or a non-finite err) leaves lo = hi =
    quantize(value): NaN only for NaN, an infinity saturated exactly."""
    err = torch.broadcast_to(torch.as_tensor(err, dtype=torch.float64), value.shape)
    exact = torch.isnan(value) | ~torch.isfinite(err)
    err = torch.where(exact, 0.0, err)
    lo = quantize_fp8(value - err, scale, dtype).double()
    hi = quantize_fp8(value + err, scale, dtype).double()
    return torch.stack([lo, hi])


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """NaN and +inf LSE count as -inf (weight 0)."""
    return torch.where(torch.isnan(lse) | (lse == math.inf), -math.inf, lse)


def merge_weights(lse: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """lse [W, ...] (cleaned) -> (weights [W, ...], merged LSE [...]) in float64."""
    exp, log = (torch.exp2, torch.log2) if base == "2" else (torch.exp, torch.log)
    top = lse.max(dim=0).values
    top = torch.where(top == -math.inf, 0.0, top)
    total = exp(lse - top).sum(dim=0)
    merged = top + log(total)  # log(0) = -inf when every partial is empty
    weights = torch.where(lse == -math.inf, 0.0, exp(lse - merged))
    return weights, merged


def _weighted_sum(weights: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """sum_p w_p * o_p where a zero weight contributes exactly 0 (even to NaN garbage)."""
    w = weights.unsqueeze(-1)
    return torch.where(w == 0, 0.0, w * parts).sum(dim=0)


def _lse_base(schedule: m.Schedule, op: Any, lse_name: str) -> str:
    return getattr(op, "lse_base", None) or schedule.buffers[lse_name].lse_base or "e"


def _mask_lse(
    op: Any, lse: torch.Tensor, bufs: Buffers, world: int, token_dim: int
) -> torch.Tensor:
    """lse [W, ...] with token axis ``token_dim`` (of the per-rank part): mask empties."""
    lse = _clean_lse(lse.clone())
    if op.mask_empty is None:
        return lse
    tokens = lse.shape[1 + token_dim]
    for p in range(world):
        rows = empty_rows(op.mask_empty, bufs, p, world, tokens)
        shape = [1] * (lse.dim() - 1)
        shape[token_dim] = tokens
        lse[p] = torch.where(rows.view(shape), -math.inf, lse[p])
    return lse


def _split(value: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    return list(torch.chunk(value, world, dim=dim))


class UnwrittenRead(ValueError):
    """The float64 reference of a step read a buffer that nothing of the call wrote on
    that rank and that is no input: a schedule the checker should have refused
    (read-before-write), named by step, buffer and rank instead of a bare KeyError."""

    def __init__(self, buffer: str, rank: int, step: str = ""):
        self.buffer, self.rank, self.step = buffer, rank, step
        at = f"step '{step}' " if step else ""
        super().__init__(
            f"the float64 reference of {at}reads '{buffer}' on rank {rank}, where no "
            "earlier step of the call wrote it and it is no input (a read-before-write "
            "the checker missed: please report it with the schedule)")


@contextmanager
def _naming(step: m.Step) -> Iterator[None]:
    """An ``UnwrittenRead`` raised inside (by a reference, or a chain's put reading its
    source) names ``step``."""
    try:
        yield
    except UnwrittenRead as err:
        raise UnwrittenRead(err.buffer, err.rank, err.step or step.name) from None


class _RankBuffers(dict):
    """One rank's buffers in the simulator: a read of one nothing wrote is an
    ``UnwrittenRead`` naming the buffer and the rank (``simulate_call`` adds the step)."""

    def __init__(self, items: Mapping[str, torch.Tensor], rank: int):
        super().__init__(items)
        self.rank = rank

    def __missing__(self, name: str) -> torch.Tensor:
        raise UnwrittenRead(name, self.rank)


class _Unsent(dict):
    """A skipped rank's buffers (``Sim.guarded``): what it holds reads as never written;
    a value no schedule buffer holds (``Sim.stash``: a put's data in flight) reads as
    kept in ``held``, the rank's own buffers (a wait skipped there leaves it unread)."""

    def __init__(self, sim: Sim, held: Buffers):
        super().__init__()
        self.sim, self.held = sim, held

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self.sim.schedule.buffers and name in self.held:
            return self.held[name]
        return self.sim.unsent(name)


class Sim:
    """One simulated call: every rank's buffers, and what an op's float64 reference
    (``OpDef.reference`` in dcpc/ops/) uses to read and write them."""

    def __init__(self, schedule: m.Schedule, world: int, env: Mapping[str, int],
                 inputs: list[Buffers], external: External):
        self.schedule, self.world, self.env, self.external = schedule, world, env, external
        self.bufs = [_RankBuffers(rank_inputs, r) for r, rank_inputs in enumerate(inputs)]
        # where ``stash`` keeps a value: each rank's buffers, also for a rank that skips
        # the step (``guarded``: a put's data held for the receiver's wait, which runs
        # where the sender's put does, as dcpc.check.when proved)
        self.held: list[Buffers] = self.bufs
        self.written: list[Buffers] = [{} for _ in range(world)]
        # per rank: what this call's writes of each buffer left unsent (None: nothing);
        # a buffer not in it was not written yet this call (``unsent_mask``)
        self.left: list[dict[str, torch.Tensor | None]] = [{} for _ in range(world)]
        self.rounding = "nearest"  # how the module's kernels store into bf16 (as_stored)
        self.computes = False  # the step computes what it stores (as_stored's computed)
        self.members: list[int] | None = None  # a team's view: its ranks (``team``)
        # (rank, dst) -> the fp8 bounds ``scaled`` made for the store that follows it
        self.pending: dict[tuple[int, str], torch.Tensor] = {}
        # per rank: the interval ([2, *shape], ``fp8_bounds``) of each value it holds that
        # an output_scale computed, or a move carried from one (``_moving``)
        self.bounds: list[Buffers] = [{} for _ in range(world)]

    def shape(self, name: str) -> tuple[int, ...]:
        return buffer_shape(self.schedule, name, self.env)

    def team(self, ranks: list[int]) -> Sim:
        """The same call seen by one team: member i is global rank ``ranks[i]`` and
        ``world`` is the team's size (what a team op's reference runs on); the buffers
        are the same objects, so its stores land in the global ranks' buffers."""
        sub = Sim.__new__(Sim)
        sub.schedule, sub.world, sub.env, sub.external = (
            self.schedule, len(ranks), self.env, self.external)
        sub.bufs = [self.bufs[r] for r in ranks]
        sub.held = [self.held[r] for r in ranks]
        sub.written = [self.written[r] for r in ranks]
        sub.left = [self.left[r] for r in ranks]
        sub.members = ranks  # what a table over ranks (a shift's perm) reads per team
        sub.rounding = self.rounding  # the step's kernels store as the whole call's do
        sub.computes = self.computes
        sub.pending, sub.bounds = {}, [self.bounds[r] for r in ranks]
        return sub

    def guarded(self, skipped: set[int]) -> Sim:
        """The same call for a step that does not run on the ranks ``skipped`` (its
        ``when:`` fails there): their buffers read as never written and take the
        step's stores into a throwaway copy, so they keep what they had."""
        sub = Sim.__new__(Sim)
        sub.schedule, sub.world, sub.env, sub.external = (
            self.schedule, self.world, self.env, self.external)
        sub.bufs = [_Unsent(self, self.held[r]) if r in skipped else self.bufs[r]
                    for r in range(int(self.world))]
        sub.held = self.held
        sub.written = [{} if r in skipped else self.written[r] for r in range(int(self.world))]
        sub.left = [{} if r in skipped else self.left[r] for r in range(int(self.world))]
        sub.rounding, sub.members, sub.computes = self.rounding, self.members, self.computes
        sub.pending = {}
        sub.bounds = [{} if r in skipped else self.bounds[r] for r in range(int(self.world))]
        return sub

    def side(self, k: int) -> Sim:
        """The same call with each value that has an interval (``bounds``) replaced by
        its bound ``k`` (0: lo, 1: hi; 2: NaN, a mark), on copies of the buffers: a move
        run on it carries the bounds (the mark) where it carries the values (``_moving``)."""
        sub = Sim.__new__(Sim)
        sub.schedule, sub.world, sub.env, sub.external = (
            self.schedule, self.world, self.env, self.external)
        def pick(b: torch.Tensor) -> torch.Tensor:
            return b[k] if k < 2 else torch.full_like(b[0], math.nan)

        sub.bufs = [_RankBuffers({n: pick(b[n]) if n in b else v for n, v in bufs.items()}, r)
                    for r, (bufs, b) in enumerate(zip(self.bufs, self.bounds, strict=True))]
        sub.held = sub.bufs
        sub.written = [{} for _ in range(int(self.world))]
        sub.left = [{} for _ in range(int(self.world))]
        sub.rounding, sub.members, sub.computes = self.rounding, self.members, self.computes
        sub.pending, sub.bounds = {}, [{} for _ in range(int(self.world))]
        return sub

    def store(self, rank: int, name: str, value: torch.Tensor, *,
              unsent: torch.Tensor | None = None, bounds: torch.Tensor | None = None) -> None:
        """Write ``name`` on ``rank``, rounded to its dtype as the module stores it.
        ``unsent``: the elements no rank sent (an op's ``Unsent`` output: ``value``
        holds ``unsent(name)`` there), kept beside the value in the trace (``unsent_at``)
        so that ``dcpc run`` skips exactly those, and compares a NaN a rank did send.
        ``bounds``: the value's interval (else the one ``scaled`` made for it, if any),
        kept beside it in the trace (``bounds_at``), the other side of a buffer used whole
        and by slice taking its part (``alias_views``)."""
        want = self.shape(name)
        if tuple(value.shape) != want:
            raise ValueError(f"simulator: {name} has shape {tuple(value.shape)}, want {want}")
        self.bufs[rank][name] = as_stored(self.schedule, name, value, self.rounding,
                                          computed=self.computes)
        self.written[rank][name] = self.bufs[rank][name]
        self.left[rank][name] = unsent
        if unsent is not None:
            self.written[rank][name + UNSENT_KEY] = unsent
        else:
            self.written[rank].pop(name + UNSENT_KEY, None)
        pending = self.pending.pop((rank, name), None)
        self._bound(rank, name, pending if bounds is None else bounds)
        views = alias_views(self.schedule, self.bufs[rank], name, self.unsent)
        held = self.bounds[rank]
        sides = [{n: held[n][k] if n in held else self.bufs[rank][n] for n in (name, *views)}
                 for k in (0, 1)] if any(n in held for n in (name, *views)) else None
        for side in sides or ():  # the views' bounds, as their values
            alias_views(self.schedule, side, name, self.bufs[rank].__getitem__)
        for other in views:
            self.written[rank][other] = self.bufs[rank][other]
            # a view of what was written whole (a ragged exchange's slot, its chunk
            # b[s][e]): the elements no rank sent are the view of the whole's; else
            # compared whole, as the trace has it
            part = self.schedule.slice_of(other) if name in self.schedule.slices else None
            cut = None if unsent is None or part is None else \
                self.schedule.view(name, unsent, part[1])
            self.left[rank][other] = cut
            if cut is not None:
                self.written[rank][other + UNSENT_KEY] = cut
            else:
                self.written[rank].pop(other + UNSENT_KEY, None)
            self._bound(rank, other, None if sides is None else torch.stack(
                [sides[0][other], sides[1][other]]))

    def _bound(self, rank: int, name: str, bounds: torch.Tensor | None) -> None:
        """``name``'s interval on ``rank`` (None: it has none), in the trace too where
        this step wrote it."""
        if bounds is None:
            self.bounds[rank].pop(name, None)
        else:
            self.bounds[rank][name] = bounds
        if name in self.written[rank]:
            if bounds is None:
                self.written[rank].pop(name + BOUNDS_KEY, None)
            else:
                self.written[rank][name + BOUNDS_KEY] = bounds

    def unsent_mask(self, rank: int, name: str) -> torch.Tensor:
        """The elements of ``name`` on ``rank`` that nothing wrote yet this call: all of
        it before its first store, else what the last store left unsent (``store``'s
        ``unsent``), never read off the values (a NaN can be sent)."""
        if name not in self.left[rank]:
            return torch.ones(self.shape(name), dtype=torch.bool)
        left = self.left[rank][name]
        return torch.zeros(self.shape(name), dtype=torch.bool) if left is None else left

    def unsent(self, name: str) -> torch.Tensor:
        """A value of ``name``'s shape that says "never written": NaN (float64) for a
        float buffer, ``UNSENT_INT`` (int64) for an integer one."""
        if self.schedule.buffers[name].dtype.is_float:
            return torch.full(self.shape(name), math.nan, dtype=torch.float64)
        return torch.full(self.shape(name), UNSENT_INT, dtype=torch.int64)

    def stash(self, rank: int, name: str, value: torch.Tensor, *, like: str) -> None:
        """Keep a value no schedule buffer holds (an implicit receive buffer), rounded to
        the dtype of buffer ``like``; not traced."""
        self.held[rank][name] = as_stored(self.schedule, like, value, self.rounding,
                                          computed=self.computes)
        if self.held is self.bufs:  # a value kept is a new one (``_moving`` carries)
            self.bounds[rank].pop(name, None)

    def all_to_all(self, src: str, dst: str, dim: int,
                   store: Callable[[int, str, torch.Tensor], None] | None = None) -> None:
        """dst[p] on rank j = part j (along ``dim``) of src on rank p."""
        _all_to_all(src, dst, dim, self.bufs, self.world, store or self.store)

    def merge_weights(self, op: Any, rank: int, lse_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The LSE weights [W, ...] and the merged LSE of ``rank``'s stacked LSEs
        ``lse_name``, masked by the op's ``mask_empty``, in the op's base."""
        bufs = self.bufs[rank]
        lse = _mask_lse(op, bufs[lse_name], bufs, self.world, token_dim=0)
        return merge_weights(lse, _lse_base(self.schedule, op, lse_name))

    def weighted_sum(self, weights: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        return _weighted_sum(weights, parts)

    def scaled(self, op: Any, rank: int, value: torch.Tensor, err: torch.Tensor
               ) -> torch.Tensor:
        """``scaled``, and for the store of dst that follows, the interval the kernel's
        value may take (``fp8_bounds``: within ``err`` of value, an absolute bound of the
        kernel's fp32 error: ``fp32_error``, ``merge_error``), kept beside it in the
        trace (``bounds_at``)."""
        dst = getattr(op, "dst", None)  # an output_scale's op has one dst (bad-output-scale)
        s = output_scale(op, self.bufs[rank], rank)
        if s is None:
            return value
        if not isinstance(dst, str):
            raise ValueError(f"output_scale of {type(op).__name__} without one dst: {dst!r}")
        dtype = self.schedule.buffers[dst].dtype.value
        self.pending[(rank, dst)] = fp8_bounds(value, err, s, dtype)
        return quantize_fp8(value, s, dtype).double()

    fp32_error = staticmethod(fp32_error)
    merge_error = staticmethod(merge_error)


def _teams(schedule: m.Schedule, world: int, step: m.Step) -> list[list[int] | None]:
    """The teams a step's reference runs on (dcpc.lang.mesh); [None]: every rank."""
    axes = mesh_of(schedule).team_axes(step.op)
    if axes is None:
        return [None]
    t = torus(shape_of(world))
    return [list(team) for team in sorted({tuple(t.team(r, axes)) for r in range(t.size)})]


def simulate_call(
    schedule: m.Schedule,
    world: int,
    sizes: Mapping[str, int],
    inputs: list[Buffers],
    external: External,
    trace: list[list[Buffers]] | None = None,
    rounding: str | Callable[[m.Step], str] = "nearest",
    progress: Callable[[m.Step], None] | None = None,
) -> list[Buffers]:
    """Run every step of one call on all ranks; return every rank's buffers at the end.

    Each step runs its op's float64 reference (``OpDef.reference``, dcpc/ops/). With
    ``trace`` (a list), one entry per step is appended: every rank's values of
    what the step wrote, as they stand right after it. A buffer written twice in a
    call has two entries, so each read can be compared with what it sees at its point.
    ``rounding``: how the backend's kernels store into bf16 (``KERNEL_ROUNDING``; per step
    on a mesh whose axes run on different backends: ``step_rounding``), so that
    a value moved after the step that rounded it is compared with the bits it has.
    ``progress``: called with each step before it runs (or the span of steps it opens):
    a long simulation says it is moving (dcpc.harness.worker ``CallSims``).
    """
    sim = Sim(schedule, world, {**sizes, "W": int(world)}, inputs, external)
    running = wh.running(schedule, world)  # the guarded steps' ranks (when:)
    steps = schedule.step_list()
    early = shift.spans(sim)
    done = -1  # the last step a chain below ran already
    for step in steps:
        if step.index <= done:
            continue
        if progress is not None:
            progress(step)
        _storing(sim, step, rounding)
        if trace is not None and step.index:
            trace.append(sim.written)
            sim.written = [{} for _ in range(world)]
        if step.index in early:
            written = _chain(sim, steps[step.index:early[step.index] + 1], running,
                             rounding)
            if trace is not None:
                trace.extend(written[:-1])
            sim.written, done = written[-1], early[step.index]
            continue
        op = OPS.get(step.kind)
        if op is None:
            raise NotImplementedError(f"simulator: op {step.kind} of step {step.name}")
        # a guarded step (when:, a local op): the ranks where its condition fails keep
        # what they had (its reference runs there on throwaway buffers)
        ranks = running.get(step.index)
        skipped = set() if ranks is None else set(range(int(world))) - ranks
        def run(on: Sim, step: m.Step = step, skipped: set[int] = skipped) -> None:
            view = on.guarded(skipped) if skipped else on
            for team in _teams(schedule, world, step):
                if skipped.issuperset(range(int(world)) if team is None else team):
                    continue  # a team (or the group) that skips it together: nothing moves
                OPS[step.kind].reference(view if team is None else view.team(team), step)

        with _naming(step):
            _moving(sim, step, run)
    if trace is not None:
        trace.append(sim.written)
    return sim.bufs


def _moving(sim: Sim, step: m.Step, run: Callable[[Sim], None]) -> None:
    """Run ``step`` (``run(sim)``), and where it moves a value that has an interval
    (an fp8 output_scale's, ``Sim.bounds``), carry the interval with it: run the step
    again on the values' lo and on their hi (``Sim.side``); a move puts them where it
    puts the value (it copies, gathers, slices or reshapes values, and a cast's scaling
    keeps their order), so what it wrote there is the moved value's interval. A value it
    wrote from values without one gets none: where a third run, on NaN in their place,
    wrote no NaN that the value does not hold."""
    reads, _ = OPS[step.kind].io(step.op)
    if not OPS[step.kind].moves(step.op) or not any(
            n in reads or n not in sim.schedule.buffers for b in sim.bounds for n in b):
        run(sim)  # computes (its output_scale bounds what it stores), or no interval moves
        return
    before = [dict(bufs) for bufs in sim.bufs]
    sides = []
    for k in (0, 1, 2):
        side = sim.side(k)
        run(side)
        sides.append(side.bufs)
    run(sim)
    for r, bufs in enumerate(sim.bufs):
        for name, value in bufs.items():
            if before[r].get(name) is value:
                continue  # not written by the step: keeps its interval
            lo, hi, mark = (side[r].get(name) for side in sides)
            carried = mark is not None and value.is_floating_point() and bool(
                (torch.isnan(mark) & ~torch.isnan(value)).any())
            sim._bound(r, name, torch.stack([lo, hi]) if carried else None)


def persistent_start(schedule: m.Schedule, world: int, sizes: Mapping[str, int],
                     previous: list[Buffers] | None) -> list[Buffers]:
    """Every rank's ``persist: true`` buffers at the start of a call: what ``previous``
    (the buffers at the end of the call before, as ``simulate_call`` returns them) holds,
    zeros at call 0 (``previous`` None)."""
    env = {**sizes, "W": int(world)}
    names = [n for n, b in schedule.buffers.items() if b.persist]
    if previous is not None:
        return [{n: bufs[n].clone() for n in names if n in bufs} for bufs in previous]
    return [{n: torch.zeros(buffer_shape(schedule, n, env), dtype=torch.float64
                            if schedule.buffers[n].dtype.is_float else torch.int64)
             for n in names} for _ in range(int(world))]


def unsent_at(trace: list[list[Buffers]], step: int, rank: int, name: str
              ) -> torch.Tensor | None:
    """The elements of what ``seen_at`` gives (the same write) that no rank sent, or
    None where that write sent every element."""
    return _beside(trace, step, rank, name, UNSENT_KEY)


def bounds_at(trace: list[list[Buffers]], step: int, rank: int, name: str
              ) -> torch.Tensor | None:
    """The [lo, hi] interval (``fp8_bounds``) of what ``seen_at`` gives (the same write)
    where an output_scale wrote it, else None."""
    return _beside(trace, step, rank, name, BOUNDS_KEY)


def _beside(trace: list[list[Buffers]], step: int, rank: int, name: str, key: str
            ) -> torch.Tensor | None:
    for entry in reversed(trace[:step]):
        if name in entry[rank]:
            return entry[rank].get(name + key)
    return None


def _storing(sim: Sim, step: m.Step, rounding: str | Callable[[m.Step], str]) -> None:
    """How ``step`` stores: its kernels' bf16 rounding, and whether it computes."""
    sim.rounding = _rounding(step, rounding)
    op = OPS.get(step.kind)
    sim.computes = op is not None and not op.moves(step.op)


def _rounding(step: m.Step, rounding: str | Callable[[m.Step], str]) -> str:
    # the engine's own steps store as torch does (the harness's synthetic ones do)
    if isinstance(step.op, ExternalOp):
        return "nearest"
    return rounding(step) if callable(rounding) else rounding


def _chain(sim: Sim, steps: list[m.Step], running: Mapping[int, set[int]],
           rounding: str | Callable[[m.Step], str]) -> list[list[Buffers]]:
    """A span that runs along chains (``shift.spans``: the waits written before their
    puts, the local steps between, the puts; the checker allows nothing else there), in
    dependency order, not in lock step: in the order its blocking semantics runs the
    ranks' steps (``shift.span_run``, one chain or several): a wait stores in its dst
    what its source pushed at the put it polls (run already), a put takes its src as it
    stands there, a local step runs on that rank alone.
    Returns what each step wrote, per rank (the trace's entries)."""
    world = int(sim.world)
    written: list[list[Buffers]] = [[{} for _ in range(world)] for _ in steps]
    # each wait from its own sources (along an axis, its team's); the ranks in the order
    # the span's blocking semantics runs them (the checker proved that none blocks)
    source = {s.name: shift.sources(sim.schedule, s.op, sim.world) for s in steps
              if split.half(s) == split.WAIT}
    pushed: dict[tuple[str, int], torch.Tensor] = {}  # (put, rank) -> its src as pushed
    carried: dict[tuple[str, int], torch.Tensor] = {}  # (put, rank) -> its src's interval
    events, _ = shift.span_run(sim, steps, sim.world, running)
    for r, k in events:
        step = steps[k]
        sim.written = written[k]
        _storing(sim, step, rounding)
        half = split.half(step)
        if half == split.PUT:
            with _naming(step):
                pushed[step.name, r] = as_stored(sim.schedule, step.op.dst,
                                                 sim.bufs[r][step.op.src],
                                                 sim.rounding).clone()
                if step.op.src in sim.bounds[r]:
                    carried[step.name, r] = sim.bounds[r][step.op.src]
        elif half == split.WAIT:
            if r in source[step.name]:
                put = split.matched(sim).polls[step.name]
                sim.store(r, step.op.dst, pushed[put.name, source[step.name][r]].clone(),
                          bounds=carried.get((put.name, source[step.name][r])))
        else:
            skipped = set(range(world)) - {r}
            with _naming(step):
                _moving(sim, step, lambda on, step=step, skipped=skipped:
                        OPS[step.kind].reference(on.guarded(skipped), step))
    return written


def seen_at(trace: list[list[Buffers]], step: int, rank: int, name: str) -> torch.Tensor | None:
    """What ``name`` holds on ``rank`` just before step ``step`` (its last write in the
    call so far), or None when no earlier step of the call wrote it."""
    for entry in reversed(trace[:step]):
        if name in entry[rank]:
            return entry[rank][name]
    return None


def _all_to_all(
    src: str, dst: str, dim: int, bufs: list[Buffers], world: int,
    store: Callable[[int, str, torch.Tensor], None],
) -> None:
    """dst[p] on rank j = part j (along ``dim``) of src on rank p."""
    parts = [_split(bufs[p][src], dim, world) for p in range(world)]
    for j in range(world):
        store(j, dst, torch.stack([parts[p][j] for p in range(world)]))
