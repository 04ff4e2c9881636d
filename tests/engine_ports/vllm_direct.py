"""Port of the workers of vLLM's tests/distributed/test_dcp_direct_a2a_lse_reduce.py
(vllm-project/vllm 01b867e8, open PR #52239's dcp_utils layout) onto dcpc's vLLM adapters:
vLLM's direct symmetric-memory workspaces -> dcpc's manager (dcpc.engines.vllm
MLADCPManager: combine, query_gather; dcpc.engines.vllm_kv MLADCPKVGather: the PR's
init_kv_gather / direct_kv_gather).

Replaced (fixtures): NCCL process groups -> a dcpc LocalGroup (threads, ``local``
backend) or gloo processes (``torch`` backend); CUDA -> CPU; world size 4 -> 2 and 3;
``dcp_utils.dbo_current_ubatch_id = lambda: active_ubatch[0]`` -> the same override of
``vllm.v1.worker.ubatching.dbo_current_ubatch_id`` (per thread) or ``slot=``; CUDA-graph
capture + replays -> the same number of eager calls with the inputs the replays saw;
``dist.all_gather`` of inputs for the references -> every rank regenerates every rank's
inputs from vLLM's seeds; ``dist.all_reduce`` of the consumed sum -> a barrier (the sum
is checked against this rank's expected value, not W times it).

Deviations, named: the query gather's ``padded_num_heads`` is 128 at W = 4 in vLLM; at
W = 2 it is None as in vLLM, at W = 3 it is 32 (so padding runs at all). The KV layouts
list 4 ranks' context lengths; at W < 4 the first W are used, and the capacity
``max_gathered_tokens`` 64 (a multiple of 4) becomes 63 at W = 3. The direct a2a cases use
1, 17 and 32 tokens (vLLM: 1, 17, 128; the interpreter's cost) with vLLM's workspace of
128 tokens. Not ported (vLLM workspace internals with no dcpc counterpart): the
``data_ptr`` of vLLM's ``final_query`` / ``received_kv``, ``epoch`` and ``completion``
counters; the KV gather's "other ubatch / inactive slot / tail untouched" checks read
dcpc's slot buffers (``_planes``) instead of vLLM's ``received_kv``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from contextlib import contextmanager
from typing import Any

import torch
from engine_ports.vllm_dcp_a2a import lse_weighted_combine

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}
_ubatch = threading.local()


def _install_ubatch_override() -> None:
    """vLLM's tests set dcp_utils.dbo_current_ubatch_id; dcpc reads vLLM's
    vllm.v1.worker.ubatching.dbo_current_ubatch_id: the same override, per thread."""
    if "vllm.v1.worker.ubatching" in sys.modules:
        return
    module = types.ModuleType("vllm.v1.worker.ubatching")
    module.dbo_current_ubatch_id = lambda: getattr(_ubatch, "value", 0)  # type: ignore
    sys.modules["vllm.v1.worker.ubatching"] = module


_env_lock = threading.Lock()
_env_users: dict[str, int] = {}  # variable -> rank threads inside _env now
_env_saved: dict[str, str | None] = {}  # variable -> its value before the first of them


@contextmanager
def _env(**values: str):
    """Set ``values`` in os.environ, which is the process's: a LocalGroup's rank threads
    enter this together, so the first to enter saves the old values and the last to
    leave restores them (each thread saving and restoring its own copy left a variable
    set for the rest of the process when the threads interleaved)."""
    with _env_lock:
        for k, v in values.items():
            if _env_users.get(k, 0) == 0:
                _env_saved[k] = os.environ.get(k)
            _env_users[k] = _env_users.get(k, 0) + 1
            os.environ[k] = v
    try:
        yield
    finally:
        with _env_lock:
            for k in values:
                _env_users[k] -= 1
                if _env_users[k] == 0:
                    old = _env_saved.pop(k)
                    if old is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = old


def _backend() -> str:
    """The manager's backend: the run's DCPC_BACKEND (``torch`` in the gloo children),
    else auto (``local`` on a LocalGroup)."""
    return os.environ.get("DCPC_BACKEND", "auto")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=3e-2, atol=3e-2)


# ---- query gather ---------------------------------------------------------------------------
def _q_reference(parts: list[torch.Tensor], padded: int | None) -> torch.Tensor:
    num_tokens, heads_per_rank, head_dim = parts[0].shape
    expected = torch.stack([p.contiguous() for p in parts]).movedim(0, 1).reshape(
        num_tokens, len(parts) * heads_per_rank, head_dim)
    if padded is not None:
        reserved = expected.new_empty((num_tokens, padded, head_dim))
        reserved.resize_(expected.shape)
        reserved.copy_(expected)
        expected = reserved
    return expected


def _assert_q_gather_matches_reference(actual: torch.Tensor, parts: list[torch.Tensor],
                                       padded: int | None) -> None:
    local_query = parts[0]
    world_size = len(parts)
    expected = _q_reference(parts, padded)
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.is_contiguous()
    assert actual.stride() == expected.stride()
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    storage_num_heads = padded or world_size * local_query.shape[1]
    remaining = actual.untyped_storage().nbytes() - actual.storage_offset() * \
        actual.element_size()
    required = local_query.shape[0] * storage_num_heads * local_query.shape[2] * \
        actual.element_size()
    assert remaining >= required


def _query(rank: int, dtype_idx: int, iteration: int, num_tokens: int, noncontiguous: bool,
           heads_per_rank: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(9000 + rank * 101 + dtype_idx * 1009 + iteration)
    source_heads = heads_per_rank + 2 if noncontiguous else heads_per_rank
    storage = torch.randn(num_tokens, source_heads, head_dim, generator=g,
                          dtype=torch.bfloat16).to(dtype)
    local = storage[:, :heads_per_rank]
    assert local.is_contiguous() is not noncontiguous
    return local


def direct_q_gather(group: Any, r: int, world: int, barrier: Any) -> int:
    """_distributed_direct_q_gather_worker; returns the number of checked gathers."""
    from dcpc.engines import vllm as V

    heads_per_rank, head_dim, max_num_tokens = 6, 576, 128
    padded = 128 if world == 4 else (32 if world == 3 else None)
    checked = 0
    with _env(VLLM_USE_DIRECT_DCP_A2A="0", VLLM_USE_DIRECT_DCP_Q_GATHER="1"):
        for dtype_idx, dtype_name in enumerate(("bfloat16", "float8_e4m3fn", "float32")):
            dtype = DTYPES[dtype_name]
            m = V.MLADCPManager(None, "cpu", heads_per_rank, head_dim, 512, dtype,
                                torch.bfloat16, padded, group=group,
                                max_num_tokens=max_num_tokens, num_ubatches=2,
                                comm_backend="a2a", backend=_backend())
            cases = (((1, False), (128, True), (17, True), (5, False))
                     if dtype == torch.bfloat16 else ((17, True),))
            for iteration, (num_tokens, noncontiguous) in enumerate(cases):
                parts = [_query(p, dtype_idx, iteration, num_tokens, noncontiguous,
                                heads_per_rank, head_dim, dtype) for p in range(world)]
                actual = m.query_gather(parts[r], slot=iteration % 2)
                _assert_q_gather_matches_reference(actual, parts, padded)
                checked += 1
                barrier()
            if dtype != torch.bfloat16:
                continue
            # vLLM: capture on ubatch 1, an eager call, 2 replays with new inputs, an
            # interleaved eager call, a last replay: here the same calls, eagerly
            shape = (17, heads_per_rank, head_dim)
            pattern = torch.arange(17 * heads_per_rank * head_dim, dtype=torch.int32
                                   ).remainder(31).view(shape).to(dtype)
            inputs = [torch.full(shape, 96 + p, dtype=dtype) for p in range(world)]
            calls = [inputs] + [[pattern + p * 32 + k for p in range(world)] for k in (0, 1)]
            calls += [[torch.full(shape, 160 + p, dtype=dtype) for p in range(world)]]
            calls += [[pattern + p * 32 + 2 for p in range(world)]]
            for parts in calls:
                storage = torch.empty(17, heads_per_rank + 2, head_dim, dtype=dtype)
                local = storage[:, :heads_per_rank]  # the captured input: noncontiguous
                local.copy_(parts[r])
                _assert_q_gather_matches_reference(m.query_gather(local, slot=1), parts,
                                                   padded)
                checked += 1
                barrier()
    return checked


# ---- KV gather (PR #52239's direct final-layout gather) -------------------------------------
FULL = ([4, 4, 6], [4, 0, 0], [[8, 8, 7, 6], [4, 2, 2, 2], [6, 6, 5, 4]])
ALTERNATE = ([4, 4, 6], [4, 0, 0], [[8, 8, 8, 6], [3, 2, 2, 2], [6, 6, 5, 4]])
SMALL = ([4], [4], [[8, 8, 7, 6]])
TOKEN_DIM, SPLIT = 576, 512


def _layout_maps(layout: Any, world: int) -> tuple[list[list[int]], int]:
    padded_lens, local_starts, context_lens = layout
    maps: list[list[int]] = [[] for _ in range(world)]
    output_start = 0
    for padded_len, local_start, request_lens in zip(padded_lens, local_starts,
                                                     context_lens, strict=True):
        valid_lens = [min(max(0, length - local_start), padded_len)
                      for length in request_lens[:world]]
        for source_rank, valid_len in enumerate(valid_lens):
            rank_start = output_start + sum(valid_lens[:source_rank])
            maps[source_rank].extend(range(rank_start, rank_start + valid_len))
            maps[source_rank].extend([-1] * (padded_len - valid_len))
        output_start += sum(valid_lens)
    assert sorted(row for rows in maps for row in rows if row >= 0) == list(range(output_start))
    return maps, output_start


def _make_local(source_rank: int, iteration: int, num_rows: int, dtype: torch.dtype
                ) -> torch.Tensor:
    values = torch.arange(num_rows * TOKEN_DIM, dtype=torch.int32)
    values = (values + source_rank * 7 + iteration * 13).remainder(29) - 14
    return values.view(num_rows, TOKEN_DIM).to(dtype)


def _expected_planes(layout: Any, world: int, iteration: int, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    maps, output_tokens = _layout_maps(layout, world)
    output = torch.empty(output_tokens, TOKEN_DIM, dtype=dtype)
    covered = torch.zeros(output_tokens, dtype=torch.bool)
    for source_rank, rows in enumerate(maps):
        source = _make_local(source_rank, iteration, len(rows), dtype)
        dst = torch.tensor(rows, dtype=torch.int64)
        valid = dst >= 0
        assert not torch.any(covered[dst[valid]])
        output[dst[valid]] = source[valid]
        covered[dst[valid]] = True
    assert torch.all(covered)
    return output[:, :SPLIT].unsqueeze(1), output[:, SPLIT:].unsqueeze(1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def direct_kv_gather(group: Any, r: int, world: int, barrier: Any) -> int:
    """_distributed_direct_kv_gather_worker; returns the number of checked gathers."""
    from dcpc.engines.vllm_kv import MLADCPKVGather

    _install_ubatch_override()
    checked = 0
    cap = 64 // world * world  # vLLM: 64 at W = 4; a multiple of W (63 at W = 3)

    def publish(ws: Any, dtype: torch.dtype, iteration: int, slot: int, layout: Any) -> Any:
        maps, output_tokens = _layout_maps(layout, world)
        got = ws.direct_kv_gather(_make_local(r, iteration, len(maps[r]), dtype),
                                  torch.tensor(maps[r], dtype=torch.int32), output_tokens,
                                  slot)
        return got, _expected_planes(layout, world, iteration, dtype)

    def assert_planes(actual: Any, expected: Any) -> None:
        for a, e in zip(actual, expected, strict=True):
            assert _same(a, e)

    def check_case(ws: Any, dtype: torch.dtype, iteration: int, ubatch: int, slot: int,
                   layout: Any) -> None:
        maps, output_tokens = _layout_maps(layout, world)
        _ubatch.value = ubatch
        other_before = ws._planes[1 - ubatch].clone()
        inactive_before = ws._planes[ubatch, 1 - slot].clone()
        tail = ws._planes[ubatch, slot]
        kv_tail = tail[: cap * SPLIT].view(cap, SPLIT)[output_tokens:].clone()
        pe_tail = tail[cap * SPLIT:].view(cap, -1)[output_tokens:].clone()
        kv_c, k_pe = ws.direct_kv_gather(_make_local(r, iteration, len(maps[r]), dtype),
                                         torch.tensor(maps[r], dtype=torch.int32),
                                         output_tokens, slot)
        expected_kv_c, expected_k_pe = _expected_planes(layout, world, iteration, dtype)
        assert kv_c.shape == expected_kv_c.shape and k_pe.shape == expected_k_pe.shape
        assert kv_c.dtype == k_pe.dtype == dtype
        assert kv_c.is_contiguous() and k_pe.is_contiguous()
        assert _same(kv_c, expected_kv_c) and _same(k_pe, expected_k_pe)
        assert k_pe.data_ptr() == kv_c.data_ptr() + cap * SPLIT * kv_c.element_size()
        assert _same(ws._planes[1 - ubatch], other_before)
        assert _same(ws._planes[ubatch, 1 - slot], inactive_before)
        tail = ws._planes[ubatch, slot]
        assert _same(tail[: cap * SPLIT].view(cap, SPLIT)[output_tokens:],
                     kv_tail)
        assert _same(tail[cap * SPLIT:].view(cap, -1)[output_tokens:],
                     pe_tail)
        barrier()

    eager_cases = {"bfloat16": ((0, 0, 0, FULL), (1, 0, 1, ALTERNATE), (2, 0, 0, SMALL)),
                   "float16": ((3, 0, 0, FULL),), "float8_e4m3fn": ((4, 0, 0, FULL),)}
    with _env(VLLM_USE_DIRECT_DCP_KV_GATHER="1"):
        for dtype_name, cases in eager_cases.items():
            dtype = DTYPES[dtype_name]
            ws = MLADCPKVGather(group, "cpu", 2, backend=_backend())
            assert ws.init_kv_gather(cap, TOKEN_DIM, SPLIT, dtype)
            for args in cases:
                check_case(ws, dtype, *args)
                checked += 1
            if dtype != torch.bfloat16:
                continue
            _ubatch.value = 0
            first, expected = publish(ws, dtype, 30, 0, FULL)
            if r == 0:
                time.sleep(0.25)  # rank 0 consumes slot 0 late
            assert_planes(first, expected)
            publish(ws, dtype, 31, 1, ALTERNATE)
            reused, expected = publish(ws, dtype, 32, 0, SMALL)
            assert_planes(reused, expected)
            barrier()
            first, expected = publish(ws, dtype, 33, 0, FULL)
            consumed = sum(plane.float().sum() for plane in first)
            expected_consumed = sum(plane.float().sum() for plane in expected)
            barrier()  # vLLM: dist.all_reduce(consumed), the downstream TP collective
            reused, expected = publish(ws, dtype, 34, 0, SMALL)
            torch.testing.assert_close(consumed, expected_consumed)
            assert_planes(reused, expected)
            barrier()
            checked += 5
            # the graph section, eagerly: ubatch 1, slot 1; then an eager ubatch-0 call
            # must leave ubatch 1's planes alone; then "the replay" with new inputs
            _ubatch.value = 1
            captured, expected = publish(ws, dtype, 20, 1, FULL)
            assert_planes(captured, expected)
            captured = tuple(p.clone() for p in captured)
            check_case(ws, dtype, 21, 0, 0, SMALL)
            _ubatch.value = 1
            replayed, expected = publish(ws, dtype, 22, 1, ALTERNATE)
            assert_planes(replayed, expected)
            barrier()
            checked += 3
    _ubatch.value = 0
    return checked


# ---- direct a2a (the manager's combine) -----------------------------------------------------
def _a2a_inputs(rank: int, seed: int, num_tokens: int, storage_heads: int, total_heads: int,
                dtype: torch.dtype, lse_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(num_tokens, storage_heads, 512, generator=g).to(dtype)
    lse = torch.randn(num_tokens, storage_heads, generator=g).to(lse_dtype)
    return out[:, :total_heads, :], lse[:, :total_heads]


def direct_a2a(group: Any, r: int, world: int, barrier: Any) -> int:
    """_distributed_direct_a2a_worker (bf16 output, bf16 LSE, base 2); returns the number
    of checked combines."""
    from dcpc.engines import vllm as V

    dtype = lse_dtype = torch.bfloat16
    is_lse_base_on_e = False
    heads_per_rank, max_num_tokens = 6, 128
    total_heads = world * heads_per_rank
    head = slice(r * heads_per_rank, (r + 1) * heads_per_rank)
    m = V.MLADCPManager(None, "cpu", heads_per_rank, 576, 512, dtype, dtype, None,
                        is_lse_base_on_e, group=group, max_num_tokens=max_num_tokens,
                        num_ubatches=2, comm_backend="a2a", backend=_backend())
    checked = 0

    def check(num_tokens: int, iteration: int, padded: bool, repeats: int = 1) -> None:
        storage_heads = 128 if padded else total_heads
        every = [_a2a_inputs(p, 1234 + p + iteration * world, num_tokens, storage_heads,
                             total_heads, dtype, lse_dtype) for p in range(world)]
        partial_output, partial_lse = every[r]
        if padded:
            assert not partial_output.is_contiguous() and not partial_lse.is_contiguous()
        for _ in range(repeats):
            actual = m.combine(partial_output, partial_lse, seq_lens=None,
                               query_start_loc=None, slot=iteration % 2).clone()
            barrier()
        outputs = torch.stack([o[:, head, :] for o, _ in every]).float()
        lses = torch.stack([lse[:, head] for _, lse in every])
        _assert_close(actual, lse_weighted_combine(outputs, lses,
                                                   is_lse_base_on_e=is_lse_base_on_e), dtype)

    for iteration, (num_tokens, padded) in enumerate(((1, False), (17, True), (32, True))):
        check(num_tokens, iteration, padded)
        checked += 1

    # check_empty_shards: globally empty, rank-local empty and non-empty sequences
    query_lens = [1, 3, 2, *([1] * (world - 1))]
    num_seqs, num_tokens, iteration = len(query_lens), sum(query_lens), 3

    def is_empty(seq_idx: int, source_rank: int) -> bool:
        return seq_idx == 0 or seq_idx == 1 + source_rank

    def rank_inputs(p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(777 + p + iteration * world)
        out = torch.randn(num_tokens, total_heads, 512, generator=g).to(dtype)
        lse = torch.randn(num_tokens, total_heads, generator=g).to(lse_dtype)
        lens = torch.tensor([0 if is_empty(s, p) else s + 3 for s in range(num_seqs)],
                            dtype=torch.int32)
        empty_rows = torch.repeat_interleave(lens == 0, torch.tensor(query_lens))
        out[empty_rows] = float("nan")  # undefined attention rows
        lse[empty_rows] = float("nan")
        return out, lse, lens

    every = [rank_inputs(p) for p in range(world)]
    q = torch.tensor(query_lens, dtype=torch.int32)
    query_start_loc = torch.cat((q.new_zeros(1), q.cumsum(0))).to(torch.int32)
    partial_output, partial_lse, seq_lens = every[r]
    actual = m.combine(partial_output, partial_lse, seq_lens=seq_lens,
                       query_start_loc=query_start_loc, slot=iteration % 2).clone()
    barrier()
    outputs = torch.stack([o[:, head, :] for o, _, _ in every]).float()
    lses = torch.stack([lse[:, head] for _, lse, _ in every])
    for source_rank in range(world):
        source_empty = torch.tensor([is_empty(s, source_rank) for s in range(num_seqs)]
                                    ).repeat_interleave(q)
        outputs[source_rank][source_empty] = 0.0
        lses[source_rank][source_empty] = float("-inf")
    expected = lse_weighted_combine(outputs, lses, is_lse_base_on_e=is_lse_base_on_e)
    all_empty = torch.tensor([all(is_empty(s, p) for p in range(world))
                              for s in range(num_seqs)]).repeat_interleave(q)
    assert torch.equal(actual[all_empty], torch.zeros_like(actual[all_empty]))
    assert not torch.isnan(actual.float()).any()
    _assert_close(actual, expected, dtype)
    checked += 1
    # the graph: captured on ubatch 1, replayed 3 times -> 3 eager calls, then compared
    check(32, 5, True, repeats=3)
    return checked + 1


def run_all(group: Any, r: int, world: int, barrier: Any) -> dict[str, int]:
    return {"direct_q_gather": direct_q_gather(group, r, world, barrier),
            "direct_kv_gather": direct_kv_gather(group, r, world, barrier),
            "direct_a2a": direct_a2a(group, r, world, barrier)}
