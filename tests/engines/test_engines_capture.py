"""The adapters' CUDA-graph capture warm-up (dcpc.engines.capture): after a family's
first call (vLLM's free functions, SGLang's) or the manager's construction, calls at
every capture size make no compile, no call plan for a new call key and no module
allocation (counted by dcpc.runtime.calls.COUNTS, the runtime's own counters),
and match float64; with DCPC_WARM_CAPTURE=0 the first call at a size does record.
W = 2 on the local backend (ranks as threads, in process); the engines' configs are
stand-ins with their attribute names (vLLM's compilation_config.cudagraph_capture_sizes,
SGLang's server args' cuda_graph_bs)."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from dcpc.engines import capture
from dcpc.engines import reference as ref
from dcpc.runtime import calls
from dcpc.runtime.local import LocalGroup

W, HEADS, D = 2, 4, 16
SIZES = [1, 2, 4]  # the capture sizes of the stand-in configs
NOTHING = {"plans": 0, "allocations": 0, "compiles": 0, "imports": 0}  # replans: host only


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One module cache for this file's tests (they share schedules: compiled once)."""
    return tmp_path_factory.mktemp("capture_cache")


@pytest.fixture
def fresh(cache_dir, monkeypatch):
    """This file's module cache, the workspace 8, no sizes from the environment, and the
    warm-up's memory of families and sizes emptied (and the adapters' modules closed)."""
    from dcpc.engines import combine

    monkeypatch.setenv("DCPC_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    monkeypatch.delenv(capture.SIZES_ENV, raising=False)
    monkeypatch.delenv(capture.SWITCH, raising=False)
    monkeypatch.setattr(capture, "_done", {})
    monkeypatch.setattr(capture, "_fast", {})
    monkeypatch.setattr(capture, "_found", {})
    monkeypatch.setattr(capture, "_said", {})
    yield
    combine.reset()


@pytest.fixture
def vllm_config(monkeypatch):
    """vllm.config with a current config whose capture sizes are SIZES."""
    from dcpc.engines import vllm_free as F

    cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=SIZES),
                          parallel_config=SimpleNamespace(num_ubatches=1))
    monkeypatch.setitem(sys.modules, "vllm", _module("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.config",
                        _module("vllm.config", get_current_vllm_config_or_none=lambda: cfg))
    monkeypatch.setitem(sys.modules, "vllm.v1", None)  # no ubatching, no vLLM ops
    F._free_tokens.cache_clear()
    yield cfg
    F._free_tokens.cache_clear()


def _parts(seed: int, tokens: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(tokens, HEADS, D, generator=g).bfloat16() for _ in range(W)]
    lses = [torch.randn(tokens, HEADS, generator=g) * 2 for _ in range(W)]
    return outs, lses


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got = got.double()
    return bool(torch.isfinite(got).all()
                and ((got - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())


def _counted(rank, body) -> dict[str, int] | None:
    """COUNTS' change over ``body()`` on every rank (read on rank 0 between barriers)."""
    rank.barrier()
    before = calls.counts() if rank.rank == 0 else None
    rank.barrier()
    body()
    rank.barrier()
    after = calls.counts() if rank.rank == 0 else None
    rank.barrier()
    return None if before is None else {k: after[k] - before[k] for k in after
                                        if k != "replans"}


def _vllm_rank(rank, mask: bool) -> dict:
    from dcpc.engines import vllm as V

    r, found = rank.rank, {"ok": []}
    for i, fn in enumerate((V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs)):
        outs, lses = _parts(i, 3)  # the first call: vLLM's dummy run, not a capture size
        lens = torch.ones(3, dtype=torch.int32) if mask else None
        qsl = torch.arange(4, dtype=torch.int32) if mask else None
        found["ok"].append(_close(fn(outs[r], lses[r], rank, seq_lens=lens,
                                     query_start_loc=qsl), ref.vllm_combine(outs, lses)[r][0]))
    got = []

    def at_every_size() -> None:
        for n in SIZES:
            for i, fn in enumerate((V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs)):
                outs, lses = _parts(10 * n + i, n)
                lens = torch.ones(n, dtype=torch.int32) if mask else None
                qsl = torch.arange(n + 1, dtype=torch.int32) if mask else None
                out = fn(outs[r], lses[r], rank, seq_lens=lens, query_start_loc=qsl)
                got.append(_close(out, ref.vllm_combine(outs, lses)[r][0]))

    found["counts"] = _counted(rank, at_every_size)
    found["ok"] += got
    return found


@pytest.mark.parametrize("warm", [True, False])
def test_vllm_free_functions_warm_every_capture_size_at_first_use(fresh, vllm_config, warm,
                                                                  monkeypatch, caplog):
    """Workspace 2: sizes 1 and 2 on dcpc's kernels, 4 on the torch fallback (its empty
    call through the module warmed once)."""
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "2")
    if not warm:
        monkeypatch.setenv(capture.SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="dcpc.engines"):
        found = LocalGroup(W, "cpu", timeout_s=300).run(lambda rank: _vllm_rank(rank, True))
    for f in found:
        assert all(f["ok"]) and len(f["ok"]) == 2 + 2 * len(SIZES), f
    said = [r.getMessage() for r in caplog.records if "warmed up for CUDA-graph" in r.getMessage()]
    if warm:
        assert found[0]["counts"] == NOTHING, found[0]["counts"]
        # one line per function and rank (a rank is a family's owner), naming the sizes
        assert len(said) == 2 * W and all(
            "sizes [1, 2]" in s and "above the workspace 2 (fallback): [4]" in s
            for s in said), said
    else:  # the first call at each size runs the checked path and records its plan
        assert found[0]["counts"]["plans"] > 0
        assert not said


def _manager_rank(rank, cfg) -> dict:
    from dcpc.engines import vllm as V

    r = rank.rank
    m = V.MLADCPManager(cfg, "cpu", HEADS // W, D, D, torch.bfloat16, torch.bfloat16,
                        group=rank, max_num_tokens=8, num_ubatches=1, comm_backend="a2a",
                        backend="local")
    ok = []

    def at_every_size() -> None:
        for n in SIZES:
            outs, lses = _parts(n, n)
            lens, qsl = torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32)
            ok.append(_close(m.combine(outs[r], lses[r], seq_lens=lens, query_start_loc=qsl),
                             ref.vllm_combine(outs, lses)[r][0]))
            qs = [torch.randn(n, HEADS // W, D, generator=torch.Generator().manual_seed(p))
                  .bfloat16() for p in range(W)]
            ok.append(torch.equal(m.query_gather(qs[r]).double(), ref.gather_heads(qs)))

    return {"counts": _counted(rank, at_every_size), "ok": ok}


@pytest.mark.parametrize("warm", [True, False])
def test_vllm_manager_warms_every_capture_size_at_construction(fresh, vllm_config, warm,
                                                               monkeypatch, caplog):
    if not warm:
        monkeypatch.setenv(capture.SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="dcpc.engines"):
        found = LocalGroup(W, "cpu", timeout_s=300).run(
            lambda rank: _manager_rank(rank, vllm_config))
    for f in found:
        assert all(f["ok"]) and len(f["ok"]) == 2 * len(SIZES), f
    said = [r.getMessage() for r in caplog.records if "MLADCPManager: warmed" in r.getMessage()]
    if warm:
        assert found[0]["counts"] == NOTHING, found[0]["counts"]
        assert len(said) == W and all(f"sizes {SIZES}" in s for s in said), said
    else:
        assert found[0]["counts"]["plans"] > 0 and not said


def _first_use_rank(rank, cfg) -> dict:
    """The manager's W_UV-fused merge (its V-wide module: V is known at the first call
    only) and the Helix combine: each warms every capture size at its first call."""
    from dcpc.engines import helix
    from dcpc.engines import vllm as V

    r, v = rank.rank, 8
    m = V.MLADCPManager(cfg, "cpu", HEADS // W, D, D, torch.bfloat16, torch.bfloat16,
                        group=rank, max_num_tokens=8, num_ubatches=1, comm_backend="a2a",
                        backend="local")
    w_uv = torch.randn(HEADS, D, v, generator=torch.Generator().manual_seed(9)).bfloat16()

    def both(n: int, seed: int) -> list[bool]:
        outs, lses = _parts(seed, n)
        lens, qsl = torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32)
        into = torch.empty(n, HEADS // W * v, dtype=torch.bfloat16)
        m.v_up_proj_combine(outs[r], lses[r], w_uv, into, seq_lens=lens, query_start_loc=qsl)
        fused = ref.vllm_v_up_proj_combine(outs, lses, w_uv)[r]
        merged = helix.helix_alltoall_lse_reduce(outs[r], lses[r], rank)
        return [_close(into, fused), _close(merged, ref.vllm_combine(outs, lses)[r][0])]

    first = both(3, 99)  # vLLM's dummy run: not a capture size
    ok: list[bool] = []
    counts = _counted(rank, lambda: [ok.extend(both(n, n)) for n in SIZES])
    return {"counts": counts, "ok": first + ok}


@pytest.mark.parametrize("warm", [True, False])
def test_v_up_proj_combine_and_helix_warm_every_capture_size_at_first_use(
        fresh, vllm_config, warm, monkeypatch):
    """From 2 tokens up (the threshold lowered from vLLM's 8 to reach the capture sizes)
    the manager's v_up_proj_combine merges V-wide partials through a module of its own,
    built at its first call: that call warms every capture size, as the Helix combine's
    first call does (before: neither warmed; a capture would have compiled)."""
    from dcpc.engines import vllm_free as F

    monkeypatch.setattr(F, "V_UP_PROJ_FIRST_MIN_TOKENS", 2)
    if not warm:
        monkeypatch.setenv(capture.SWITCH, "0")
    found = LocalGroup(W, "cpu", timeout_s=300).run(
        lambda rank: _first_use_rank(rank, vllm_config))
    for f in found:
        assert all(f["ok"]) and len(f["ok"]) == 2 + 2 * len(SIZES), f
    if warm:
        assert found[0]["counts"] == NOTHING, found[0]["counts"]
    else:
        assert found[0]["counts"]["plans"] > 0


def _sglang_rank(rank) -> dict:
    from dcpc.engines import sglang as S

    r, ok = rank.rank, []
    outs, lses = _parts(0, 3)
    ok.append(_close(S.dcp_a2a_lse_reduce(outs[r], lses[r], rank),
                     ref.sglang_a2a(outs, lses)[r]))
    q = [torch.randn(3, HEADS // W, D + 8, generator=torch.Generator().manual_seed(p))
         .bfloat16() for p in range(W)]
    S.all_gather_q_for_mla_decode(q[r][..., 8:], q[r][..., :8], rank)

    def at_every_size() -> None:
        for n in [2, 4]:  # cuda_graph_bs 1, 2 x 2 draft tokens
            outs, lses = _parts(n, n)
            ok.append(_close(S.dcp_a2a_lse_reduce(outs[r], lses[r], rank),
                             ref.sglang_a2a(outs, lses)[r]))
            qs = [torch.randn(n, HEADS // W, D + 8,
                              generator=torch.Generator().manual_seed(10 * n + p)).bfloat16()
                  for p in range(W)]
            nope, pe = S.all_gather_q_for_mla_decode(qs[r][..., 8:], qs[r][..., :8], rank)
            full = ref.gather_heads(qs)
            ok.append(torch.equal(nope.double(), full[..., 8:])
                      and torch.equal(pe.double(), full[..., :8]))

    return {"counts": _counted(rank, at_every_size), "ok": ok}


def test_sglang_warms_its_graph_batch_sizes_and_sizes_its_workspace(fresh, monkeypatch,
                                                                     caplog):
    from dcpc.engines import sglang as S

    args = SimpleNamespace(cuda_graph_bs=[1, 2], cuda_graph_max_bs=2,
                           speculative_algorithm="EAGLE", speculative_num_draft_tokens=2)
    monkeypatch.setitem(sys.modules, "sglang", _module("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.srt", _module("sglang.srt"))
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", _module(
        "sglang.srt.server_args", get_global_server_args=lambda: args))
    monkeypatch.delenv("DCPC_MAX_NUM_TOKENS")
    monkeypatch.setattr(S, "_installed_tokens", [])
    with caplog.at_level(logging.INFO, logger="dcpc.engines"):
        S._choose(None)  # install()'s choice (its patching: tests/engines/test_engines_install.py)
        assert S._tokens() == 4  # the largest graph batch, 2 x 2 tokens
        found = LocalGroup(W, "cpu", timeout_s=300).run(_sglang_rank)
    said = [r.getMessage() for r in caplog.records]
    assert any("workspace is 4 tokens (SGLang's largest graph batch 2 x 2" in s
               and "capture sizes [2, 4]" in s for s in said), said
    for f in found:
        assert all(f["ok"]) and len(f["ok"]) == 1 + 2 * 2, f
    assert found[0]["counts"] == NOTHING, found[0]["counts"]


def test_plan_warms_up_to_the_workspace_and_one_size_above():
    assert capture.plan([1, 2, 4], 2) == ([1, 2, 4], [4])
    assert capture.plan([1, 2, 4, 8], 2) == ([1, 2, 4], [4, 8])
    assert capture.plan([1, 2, 4, 8], 8) == ([1, 2, 4, 8], [])


def test_like_keeps_the_layout_a_call_plan_sees():
    padded = torch.randn(5, 4, 24)[..., :16]  # a slice of a padded buffer
    lse_t = torch.randn(4, 5).t()  # FlashAttention's [H, T] LSE, transposed
    for t in (padded, lse_t, torch.randn(5, 4, 16)):
        for n in (2, 7):
            w = capture.like(t, n)
            assert w.shape == (n, *t.shape[1:]) and not w.any()
            assert capture.layout(w) == capture.layout(t), (t.stride(), w.stride())
    assert capture.like(padded, 3).stride() == padded.stride()
    with pytest.raises(Exception, match="DCPC_CAPTURE_SIZES='1,x'"):
        capture.parse_sizes("1,x", "DCPC_CAPTURE_SIZES")


def test_capture_warm_benchmark_dry_run(tmp_path, cache_dir, monkeypatch):
    """benchmarks/capture_warm.py --dry (CPU: eager calls in place of captures): the
    flow the GPU run takes, its counters at 0 after the warm-up, its files written."""
    import json

    from benchmarks.capture_warm import main

    monkeypatch.setenv("DCPC_CACHE_DIR", str(cache_dir))
    for name in ("DCPC_MAX_NUM_TOKENS", capture.SIZES_ENV, capture.SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(capture, "_done", {})
    monkeypatch.setattr(capture, "_fast", {})
    assert main(["--out", str(tmp_path), "--dry", "--worlds", "2", "--sizes", "2",
                 "--first", "1", "--heads", "2", "--dv", "16", "--dq", "16",
                 "--replays", "1"]) == 0
    got = json.loads((tmp_path / "capture_warm.json").read_text())
    assert got["ok"] and got["worlds"][0]["ranks"][0]["rows"][0]["capture"] == {
        "plans": 0, "allocations": 0, "compiles": 0, "triton": 0}
    assert "verdict: PASS" in (tmp_path / "capture_warm.md").read_text()
