"""DCPC_DEBUG_VIEWS=1: the adapters hand out copies and poison them (NaN) at the next
call of the same module and slot, so an engine that keeps a result past the next call
sees NaN at once instead of the next call's values (the ``local`` backend, W = 2 and 3,
against float64)."""

from __future__ import annotations

import pytest
import torch
from support.kernels import run_ranks


def _inputs(seed: int, world: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(3, 2 * world, 16, generator=g).bfloat16() for _ in range(world)]
    lses = [torch.randn(3, 2 * world, generator=g) * 2 for _ in range(world)]
    return outs, lses


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got.double() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())


def kept_results(rank, world: int) -> dict[str, bool]:
    from dcpc.engines import reference as ref
    from dcpc.engines import vllm as V

    r = rank.rank
    found = {}
    for fn in (V.dcp_a2a_lse_reduce, V.cp_lse_ag_out_rs):
        outs, lses = _inputs(1, world)
        first = fn(outs[r], lses[r], rank)
        found[f"{fn.__name__} first"] = _close(first, ref.vllm_combine(outs, lses)[r][0])
        rank.barrier()
        outs2, lses2 = _inputs(2, world)
        second = fn(outs2[r], lses2[r], rank)
        found[f"{fn.__name__} second"] = _close(second, ref.vllm_combine(outs2, lses2)[r][0])
        found[f"{fn.__name__} kept first is NaN"] = bool(torch.isnan(first).all())
        found[f"{fn.__name__} kept first is the second"] = bool(torch.equal(first, second))
        rank.barrier()
    m = V.MLADCPManager(None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16, group=rank,
                        max_num_tokens=8, num_ubatches=1, comm_backend="a2a",
                        backend="local")
    qs = [torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(p)).bfloat16()
          for p in range(world)]
    q_first = m.query_gather(qs[r])
    found["q first"] = torch.equal(q_first.double(), ref.gather_heads(qs))
    rank.barrier()
    m.query_gather(qs[(r + 1) % world])
    found["q kept first is NaN"] = bool(torch.isnan(q_first).all())
    rank.barrier()
    return found


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("debug", [True, False])
def test_debug_views_poison_what_an_engine_keeps(world, debug, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    if debug:
        monkeypatch.setenv("DCPC_DEBUG_VIEWS", "1")
    else:
        monkeypatch.delenv("DCPC_DEBUG_VIEWS", raising=False)
    found = run_ranks(world, lambda rank: kept_results(rank, world))
    from dcpc.engines import combine

    combine.reset()  # every rank's thread is done: close this test's modules
    for r, f in enumerate(found):
        for fn in ("dcp_a2a_lse_reduce", "cp_lse_ag_out_rs"):
            assert f[f"{fn} first"] and f[f"{fn} second"], (r, f)
            # debug: the kept result is poisoned; without it, it is a view of the
            # module's buffer and silently shows the next call's values
            assert f[f"{fn} kept first is NaN"] == debug, (r, f)
            assert f[f"{fn} kept first is the second"] == (not debug), (r, f)
        assert f["q first"] and f["q kept first is NaN"] == debug, (r, f)
