"""Deterministic call inputs and synthetic external steps, from seeds.

Every rank and the float64 simulator derive the same values from ``(seed, call)``:
sizes per call (each from 1 to its maximum), ``seq_lens`` short enough that
some ranks hold an empty KV shard, ``query_start_loc`` over the masked merge's rows
(``mask_rows``: ``T``, ``B*T``, ...) leaving CUDA-graph padding rows, and per-rank
engine inputs. The synthetic "attention" depends on what it reads (so a wrong gather
shows in the merged output) and writes NaN/inf garbage into the partials of empty
shards and padding rows, as a real kernel may.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from dcpc.harness.simulate import (
    UNSENT_INT,
    Buffers,
    as_stored,
    buffer_shape,
    empty_rows,
    float_bits,
    float_value,
    local_seq_len,
    named_rows,
    signed_view,
)
from dcpc.lang import expr as ex
from dcpc.lang import model as m
from dcpc.numerics import FP8_E4M3_MAX, FP8_FORMATS
from dcpc.ops import OPS, cast
from dcpc.ops.external import External
from dcpc.ops.iface import Requests, RowIndex, TensorScale, Unsent
from dcpc.ops.ragged_all_to_all import round_trip
from dcpc.ops.registry import carries, input_rules, is_move, names, placed
from dcpc.ops.registry import count_capacities as capacities_of

SMALL_MAX = {"T": 8, "B": 4, "N": 16}  # per-call maxima the harness lowers to
DEFAULT_SMALL_MAX = 8


O_GARBAGE = (math.nan, math.inf, -math.inf, 3.0e4)
LSE_GARBAGE = (math.nan, math.inf, -math.inf, 25.0)


def op_io(op: Any) -> tuple[list[str], list[str]]:
    """(buffers a step reads, buffers it writes), in the order the step names them
    (each op's ``OpDef.io``, dcpc/ops/)."""
    return OPS[op.op].io(op)


def engine_inputs(schedule: m.Schedule) -> list[str]:
    """Non-symmetric buffers read before any step writes them: the engine passes them
    (not a persistent one: it holds what the previous call left)."""
    written: set[str] = set()
    found: list[str] = []
    for step in schedule.step_list():
        reads, writes = op_io(step.op)
        for name in reads:
            if name not in written and name not in found:
                found.append(name)
        for name in writes:  # a slice of a buffer used whole too writes part of it
            part = schedule.slice_of(name)
            written.update([name, *schedule.cells(name), *(part[:1] if part else ())])
    return [n for n in found if not schedule.buffers[n].is_symmetric
            and not schedule.buffers[n].persist]  # the module's: the previous call's


def unsent_outputs(steps: list[m.Step]) -> set[str]:
    """The buffers whose unsent elements ``compare`` skips: those an op's
    ``OpDef.outputs`` gives the ``Unsent`` rule (a ragged exchange's rows past a count)."""
    return {name for s in steps if (rules := OPS[s.kind].outputs) is not None
            for name, rule in rules(s.op).items() if isinstance(rule, Unsent)}


def _request_mask(schedule: m.Schedule) -> tuple[m.Step, Requests] | None:
    """The request mask and the step that reads it: the first step's that reads one."""
    for step, rules in zip(schedule.step_list(), input_rules(schedule), strict=True):
        for rule in rules.values():
            if isinstance(rule, Requests):
                return step, rule
    return None


def mask_team(schedule: m.Schedule, world: int) -> tuple[int, Callable[[int], int]]:
    """The team the request mask's KV is sharded over: the team of the step that reads
    the mask (its ``axis:``; every rank without one): its size G and each rank's index
    in it (``local_seq_lens`` is [B, G], member i's lengths in column i)."""
    from dcpc.lang.mesh import mesh_of
    from dcpc.topology import shape_of, torus

    found = _request_mask(schedule) if schedule.mesh else None
    if found is None:
        return int(world), lambda rank: rank
    axes, ranks = mesh_of(schedule).team_axes(found[0].op), torus(shape_of(world))
    return ranks.team_size(axes), partial(ranks.member, axes=axes)


def mask_of(schedule: m.Schedule) -> m.MaskEmpty | None:
    found = _request_mask(schedule)
    return found[1].mask if found is not None else None


def mesh_sizes(schedule: m.Schedule, world: int) -> dict[str, int]:
    """The sizes of a mesh's axes at group size ``world`` (a mesh shape)."""
    from dcpc.lang.mesh import mesh_of, shape_of

    if not schedule.mesh:
        return {}
    shape = shape_of(world)
    return {name: shape[axis] for name, axis in mesh_of(schedule).size_names().items()}


def mask_rows(schedule: m.Schedule, sizes: Mapping[str, int]) -> int | None:
    """The rows ``query_start_loc`` indexes in one call: the leading dim of the masked
    merge's ``dst`` (``T``, ``B*T`` for MTP, ``N``, whatever the schedule calls it)."""
    found = _request_mask(schedule)
    return buffer_shape(schedule, found[1].rows, sizes)[0] if found is not None else None


def runtime_sizes(schedule: m.Schedule) -> list[str]:
    """The sizes bound per call (``max`` only), which a method may take as ``sizes=``."""
    axes = set(schedule.mesh.values()) if schedule.mesh else set()
    return [name for name, spec in schedule.sizes.items()
            if isinstance(spec, m.SizeSpec) and spec.max is not None and spec.multiple_of is None
            and name not in axes]


def constructor_sizes(schedule: m.Schedule, world: int,
                      given: Mapping[str, int] | None = None) -> dict[str, int]:
    """``sizes=`` for the generated constructor: small maxima, smallest-but-one multiples;
    a mesh's axis sizes from the mesh shape ``world`` (dcpc.lang.mesh); ``given``
    (``dcpc run --sizes``, validated by the module's constructor) replaces them."""
    out: dict[str, int] = mesh_sizes(schedule, world)
    for name, spec in schedule.sizes.items():
        if isinstance(spec, int) or name in out:
            continue
        if spec.multiple_of is not None:
            out[name] = 2 * ex.evaluate(ex.parse(spec.multiple_of),
                                        {**mesh_sizes(schedule, world), "W": world})
        elif spec.max is not None:
            out[name] = min(spec.max, SMALL_MAX.get(name, DEFAULT_SMALL_MAX))
    out.update({k: v for k, v in (given or {}).items() if k in out})
    return out


def call_sizes(
    schedule: m.Schedule, world: int, ctor: Mapping[str, int], seed: int, call: int
) -> dict[str, int]:
    """Every size bound for one call; call 0 uses the maxima, call 1 the minima."""
    rng = random.Random(f"sizes/{seed}/{call}")
    out: dict[str, int] = {"W": int(world), **mesh_sizes(schedule, world)}
    for name, spec in schedule.sizes.items():
        if name in out:
            continue  # a mesh axis' size
        if isinstance(spec, int):
            out[name] = spec
        elif spec.multiple_of is not None:
            out[name] = ctor[name]
        else:
            cap = ctor[name]
            out[name] = cap if call == 0 else 1 if call == 1 else rng.randint(1, cap)
    return out


def _requests(rng: random.Random, tokens: int, requests: int, world: int, inter: int) -> Buffers:
    short = world * inter  # shorter than this: some ranks hold no KV of the request
    seq_lens = [rng.randint(1, short - 1) if rng.random() < 0.5 else rng.randint(short, 64)
                for _ in range(requests)]
    real = tokens if rng.random() < 0.6 else rng.randint(0, tokens)  # the rest is padding
    cuts = sorted(rng.randint(0, real) for _ in range(requests - 1))
    return {
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int64),
        "query_start_loc": torch.tensor([0, *cuts, real], dtype=torch.int64),
    }


def call_inputs(
    schedule: m.Schedule, world: int, sizes: Mapping[str, int], seed: int, call: int
) -> list[Buffers]:
    """Every rank's engine inputs for one call (float64/int64, rounded to dtype)."""
    rng = random.Random(f"inputs/{seed}/{call}")
    mask = mask_of(schedule)
    shared: Buffers = {}
    if mask is not None:
        requests = buffer_shape(schedule, mask.lengths, sizes)[0]
        rows = mask_rows(schedule, sizes)
        assert rows is not None
        members, _ = mask_team(schedule, world)  # the team's size G (W: every axis)
        req = _requests(rng, rows, requests, members, mask.interleave)
        lengths = req["seq_lens"]
        if mask.local_seq_lens is not None:  # every member's own lengths [B, G] (interleave 1)
            lengths = torch.stack([local_seq_len(lengths, p, members, 1)
                                   for p in range(members)], 1)
        shared = {mask.lengths: lengths, mask.query_start_loc: req["query_start_loc"]}
    scales, fp8, floats = output_scales(schedule), payload_fp8(schedule), payload_floats(schedule)
    known = IntRules(schedule, sizes)
    inputs = engine_inputs(schedule)
    out: list[Buffers] = []
    order = drawn_first(inputs, known.named, schedule)
    bounding = {other for ends in known.named.values() for other in ends.values()}
    for rank in range(world):
        bufs: Buffers = {}
        for index, name in order:
            if name in shared:
                bufs[name] = shared[name].clone()
                continue
            part = schedule.slice_of(name) if name in bounding else None
            if part is not None and part[0] in bufs:  # one memory: the whole's view
                bufs[name] = schedule.view(part[0], bufs[part[0]], part[1]).clone()
                continue
            gen = torch.Generator().manual_seed(_mix(seed, call, rank, index))
            shape = buffer_shape(schedule, name, sizes)
            if name in scales:  # an fp8 output's scale: positive, and overflows some values
                value = scale_value(shape, gen, scales[name])
            elif name in fp8:  # a moved fp8 payload: every byte, NaNs and -0 included
                value = full_range_fp8(shape, gen, schedule.buffers[name].dtype)
            elif name in floats:  # a moved bf16/f16/f32 payload: NaNs, -0, inf among values
                value = with_edges(shape, gen, schedule.buffers[name].dtype)
            elif schedule.buffers[name].dtype.is_float:
                value = torch.randn(shape, generator=gen, dtype=torch.float64)
            else:
                value = int_value(schedule, name, sizes, bufs, gen, (call, rank, world),
                                  known)
            bufs[name] = as_stored(schedule, name, value)
        for whole in schedule.slices:  # an input used whole and by slice: one memory
            views = schedule.cells(whole)
            if whole in bufs:
                bufs.update({v: schedule.view(whole, bufs[whole], k).clone()
                             for k, v in enumerate(views)
                             if v in bufs})
        out.append(bufs)
    return out


class IntRules:
    """What ``int_value`` reads of a schedule at one call's sizes: its integer buffers'
    ranges, integer payloads, count capacities and the ops' input rules. Made once per
    call (``call_inputs``, ``make_external``), not once per buffer and rank (that was
    most of the harness's host time in an engine step of deepep_normal)."""

    def __init__(self, schedule: m.Schedule, sizes: Mapping[str, int]) -> None:
        self.ranges = value_ranges(schedule, sizes)
        self.payloads = payload_ints(schedule)
        self.capacities = count_capacities(schedule, sizes)
        self.rules = input_rules(schedule)
        self.placements = placements(schedule, sizes)
        # ends of ``values`` that name a buffer (``max: n_send``), read elementwise
        self.named = {name: b.values.buffers(schedule.buffers)
                      for name, b in schedule.buffers.items()
                      if b.values is not None and b.values.buffers(schedule.buffers)}


def int_value(schedule: m.Schedule, name: str, sizes: Mapping[str, int], bufs: Buffers,
              gen: torch.Generator, where: tuple[int, int, int] = (0, 0, 1),
              known: IntRules | None = None) -> torch.Tensor:
    """An integer buffer's values within its range (``value_ranges``: what it declares,
    row counts in 0..capacity), its ends placed by ``where`` (call, rank, W: ``in_range``);
    else within what the ops that read it declare (``OpDef.inputs``, dcpc.ops.iface
    ``InputRule``): index rows that exist, some -1 (``RowIndex``); an integer payload
    (``payload_ints``) over its dtype's whole range, anything else 0..99. The same for an
    engine input and for what an engine step writes (an engine writes counts within
    their capacity, ids within their range). ``known``: the schedule's ``IntRules`` at
    ``sizes``, made once per call by the caller."""
    shape = buffer_shape(schedule, name, sizes)
    known = known or IntRules(schedule, sizes)
    bounds = known.ranges.get(name)
    cap = known.placements.get(name)
    if cap is not None:  # rows of a slot, each once (its declared range within)
        low, high = bounds if bounds is not None else (0, cap - 1)
        return distinct_rows(max(low, 0), min(high, cap - 1), cap, shape, gen)
    spec = schedule.buffers[name].values
    if bounds is not None and spec is not None and spec.distinct:  # no value twice
        return distinct_rows(*bounds, max(math.prod(shape), 1), shape, gen)
    named = known.named.get(name, {})
    if bounds is not None and any(other in bufs for other in named.values()):
        ends = [bufs[named[end]].to(torch.int64) if named.get(end) in bufs else bound
                for end, bound in zip(("min", "max"), bounds, strict=True)]
        return in_range_each(torch.as_tensor(ends[0]).clamp(min=bounds[0]),
                             torch.as_tensor(ends[1]).clamp(max=bounds[1]), shape, gen, *where)
    if bounds is not None:
        return in_range(*bounds, shape, gen, *where)
    if name in known.payloads:
        return full_range_ints(schedule.buffers[name].dtype, shape, gen)
    for rules in known.rules:  # the first step's that reads it as an index
        rule = rules.get(name)
        if isinstance(rule, RowIndex):
            return row_index(schedule, name, rule, sizes, bufs, known.capacities, gen)
    return torch.randint(0, 100, shape, generator=gen, dtype=torch.int64)


def payload_ints(schedule: m.Schedule) -> set[str]:
    """The integer buffers that travel as data (top-k expert ids beside the tokens)."""
    return {n for n in _payloads(schedule) if not schedule.buffers[n].dtype.is_float}


def payload_fp8(schedule: m.Schedule) -> set[str]:
    """The fp8 buffers that travel as data (tokens the caller quantised, DeepEP's normal
    dispatch): drawn over every byte (``full_range_fp8``), as they move bit for bit."""
    return {n for n in _payloads(schedule) if schedule.buffers[n].dtype in FP8_EDGES}


def payload_floats(schedule: m.Schedule) -> set[str]:
    """The bf16/f16/f32 buffers that travel as data (tokens, K/V blocks): drawn with their
    ``FLOAT_EDGES`` (``with_edges``), as they move bit for bit."""
    return {n for n in _payloads(schedule) if schedule.buffers[n].dtype in FLOAT_EDGES}


def _payloads(schedule: m.Schedule) -> set[str]:
    """The buffers that travel as data: the src of a move (``is_move``) that no op but a
    move (as its src) or an engine step reads, nor lands by a move in a buffer read for
    its value (counts, an index, lengths, a cast's or a reduction's operand). A buffer
    used whole and by slice is one memory: a value read of a slice marks the whole and
    its slices, and a value read of the whole its slices."""
    steps = schedule.step_list()
    moved: set[str] = set()
    valued: set[str] = set()  # read for its value by some op
    mask = mask_of(schedule)
    if mask is not None:
        valued.update(n for n in (mask.lengths, mask.query_start_loc) if n)
    for step in steps:
        carried = set(names(getattr(step.op, "src", None))) if is_move(step.op) \
            else set(op_io(step.op)[0]) if isinstance(step.op, m.External) else set()
        moved.update(carried if is_move(step.op) else ())
        valued.update(n for n in op_io(step.op)[0] if n not in carried)
        if is_move(step.op) and cast.direction(schedule, step.op):  # a cast reads its operand
            valued.update((cast.payload(step.op) or ("",))[:1])
    def one_memory(name: str) -> set[str]:  # a buffer used whole and by slice
        part = schedule.slice_of(name)
        whole = part[0] if part else name
        return {whole, *schedule.cells(whole)}

    valued = {n for v in valued for n in one_memory(v)}
    grown = True
    while grown:  # a move's src is read for its value where its dst is
        grown = False
        for step in steps:
            if not is_move(step.op):
                continue
            for src, dst in carries(step.op):
                if dst in valued and src not in valued:
                    valued.update(one_memory(src))
                    grown = True
    return moved - valued


def full_range_ints(dtype: m.DType, shape: tuple[int, ...], gen: torch.Generator
                    ) -> torch.Tensor:
    """Random integers (int64) over ``dtype``'s whole range, from its random bytes:
    negatives, and for i64 values past 2**53 that a float64 would round; never
    ``UNSENT_INT`` (the poison's value). The first elements are the range's edges."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    wide = {4: torch.int32, 8: torch.int64}[dtype.itemsize]
    value = raw.view(wide).reshape(shape).to(torch.int64)
    value = torch.where(value == UNSENT_INT, UNSENT_INT - 1, value)
    top = 2 ** (8 * dtype.itemsize - 1)
    edges = [-top, top - 1, 2**53 + 1, -(2**53 + 1)] if top > 2**53 else [-top, top - 1]
    flat = value.reshape(-1)
    count = min(len(edges), flat.numel())
    flat[:count] = torch.tensor(edges[:count], dtype=torch.int64)
    return flat.reshape(shape)


# the bytes every row of a moved fp8 payload carries, in this order from a random column
# on (wrapping): what a move that converts, or a comparison by value, would lose (a NaN's
# sign, a zero's, an inf's), and the ends of the range: NaN, -NaN, -0, 0, +-the largest
# finite value, +-the smallest subnormal; e5m2 also +-inf and its largest subnormal
FP8_EDGES = {
    m.DType.fp8e4m3: (0x7F, 0xFF, 0x80, 0x00, 0x7E, 0xFE, 0x01, 0x81),  # +-448
    m.DType.fp8e5m2: (0x7F, 0xFF, 0x80, 0x00, 0x7B, 0xFB, 0x01, 0x81, 0x7C, 0xFC, 0x03,
                      0x83),  # +-57344, +-inf
}


def full_range_fp8(shape: tuple[int, ...], gen: torch.Generator,
                   dtype: m.DType = m.DType.fp8e4m3) -> torch.Tensor:
    """Random fp8 values of ``dtype`` (float64) over every byte, NaN of both signs and -0
    included; every row (the last dim) carries its ``FP8_EDGES`` in a run of columns from
    a random one on (wrapping), so that every row a ragged move sends carries them, and no
    column always holds 0xFF (the poison's byte: a store dropped there would pass). A
    NaN keeps its byte (``float_value``): e5m2's payloads 0x7D, 0x7E, 0xFD, 0xFE too."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    return float_value(_carry(raw, FP8_EDGES[dtype], gen), dtype.value)


# the bits every row of a moved bf16/f16/f32 payload carries among normal values (as
# ``FP8_EDGES``): NaNs with payloads and of both signs (a signalling one: bf16 0xFF81, f16
# 0xFC01, f32 0xFFA00000), -0, +-inf, +-the smallest subnormal, +-the largest finite value;
# never all ones (0xFFFF: the poison's bits, where a store dropped would pass)
FLOAT_EDGES = {
    m.DType.bf16: (0x7FC1, 0xFF81, 0xFFC0, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x7F7F,
                   0xFF7F),
    m.DType.f16: (0x7E01, 0xFC01, 0xFE00, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x7BFF,
                  0xFBFF),
    m.DType.f32: (0x7FC00001, 0xFFA00000, 0xFFC00000, 0x80000000, 0x7F800000, 0xFF800000,
                  0x00000001, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF),
}


def with_edges(shape: tuple[int, ...], gen: torch.Generator, dtype: m.DType) -> torch.Tensor:
    """Random normal values of ``dtype`` (float64, a NaN with its bits: ``float_value``),
    every row carrying its ``FLOAT_EDGES`` as ``full_range_fp8`` carries its bytes, in at
    most half its columns (a short row: some of them, a row of 2 one)."""
    raw = float_bits(torch.randn(shape, generator=gen, dtype=torch.float64), dtype.value)
    return float_value(_carry(raw, FLOAT_EDGES[dtype], gen, share=2), dtype.value)


def _carry(raw: torch.Tensor, bits: tuple[int, ...], gen: torch.Generator,
           share: int = 1) -> torch.Tensor:
    """``raw`` (a float's bits) with ``bits`` in every row (the last dim), in a run of
    columns from a random one on (wrapping): all of them where the row has room (at most
    1 / ``share`` of its columns), else a run of them from a random one on; an empty
    ``raw`` (a size 0 this call) as it is."""
    if raw.numel() == 0:
        return raw
    rows = raw.reshape(-1, raw.shape[-1] if raw.dim() else 1)
    count = min(len(bits), max(1, rows.shape[1] // share))
    width = 8 * raw.element_size()
    edges = torch.tensor([signed_view(b, width) if raw.is_signed() else b for b in bits],
                         dtype=raw.dtype)
    picked = torch.arange(count).expand(rows.shape[0], count)
    if count < len(bits):  # a short row: which edges, from a random one on
        picked = (picked + torch.randint(0, len(bits), (rows.shape[0], 1), generator=gen)
                  ) % len(bits)
    start = torch.randint(0, rows.shape[1], (rows.shape[0], 1), generator=gen)
    rows.scatter_(1, (start + torch.arange(count)) % rows.shape[1], edges[picked])
    return rows.reshape(raw.shape)


def value_ranges(schedule: m.Schedule, sizes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """The values of the integer buffers that have a range this call, both ends included:
    a buffer of row counts (``Counts``) 0..its capacity, within what the buffer declares
    (``values: {min, max}``, docs/language.md)."""
    found = {name: (0, cap) for name, cap in least_capacities(schedule, sizes).items()}
    later = []  # an end that names a buffer: that buffer's range, widest (``in_range_each``)
    for name, buffer in schedule.buffers.items():
        if buffer.values is not None and buffer.values.buffers(schedule.buffers):
            later.append((name, buffer.values))
        elif buffer.values is not None:
            low, high = (ex.evaluate(ex.parse(end), {**sizes})
                         for end in (buffer.values.min, buffer.values.max))
            rule = found.get(name, (low, high))
            found[name] = (max(low, rule[0]), min(high, rule[1]))
    for name, spec in later:  # the checker: a named buffer's range is size expressions
        named = spec.buffers(schedule.buffers)
        low, high = (found[named[end]][i] if end in named
                     else ex.evaluate(ex.parse(getattr(spec, end)), {**sizes})
                     for i, end in enumerate(("min", "max")))
        rule = found.get(name, (low, high))
        found[name] = (max(low, rule[0]), min(high, rule[1]))
    return found


def drawn_first(inputs: list[str], named: Mapping[str, Mapping[str, str]],
                schedule: m.Schedule | None = None) -> list[tuple[int, str]]:
    """(index, name) of the engine inputs in the order ``call_inputs`` draws them: a
    buffer that ends of ``values`` name (``named``: ``IntRules.named``) before the buffer
    it bounds (the checker allows no chain: one level), and before it the whole buffer it
    is a slice of (used whole and by slice: one memory, the slice the whole's view,
    taken before the bounded buffer is drawn against it), each keeping its index (its
    seed: the draws of the others are unchanged)."""
    bounding = {other for ends in named.values() for other in ends.values()}
    wholes = {part[0] for part in map(schedule.slice_of, bounding) if part is not None} \
        if schedule is not None else set()
    order = list(enumerate(inputs))
    return [*(p for p in order if p[1] in wholes),
            *(p for p in order if p[1] in bounding - wholes),
            *(p for p in order if p[1] not in bounding | wholes)]


def uniform(low: int, high: int, shape: tuple[int, ...], gen: torch.Generator
            ) -> torch.Tensor:
    """Integers (int64) uniform in ``low..high``, both ends included: the one draw of
    ``in_range`` and ``in_range_each``, exact over the whole i64 range (Python ints)."""
    # drawn in (low - 1, high], plus 1: high + 1 would overflow at the largest i64
    return torch.randint(low - 1, high, shape, generator=gen, dtype=torch.int64) + 1


def in_range(low: int, high: int, shape: tuple[int, ...], gen: torch.Generator,
             call: int = 0, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Random integers (int64) in ``low..high``, both ends included, each end in some
    calls of a run and values between in others: in an even call the low end on rank
    (call / 2) % W, the high end on the next rank (at a random element; one of them, at
    random, on a rank with both and one element), the rest anywhere in the range; in an
    odd call none at the low end (``low + 1..high``, where the range has room). Row
    counts so come empty and full, partly filled, and in odd calls none empty (every
    peer gets rows)."""
    floor = low + 1 if call % 2 and high > low else low
    value = uniform(floor, high, shape, gen)
    lead = (call // 2) % max(world, 1)
    ends = [end for end, on in ((low, lead), (high, (lead + 1) % max(world, 1)))
            if on == rank and not call % 2]
    flat = value.reshape(-1)
    picked = torch.tensor(ends, dtype=torch.int64)[torch.randperm(len(ends), generator=gen)]
    spots = torch.randperm(flat.numel(), generator=gen)[:len(ends)]
    flat[spots] = picked[: len(spots)]
    return flat.reshape(shape)


def in_range_each(low: torch.Tensor, high: torch.Tensor, shape: tuple[int, ...],
                  gen: torch.Generator, call: int = 0, rank: int = 0, world: int = 1
                  ) -> torch.Tensor:
    """``in_range`` with ends per element: ``low`` and ``high`` int64 tensors of the
    leading dims of ``shape`` (or scalars), broadcast over the rest (``values: {min: 0,
    max: n_send}``: n_send [P, N] bounds n_send_gpu [P, N, G]); each element uniform in
    its ``low..high``, both ends included, placed as ``in_range`` places them: in an even
    call a random element at its low end on rank (call / 2) % W and one at its high end
    on the next rank (each an element whose range has room, if any); in an odd call none
    at the low end where the element's range has room. The checker keeps every element's range
    nonempty (dcpc.check.names ``_bound_buffers``)."""
    def spread(end: torch.Tensor) -> torch.Tensor:
        end = end.to(torch.int64)
        return end.reshape(*end.shape, *[1] * (len(shape) - end.dim())).expand(shape)

    low, high = spread(low), spread(high)
    floor = low + ((high > low) & bool(call % 2)).to(torch.int64)
    flat, lows, highs = torch.zeros(math.prod(shape), dtype=torch.int64), \
        low.reshape(-1), high.reshape(-1)
    if flat.numel():  # ``uniform`` once per distinct range, in the ranges' order
        ranges, which = torch.unique(torch.stack([floor.reshape(-1), highs], 1), dim=0,
                                     return_inverse=True)
        for k, (bottom, top) in enumerate(ranges.tolist()):
            spots = (which == k).nonzero().reshape(-1)
            flat[spots] = uniform(bottom, top, (spots.numel(),), gen)
    lead = (call // 2) % max(world, 1)
    if not call % 2 and flat.numel():
        for end, on in ((lows, lead), (highs, (lead + 1) % max(world, 1))):
            if on != rank:
                continue
            room = (highs > lows).nonzero().reshape(-1)
            pool = room if room.numel() else torch.arange(flat.numel())
            spot = pool[torch.randint(0, pool.numel(), (1,), generator=gen)]
            flat[spot] = end[spot]
    return flat.reshape(shape)


def placements(schedule: m.Schedule, sizes: Mapping[str, int]) -> dict[str, int]:
    """The integer buffers drawn as a ragged move's ``index`` (``Placement``), each with
    its slot's capacity this call: the index itself, and a move's src that lands in it
    (DeepEP's token indices, sent by the dispatch, placing the combine's rows)."""
    return {name: ex.evaluate(ex.parse(cap), {**sizes}) for name, cap in placed(schedule).items()}


def distinct_rows(low: int, high: int, cap: int, shape: tuple[int, ...],
                  gen: torch.Generator) -> torch.Tensor:
    """Rows of slots of ``cap`` values (``shape`` flattened): each slot distinct values of
    ``low..high`` (a random choice, in random order), as many as the range holds; a slot
    past them repeats its first ones (a range narrower than a slot: then only that many
    rows of it can be live without a race)."""
    flat = torch.empty(math.prod(shape), dtype=torch.int64)
    span = torch.arange(low, high + 1, dtype=torch.int64)
    for start in range(0, flat.numel(), cap):
        pick = span[torch.randperm(len(span), generator=gen)][:cap]
        part = flat[start:start + cap]
        part.copy_(pick.repeat(-(-len(part) // max(len(pick), 1)))[: len(part)])
    return flat.reshape(shape)


def count_capacities(schedule: m.Schedule, sizes: Mapping[str, int]) -> dict[str, list[int]]:
    """The buffers of row counts (``Counts``), each with its capacities this call, one per
    step that reads it so, in step order (dcpc.ops.registry ``count_capacities``). A count
    is drawn within the least of them (``least_capacities``, ``value_ranges``): every step
    that reads it takes it (above a step's capacity its simulation and its kernel refuse
    the call)."""
    env = {**sizes}
    return {name: [ex.evaluate(ex.parse(cap), env) for cap in caps]
            for name, caps in capacities_of(schedule).items()}


def least_capacities(schedule: m.Schedule, sizes: Mapping[str, int]) -> dict[str, int]:
    """Each count's bound this call: the least capacity of the steps that read it, where
    a buffer used whole and by slice (``Schedule.slice_of``: ``n`` and ``n[c]``, one
    memory) counts the capacities of the whole and of every slice for each of them (the
    whole too where only its slices are read as counts)."""
    caps = count_capacities(schedule, sizes)
    memory = {name: (schedule.slice_of(name) or (name, 0))[0] for name in caps}
    least: dict[str, int] = {}
    for name, values in caps.items():
        least[memory[name]] = min(values + [least.get(memory[name], min(values))])
    return least | {name: least[memory[name]] for name in caps}  # the whole's too


def row_index(schedule: m.Schedule, name: str, rule: RowIndex, sizes: Mapping[str, int],
              bufs: Buffers, capacities: Mapping[str, list[int]],
              gen: torch.Generator) -> torch.Tensor:
    """The index ``name`` [T, K] into the rows of ``rule.rows`` (x): distinct rows per
    token where it can, a quarter of the slots empty (-1). x [W, capacity, H] (or
    [W, G*capacity, H] with counts [W, G]: slots of a grouped ragged move) on a rank whose
    counts of that capacity the engine passes: only the rows those counts make live (rows
    ``[0, counts[j])`` of slot j, counts this rank's own: the MoE round trip, a ragged
    move's return trip), never a row past a count. Of several such counts, those of the
    index's own slice first (``tok_slot[k]``, unrolled to ``tok_slot_<k>``: chunk k's
    index picks rows of chunk k's counts, also where x is the slot ``z_back[k % R]`` of a
    ring: DeepEP normal mode, schedules/gallery), else of x's slice. An x whose rows come
    back placed by an index this rank sent (dcpc.ops.ragged_all_to_all ``round_trip``:
    DeepEP's low-latency combine, each row at its token's index): only the rows placed
    here, ``s * capacity + sent[s, i]`` for i < counts[s] of each slot s."""
    *lead, topk = buffer_shape(schedule, name, sizes)  # [*T, K]
    tokens = math.prod(lead)
    x_shape = buffer_shape(schedule, rule.rows, sizes)
    rows = torch.arange(math.prod(x_shape[:-1]))
    trip = round_trip(schedule, rule.rows)
    if trip is not None and trip[0] in bufs and trip[1] in bufs:
        # placed rows back home: slot s holds rows sent[s, i] for i < counts[s]
        sent, counts, cap = trip
        at = bufs[sent].to(torch.int64).reshape(-1)
        live = bufs[counts].to(torch.int64).reshape(-1)
        size = ex.evaluate(ex.parse(cap), {**sizes})
        rows = torch.cat([s * size + at[s * size: s * size + int(n)]
                          for s, n in enumerate(live)])
        return _pick_rows(rows, tokens, topk, lead, gen)
    chunk = _slice_index(name) or _slice_index(rule.rows)
    ordered = sorted(capacities.items(), key=lambda item: chunk is not None
                     and _slice_index(item[0]) != chunk)
    for counts, caps in ordered:
        # a slot of cap rows per count: [W, cap] blocks, or a grouped ragged's [W, G*cap]
        # with counts [W, G] (flat slot j * G + g); of a count's capacities, x's
        live = bufs[counts].to(torch.int64).reshape(-1) if counts in bufs else None
        cap = next((c for c in caps if live is not None and len(x_shape) == 3
                    and x_shape[0] * x_shape[1] == live.numel() * c), None)
        if cap is not None:
            rows = torch.cat([j * cap + torch.arange(int(n)) for j, n in enumerate(live)])
            break
    return _pick_rows(rows, tokens, topk, lead, gen)


def _pick_rows(rows: torch.Tensor, tokens: int, topk: int, lead: list[int],
               gen: torch.Generator) -> torch.Tensor:
    """``row_index``'s draw: distinct rows among ``rows`` per token, a quarter empty."""
    out = torch.full((tokens, topk), -1, dtype=torch.int64)
    for t in range(tokens):
        pick = rows[torch.randperm(len(rows), generator=gen)[:topk]]
        out[t, : len(pick)] = pick
    empty = torch.rand(tokens, topk, generator=gen) < 0.25
    return torch.where(empty, -1, out).reshape(*lead, topk)


def _slice_index(name: str) -> str | None:
    """k of a slice's unrolled name ``b_<k>`` (dcpc.lang.loops), else None."""
    head, _, tail = name.rpartition("_")
    return tail if head and tail.isdigit() else None


def _mix(*parts: int) -> int:
    value = 0x9E3779B9
    for p in parts:
        value = (value * 1_000_003 + int(p) + 1) % (2**61 - 1)
    return value


def output_scales(schedule: m.Schedule) -> dict[str, float]:
    """The per-tensor fp8 scales (``TensorScale``): every ``output_scale``, and every
    cast's ``per: tensor`` scale buffer (a per-token one is the move's own output), each
    with the largest finite value of the fp8 it scales (dcpc.numerics.FP8_FORMATS)."""
    tops: dict[str, float] = {}
    for rules in input_rules(schedule):
        for name, rule in rules.items():
            if isinstance(rule, TensorScale):
                fp8 = [schedule.buffers[b].dtype.value for b in rule.between
                       if b in schedule.buffers and schedule.buffers[b].dtype.is_fp8]
                tops[name] = max([FP8_FORMATS[f][0] for f in fp8], default=FP8_E4M3_MAX)
    return tops


SCALE_LOW = 0.0015  # the smallest draw of scale_value for e4m3 (scaled by 448 / top)


def scale_value(shape: tuple[int, ...], gen: torch.Generator, top: float = FP8_E4M3_MAX
                ) -> torch.Tensor:
    """A per-tensor fp8 scale, whoever writes it (an engine input, an engine step): a
    positive normal (a scale that is not is refused), small enough that some values
    overflow +-``top`` (448 e4m3, 57344 e5m2) and saturate."""
    return (SCALE_LOW + 0.02 * torch.rand(shape, generator=gen, dtype=torch.float64)) * (
        FP8_E4M3_MAX / top)


def make_external(
    schedule: m.Schedule, world: int, sizes: Mapping[str, int], seed: int, call: int
) -> Any:
    """The harness's external steps for one call: ``fn(step, rank, bufs) -> writes``."""
    mask = mask_of(schedule)
    members, member = mask_team(schedule, world)  # the mask's KV shards: a team's members
    env = {**sizes, "W": world}
    masked = mask_rows(schedule, env)  # written rows of this count get garbage when masked
    scales = output_scales(schedule)
    # rows an op leaves unsent (NaN in the reference, stale in a run): what an engine
    # step writes is not derived from them
    unsent = unsent_outputs(schedule.step_list())
    known = IntRules(schedule, env)

    def external(step: m.Step, rank: int, bufs: Buffers) -> Buffers:
        op = step.op
        assert isinstance(op, External)
        # rows by values (``b[idx]``): a read sees those rows only, a write sets those rows
        # only (the others keep their values)
        picked = {n: named_rows(bufs[i]) for n, i in op.rows.items()}
        reads = [bufs[n][picked[n]] if n in picked else bufs[n] for n in op.reads
                 if schedule.buffers[n].dtype.is_float and n not in unsent]
        # a moved payload's NaN, inf (``with_edges``, ``full_range_fp8``) read as 0, +-1:
        # what the step computes stays finite where its rows are live
        x = torch.nan_to_num(reads[0].to(torch.float64), 0.0, 1.0, -1.0) if reads else None
        gen = torch.Generator().manual_seed(_mix(seed, call, rank, step.index))
        garbage = random.Random(_mix(seed, call, rank, step.index, 7))
        writes: Buffers = {}
        for name in op.writes:
            shape = buffer_shape(schedule, name, env)
            if name in picked:
                shape = (len(picked[name]), *shape[1:])
            three = x is not None and x.dim() == 3  # [T, H, D]-like: attention's input
            if not schedule.buffers[name].dtype.is_float:  # counts, indexes: in bounds
                # an index this step writes picks live rows of the counts it wrote first
                value = int_value(schedule, name, env, {**bufs, **writes}, gen,
                                  (call, rank, world), known)
                if name in picked:  # the named rows of its draw; the others keep theirs
                    whole = bufs[name].to(value.dtype).clone()
                    whole[picked[name]] = value[picked[name]]
                    value = whole
                writes[name] = value
                continue
            if three and len(shape) == 3 and tuple(x.shape[:2]) == shape[:2]:
                cols = (torch.arange(shape[2]) * 7 + rank) % x.shape[2]
                value = torch.tanh(x[:, :, cols] * (0.5 + 0.1 * rank) + 0.05 * rank)
            elif three and len(shape) == 2 and tuple(x.shape[:2]) == shape:
                value = 2.0 * torch.tanh(x[:, :, :8].sum(-1)) + 0.7 * rank
                value = value - 0.3 * (torch.arange(shape[0]) % 3).unsqueeze(1)
            elif x is not None and tuple(x.shape) == shape:  # same shape: depends on x too
                value = torch.tanh(x * (0.5 + 0.1 * rank) + 0.05 * rank)
            elif name in scales:  # a scale an engine step writes: as an input one
                value = scale_value(shape, gen, scales[name])
            else:
                value = torch.randn(shape, generator=gen, dtype=torch.float64)
            if mask is not None and len(shape) >= 2 and shape[0] == masked:
                # the partials of another rank's KV block (a ring hop's shard): its rows
                shard = rank if op.shard is None else op.shard
                rows = empty_rows(mask, bufs, member(shard), members, shape[0])
                pool = O_GARBAGE if len(shape) == 3 else LSE_GARBAGE
                for t in torch.nonzero(rows).flatten().tolist():
                    value[t] = garbage.choice(pool)
            if name in picked:  # the named rows of what the buffer held
                whole = bufs[name].to(torch.float64).clone()
                whole[picked[name]] = value
                value = whole
            writes[name] = value
        return writes

    return external
