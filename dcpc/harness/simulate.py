"""A float64 simulator of one call of a schedule over all W ranks.

This is the harness's reference: it reads the schedule model (not the generated
code) and applies the op semantics of docs/internals.md to every rank's buffers at
once. Every buffer write is rounded to the buffer's dtype, as the generated module
stores it; the merge math itself is float64. External steps come from a callback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dcpc.lang import expr as ex
from dcpc.lang import model as m
from dcpc.numerics import FP8_E4M3_MAX, local_seq_len  # the facts, defined once (no Triton)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
    "i32": torch.int32, "i64": torch.int64, "fp8e4m3": torch.float8_e4m3fn,
}

Buffers = dict[str, torch.Tensor]  # one rank's buffers, float64 (or int64)
External = Callable[[m.Step, int, Buffers], Buffers]  # (step, rank, bufs) -> writes


def buffer_shape(schedule: m.Schedule, name: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(ex.evaluate(ex.parse(d), sizes) for d in schedule.buffers[name].shape)


def as_stored(schedule: m.Schedule, name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` rounded to the buffer's dtype, back in float64 (int64 for integers)."""
    dtype = schedule.buffers[name].dtype
    if not dtype.is_float:
        return value.to(torch.int64)
    return value.to(TORCH_DTYPES[dtype.value]).to(torch.float64)


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


def scaled(op: Any, bufs: Buffers, value: torch.Tensor) -> torch.Tensor:
    """``output_scale``: value / scale[0], clamped to the fp8 e4m3 range (NaN stays)."""
    name = getattr(op, "output_scale", None)
    if name is None:
        return value
    y = value / bufs[name].reshape(-1)[0]
    return torch.where(torch.isnan(y), y, y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))


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


def simulate_call(
    schedule: m.Schedule,
    world: int,
    sizes: Mapping[str, int],
    inputs: list[Buffers],
    external: External,
    trace: list[list[Buffers]] | None = None,
) -> list[Buffers]:
    """Run every step of one call on all ranks; return every rank's buffers at the end.

    With ``trace`` (a list), one entry per step is appended: every rank's values of
    what the step wrote, as they stand right after it. A buffer written twice in a
    call has two entries, so each read can be compared with what it sees at its point.
    """
    env = {**sizes, "W": world}
    bufs = [dict(rank_inputs) for rank_inputs in inputs]
    written: list[Buffers] = [{} for _ in range(world)]

    def store(rank: int, name: str, value: torch.Tensor) -> None:
        want = buffer_shape(schedule, name, env)
        if tuple(value.shape) != want:
            raise ValueError(f"simulator: {name} has shape {tuple(value.shape)}, want {want}")
        bufs[rank][name] = as_stored(schedule, name, value)
        written[rank][name] = bufs[rank][name]

    for step in schedule.step_list():
        if trace is not None and step.index:
            trace.append(written)
            written = [{} for _ in range(world)]
        op = step.op
        if isinstance(op, m.External):
            for r in range(world):
                for name, value in external(step, r, bufs[r]).items():
                    store(r, name, value)
        elif isinstance(op, m.AllGather):
            _all_gather(schedule, op, bufs, world, env, store)
        elif isinstance(op, m.AllToAll):
            srcs = op.src if isinstance(op.src, list) else [op.src]
            dsts = op.dst if isinstance(op.dst, list) else [op.dst]
            for src, dst in zip(srcs, dsts, strict=True):
                _all_to_all(src, dst, op.dim, bufs, world, store)
        elif isinstance(op, m.ReduceScatter):
            via = op.via or f"{op.dst}__via"
            def keep(r: int, name: str, value: torch.Tensor, src: str = op.src) -> None:
                bufs[r][name] = as_stored(schedule, src, value)  # via has src's dtype

            _all_to_all(op.src, via, op.dim, bufs, world, store if op.via else keep)
            for r in range(world):
                store(r, op.dst, scaled(op, bufs[r], bufs[r][via].sum(dim=0)))
        elif isinstance(op, (m.LseCombine, m.AllToAllCombine)):
            o_name, lse_name = op.src
            if isinstance(op, m.AllToAllCombine):
                for src, dst in zip(op.src, op.via, strict=True):
                    _all_to_all(src, dst, op.dim, bufs, world, store)
                o_name, lse_name = op.via
            base = _lse_base(schedule, op, lse_name)
            for r in range(world):
                lse = _mask_lse(op, bufs[r][lse_name], bufs[r], world, token_dim=0)
                weights, merged = merge_weights(lse, base)
                store(r, op.dst, scaled(op, bufs[r], _weighted_sum(weights, bufs[r][o_name])))
                if op.return_lse:
                    store(r, op.return_lse, merged)
        elif isinstance(op, m.LseCorrect):
            o_name, lse_name = op.src
            base = _lse_base(schedule, op, lse_name)
            for r in range(world):
                lse = _mask_lse(op, bufs[r][lse_name], bufs[r], world, token_dim=0)
                weights, merged = merge_weights(lse, base)
                w = weights[r].unsqueeze(-1)
                store(r, op.dst, torch.where(w == 0, 0.0, w * bufs[r][o_name]))
                if op.return_lse:
                    store(r, op.return_lse, merged)
        elif isinstance(op, m.Copy):
            for r in range(world):
                store(r, op.dst, bufs[r][op.src].clone())
        elif isinstance(op, (m.Barrier, m.Signal, m.Wait)):
            pass
        else:
            raise NotImplementedError(f"simulator: op {step.kind} of step {step.name}")
    if trace is not None:
        trace.append(written)
    return bufs


def seen_at(trace: list[list[Buffers]], step: int, rank: int, name: str) -> torch.Tensor | None:
    """What ``name`` holds on ``rank`` just before step ``step`` (its last write in the
    call so far), or None when no earlier step of the call wrote it."""
    for entry in reversed(trace[:step]):
        if name in entry[rank]:
            return entry[rank][name]
    return None


def _all_gather(
    schedule: m.Schedule, op: m.AllGather, bufs: list[Buffers], world: int,
    env: Mapping[str, int], store: Callable[[int, str, torch.Tensor], None],
) -> None:
    parts = [bufs[r][op.src] for r in range(world)]
    dst_shape = buffer_shape(schedule, op.dst, env)
    if len(dst_shape) == parts[0].dim() + 1:
        gathered = torch.stack(parts, dim=op.dim)
    elif op.interleave is None:
        gathered = torch.cat(parts, dim=op.dim)
    else:
        n, inter = parts[0].shape[op.dim], op.interleave
        gathered = torch.empty(dst_shape, dtype=torch.float64)
        for r, part in enumerate(parts):
            j = torch.arange(n)
            rows = (j // inter) * world * inter + r * inter + j % inter
            gathered.index_copy_(op.dim, rows, part.to(torch.float64))
    for r in range(world):
        store(r, op.dst, gathered.clone())


def _all_to_all(
    src: str, dst: str, dim: int, bufs: list[Buffers], world: int,
    store: Callable[[int, str, torch.Tensor], None],
) -> None:
    """dst[p] on rank j = part j (along ``dim``) of src on rank p."""
    parts = [_split(bufs[p][src], dim, world) for p in range(world)]
    for j in range(world):
        store(j, dst, torch.stack([parts[p][j] for p in range(world)]))
