"""vLLM's tests/distributed/test_dcp_direct_a2a_lse_reduce.py (vllm-project/vllm 01b867e8,
open PR #52239's dcp_utils layout), ported onto dcpc's vLLM adapters. The workers (query
gather with padded_num_heads, the direct KV gather, the direct a2a combine with empty
shards) are in tests/engine_ports/vllm_direct.py with what was replaced and what was not
ported; the manager's selection tests and the workspace formula are below, with vLLM's
MagicMock configs replaced by plain objects and its mocked workspaces by dcpc's real
paths. The workers run on the ``local`` backend (the generated kernels, threads) at W =
2 and, with every ported file, on the ``torch`` backend at W = 2 and 3 and the ``host``
backend (the kernels, ranks as processes) at W = 2 at the end of this file (the kernels
at W = 3: the direct KV gather in test_engines_vllm_pr52239.py, the combine in
test_engines_local.py; a W = 3 local run of these workers takes ~3 min of CPU here)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from engine_ports import vllm_direct as P
from engine_ports.harness import port_cache, port_cache_dir  # noqa: F401
from engine_ports.vllm_dcp_a2a import lse_weighted_combine
from test_port_vllm_dcp_a2a import check

from dcpc.engines import vllm as V
from dcpc.engines.vllm_kv import MLADCPManagerPR52239
from dcpc.harness.launch import launch
from dcpc.runtime.local import LocalGroup


def _manager_config(dcp_comm_backend: str = "a2a") -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(num_ubatches=1, dcp_comm_backend=dcp_comm_backend),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16, max_num_seqs=4),
        num_speculative_tokens=0, speculative_config=None,
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=0))


def test_dcp_workspace_covers_drafting_slots():
    """vLLM's test of the parallel-drafting workspace (28 tokens for 4 sequences, k = 3),
    as vLLM 0.34.0 states it: parallel drafting is deprecated there (no effect) and the
    drafting slots are the speculator's max_num_new_slots_for_drafting."""
    config = _manager_config()
    config.scheduler_config.max_num_batched_tokens = 128
    config.num_speculative_tokens = 3
    config.speculative_config = SimpleNamespace(num_speculative_tokens=3,
                                                max_num_new_slots_for_drafting=3)
    assert V.get_dcp_workspace_max_num_tokens(config) == 28


def _run(world: int, fn) -> list:
    return LocalGroup(world, "cpu", timeout_s=300).run(lambda rank: fn(rank, rank.rank))


def test_mla_dcp_manager_selects_pcp_combine():
    """vLLM: with use_pcp and ag_rs the combine is cp_lse_ag_out_ar (all heads,
    all-reduced) and there is no query gather; here the same, by what combine returns."""
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(3, 4, 16, generator=g) for _ in range(2)]
    lses = [torch.randn(3, 4, generator=g) for _ in range(2)]

    def rank_main(rank, r):
        m = MLADCPManagerPR52239(_manager_config("ag_rs"), "cpu", 2, 8, 16, torch.float32,
                              torch.float32, None, True, True, group=rank, max_num_tokens=8)
        assert m.query_gather is None
        return m.combine(outs[r], lses[r], seq_lens=None, query_start_loc=None)

    got = _run(2, rank_main)
    want = lse_weighted_combine(torch.stack(outs).double(), torch.stack(lses).double())
    for r in range(2):
        assert got[r].shape == (3, 4, 16)  # every head: the all-reduce, not the scatter
        torch.testing.assert_close(got[r].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("switch", ["0", "1"])
def test_mla_dcp_manager_selects_backends(switch, monkeypatch):
    """vLLM's selects_direct_backends / selects_fallback_backends: the switches at 1 pick
    the direct paths (init_kv_gather -> True, direct_kv_gather), at 0 the fallbacks
    (init_kv_gather -> False, kv_gather = all_gather_into_tensor, query_gather =
    all_gather(dim=1)); here the paths run, and their results are checked."""
    for name in ("VLLM_USE_DIRECT_DCP_A2A", "VLLM_USE_DIRECT_DCP_Q_GATHER",
                 "VLLM_USE_DIRECT_DCP_KV_GATHER"):
        monkeypatch.setenv(name, switch)
    g = torch.Generator().manual_seed(4)
    queries = [torch.randn(1, 2, 8, generator=g).bfloat16() for _ in range(2)]
    local = [torch.randn(2, 16, generator=g).bfloat16() for _ in range(2)]

    def rank_main(rank, r):
        m = MLADCPManagerPR52239(_manager_config(), "cpu", 2, 8, 4, torch.bfloat16,
                              torch.bfloat16, None, False, False, group=rank,
                              max_num_tokens=16)
        found = {"q": m.query_gather(queries[r]).clone(),
                 "direct": m.init_kv_gather(64, 16, 8, torch.bfloat16)}
        if found["direct"]:
            assert m.use_direct_kv_gather
            dst = torch.tensor([2 * r, 2 * r + 1], dtype=torch.int32)
            kv_c, k_pe = m.direct_kv_gather(local[r], dst, 4, 1)
            found["planes"] = (kv_c.clone(), k_pe.clone())
        else:
            gathered = torch.empty(4, 16, dtype=torch.bfloat16)
            m.kv_gather(gathered, local[r])
            found["gathered"] = gathered
        return found

    want_q = torch.cat(queries, dim=1)
    for f in _run(2, rank_main):
        assert torch.equal(f["q"], want_q)
        assert f["direct"] is (switch == "1")
        rows = torch.cat(local)
        if f["direct"]:
            assert f["planes"][0].shape == (4, 1, 8) and f["planes"][1].shape == (4, 1, 8)
            assert torch.equal(f["planes"][0][:, 0], rows[:, :8])
            assert torch.equal(f["planes"][1][:, 0], rows[:, 8:])
        else:
            assert torch.equal(f["gathered"], rows)


@pytest.mark.parametrize("world", [2])
def test_workers_local(world):
    workers = ("direct_q_gather", "direct_kv_gather", "direct_a2a")
    before = dict(os.environ)
    for name in workers:
        fn = getattr(P, name)
        counts = LocalGroup(world, "cpu", timeout_s=300).run(
            lambda rank, fn=fn: fn(rank, rank.rank, world, rank.barrier))
        assert len(set(counts)) == 1 and counts[0] >= 5, (name, counts)
        # the workers' switches (set by every rank thread at once) are gone again: left
        # set, VLLM_USE_DIRECT_DCP_A2A=0 sent every later test of the process to the
        # fallback
        assert dict(os.environ) == before, {k: v for k, v in os.environ.items()
                                             if before.get(k) != v}


# ---- every ported file on the torch backend (last in this file: the local runs above,
# and those of test_port_sglang_dsv4 / test_port_vllm_dcp_a2a, filled the cache) --------
MODULES = ["engine_ports.vllm_dcp_a2a", "engine_ports.vllm_direct",
           "engine_ports.sglang_dsv4"]


@pytest.mark.host
@pytest.mark.parametrize("backend,world", [("torch", 2), ("torch", 3), ("host", 2)])
def test_ported_engine_tests_on_the_torch_and_host_backends(backend, world):
    """One gloo child per rank serves every ported file (tests/engine_ports/), the group
    passed as vLLM's tests pass it (``_FakeCPGroup(world_size, device_group)``); the
    adapters' modules on ``backend`` (host: the generated kernels under the interpreter,
    ranks as processes over shared memory; torch: gloo collectives)."""
    result = launch("engine_ports.harness:torch_worker", world,
                    {"cache": os.environ["DCPC_CACHE_DIR"], "modules": MODULES,
                     "backend": backend}, timeout_s=600)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    found = result.values()
    check([f["engine_ports.vllm_dcp_a2a"] for f in found])
    for f in found:
        assert all(n >= 5 for n in f["engine_ports.vllm_direct"].values()), f
        assert f["engine_ports.sglang_dsv4"]["sglang_dsv4"] == "ok"
