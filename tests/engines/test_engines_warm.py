"""dcpc.engines.warm fills the adapters' cache ahead of time: after it ran, the vLLM
adapters' first calls (the free functions, the manager's combine, query gather and KV
gather) find every module in the cache and compile nothing (the compiler is made to
raise), on the local backend at W = 2."""

from __future__ import annotations

import pytest
import torch
from support.kernels import run_ranks

from dcpc.engines import common, warm
from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F

TOKENS, D, KV_TOKENS = 8, 16, 8


def test_warm_fills_what_the_adapters_look_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", str(TOKENS))
    argv = ["--engine", "vllm", "--max-tokens", str(TOKENS), "--dv", str(D), "--dq", str(D),
            "--kv-width", str(D), "--kv-tokens", str(KV_TOKENS), "--world", "2"]
    assert warm.main(argv) == 0
    first = capsys.readouterr().out
    assert first.count("compiled") == 4 and "cached" not in first, first  # 2 paths, q, kv
    assert len(list(tmp_path.glob("*.py"))) == 4
    assert warm.main(argv) == 0
    assert capsys.readouterr().out.count("cached") == 4

    def no_compiling(*args, **kwargs):
        raise AssertionError(f"compiled at first call: {args[0][:200]}")

    monkeypatch.setattr(common, "compile_into", no_compiling)
    monkeypatch.setattr(common, "_classes", {})  # a fresh server process: only the folder
    F._free_tokens.cache_clear()

    def rank_main(rank):
        g = torch.Generator().manual_seed(rank.rank)
        out = torch.randn(3, 4, D, generator=g).bfloat16()
        lse = torch.randn(3, 4, generator=g)
        a2a = V.dcp_a2a_lse_reduce(out, lse, rank)
        ag_rs = V.cp_lse_ag_out_rs(out, lse, rank)
        m = V.MLADCPManager(None, "cpu", 2, D, D, torch.bfloat16, torch.bfloat16, group=rank,
                            max_num_tokens=TOKENS, num_ubatches=1, comm_backend="a2a")
        q = m.query_gather(torch.randn(3, 2, D, generator=g).bfloat16())
        workspace = torch.zeros(KV_TOKENS + KV_TOKENS // 2, D, dtype=torch.bfloat16)
        m.init_kv_gather(workspace, KV_TOKENS)
        local = torch.randn(4, D, generator=g).bfloat16()
        gathered = torch.empty(8, D, dtype=torch.bfloat16)
        m.kv_gather(gathered, local)
        return a2a.shape, ag_rs.shape, q.shape, bool(torch.equal(gathered[4 * rank.rank:][:4],
                                                                   local))

    try:
        got = run_ranks(2, rank_main)
    finally:
        F._free_tokens.cache_clear()
        V.reset()
    assert got == [((3, 2, D), (3, 2, D), (3, 4, D), True)] * 2


def test_specs_refuse_an_unknown_engine_or_path():
    with pytest.raises(ValueError, match="engine must be one of"):
        warm.specs("trt", 8)
    with pytest.raises(ValueError, match="paths must be among"):
        warm.specs("vllm", 8, paths=("ring",))


def test_warm_writes_the_folder_even_when_this_process_holds_the_classes(tmp_path, monkeypatch,
                                                                          capsys):
    """A process that already loaded the adapters' classes (from another folder) still
    fills the folder it is asked to warm (found in the full suite: 4 'compiled', 1 file)."""
    argv = ["--engine", "vllm", "--max-tokens", str(TOKENS), "--dv", str(D), "--dq", str(D),
            "--world", "2"]
    for folder in ("first", "second"):
        monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path / folder))
        assert warm.main(argv) == 0
        assert capsys.readouterr().out.count("compiled") == 3
        assert len(list((tmp_path / folder).glob("*.py"))) == 3, folder
