"""Every rank of an adapter call takes the same path (dcpc kernel or fallback) or every
rank fails loudly, and the failed state has a way out (dcpc.engines.agree, combine.reset):

- settings that differ between ranks (the workspace, a switch) raise on every rank,
  naming the setting and each rank's value;
- a call over the workspace on one rank only (its peer runs the kernel) raises a
  contract error on both ranks; it used to pair the kernel rank's wait with the
  fallback rank's NEXT call, and a later ordinary call returned wrong data, no error;
- after such an error every call raises ``DcpcFailedError`` until ``reset()`` on every
  rank; then calls are correct again (float64 reference);
- meta tensors and integer LSEs are refused with an argument error.

``local`` backend (threads) at W = 2 and 3, ``torch`` backend (gloo processes) at W = 2
and 3."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from support.kernels import run_ranks

from dcpc.harness.launch import launch
from dcpc.runtime.errors import DcpcArgumentError

pytestmark = pytest.mark.host

WORKSPACE = 8


def _inputs(seed: int, world: int, tokens: int, heads: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(tokens, heads, 16, generator=g).bfloat16() for _ in range(world)]
    lses = [torch.randn(tokens, heads, generator=g) * 2 for _ in range(world)]
    return outs, lses


def _outcome(fn: Any) -> str:
    """'ok', or the error's type and message."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported, then asserted on
        return f"{type(err).__name__}: {err}"
    return "ok"


def diverging_tokens(group: Any, r: int, world: int, backend: str, recover: bool = True
                     ) -> dict[str, Any]:
    """Rank 0's call is over the workspace, the peers' are not; then ordinary calls;
    then (``recover``) reset() and an ordinary call against float64."""
    from dcpc.engines import reference as ref
    from dcpc.engines import vllm as V

    heads = 2 * world
    m = V.MLADCPManager(None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16, group=group,
                        max_num_tokens=WORKSPACE, num_ubatches=1, comm_backend="a2a",
                        backend=backend)
    tokens = WORKSPACE + 4 if r == 0 else 5
    outs, lses = _inputs(1, world, tokens, heads)
    found = {"diverging": _outcome(lambda: m.combine(outs[r], lses[r], seq_lens=None,
                                                     query_start_loc=None))}
    outs, lses = _inputs(2, world, 5, heads)
    found["next call"] = _outcome(lambda: m.combine(outs[r], lses[r], seq_lens=None,
                                                    query_start_loc=None))
    if not recover:
        return found
    found["closed"] = V.reset(group)
    m = V.MLADCPManager(None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16, group=group,
                        max_num_tokens=WORKSPACE, num_ubatches=1, comm_backend="a2a",
                        backend=backend)
    got = m.combine(outs[r], lses[r], seq_lens=None, query_start_loc=None)
    want = ref.vllm_combine(outs, lses)[r][0]
    found["after reset"] = bool(((got.double() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())
    V.reset(group)
    return found


def diverging_workspace(group: Any, r: int, world: int, backend: str) -> str:
    from dcpc.engines import vllm as V

    return _outcome(lambda: V.MLADCPManager(
        None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16, group=group,
        max_num_tokens=WORKSPACE + r, num_ubatches=1, comm_backend="a2a", backend=backend))


def _assert_diverging_tokens(found: list[dict[str, Any]], recover: bool = True) -> None:
    explained = 0  # a rank may learn it from a peer that failed first
    for r, f in enumerate(found):
        assert f["diverging"].split(":")[0] in ("DcpcContractError", "DcpcPeerFailedError"), \
            (r, f)
        explained += "T=0" in f["diverging"] and "took the fallback" in f["diverging"]
        assert f["next call"].startswith("DcpcFailedError"), (r, f)
        assert not recover or (f["closed"] >= 1 and f["after reset"] is True), (r, f)
    assert explained >= 1, found


def _assert_diverging_workspace(found: list[str]) -> None:
    for r, f in enumerate(found):
        assert f.startswith("DcpcArgumentError") and "workspace tokens" in f, (r, f)
        assert all(f"{WORKSPACE + p}' on rank {p}" in f for p in range(len(found))), (r, f)


@pytest.mark.parametrize("world", [2, 3])
def test_local_one_rank_over_the_workspace_fails_every_rank_then_reset(world, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    found = run_ranks(world,
        lambda rank: diverging_tokens(rank, rank.rank, world, "local"))
    _assert_diverging_tokens(found)


@pytest.mark.parametrize("world", [2, 3])
def test_local_different_workspaces_are_refused_on_every_rank(world, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    found = run_ranks(world,
        lambda rank: diverging_workspace(rank, rank.rank, world, "local"))
    _assert_diverging_workspace(found)


def worker(rank: int, world: int, cache: str) -> dict[str, Any]:
    """The torch backend: disagreeing settings first (refused before any module call),
    the diverging call last: after a failed call gloo may have closed the connection
    (a timed-out failure notice), so the group is not reused (docs/engines.md)."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ["DCPC_CACHE_DIR"] = cache
    pg = dist.group.WORLD
    from dcpc.engines import vllm as V

    if rank == 0:  # a switch set on one rank only
        os.environ["VLLM_USE_DIRECT_DCP_A2A"] = "0"
    outs, lses = _inputs(3, world, 4, 2 * world)
    found = {"switch": _outcome(lambda: V.dcp_a2a_lse_reduce(outs[rank], lses[rank], pg))}
    os.environ.pop("VLLM_USE_DIRECT_DCP_A2A", None)
    found["workspace"] = diverging_workspace(pg, rank, world, "torch")
    found["tokens"] = diverging_tokens(pg, rank, world, "torch", recover=False)
    return found


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One module cache for this file's launches: the first launch's ranks compile
    every schedule (side by side, written atomically), the later ones import them."""
    return str(tmp_path_factory.mktemp("dcpc-engines-"))


@pytest.mark.parametrize("world", [2, 3])
def test_torch_backend_paths_agree_or_fail_on_every_rank(world, cache):
    result = launch("test_engines_paths:worker", world, {"cache": cache},
                    timeout_s=300, gloo_timeout_s=60)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    found = result.values()
    _assert_diverging_tokens([f["tokens"] for f in found], recover=False)
    _assert_diverging_workspace([f["workspace"] for f in found])
    for r, f in enumerate(found):
        assert f["switch"].startswith("DcpcArgumentError"), (r, f)
        assert "VLLM_USE_DIRECT_DCP_A2A: 'off' on rank 0, 'auto' on rank 1" in f["switch"]


@pytest.mark.parametrize("bad", ["meta out", "meta lse", "int32 lse", "int64 out"])
def test_meta_tensors_and_integer_lses_are_refused(bad):
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V

    out, lse = torch.randn(3, 4, 8).bfloat16(), torch.randn(3, 4)
    if bad == "meta out":
        out = out.to("meta")
    elif bad == "meta lse":
        lse = lse.to("meta")
    elif bad == "int32 lse":
        lse = lse.to(torch.int32)
    else:
        out = out.to(torch.int64)
    calls = [lambda: V.dcp_a2a_lse_reduce(out, lse, None),
             lambda: V.cp_lse_ag_out_rs(out, lse, None),
             lambda: V.cp_lse_ag_out_ar(out, lse, None),
             lambda: S.cp_lse_ag_out_rs_mla(out, lse, None)]
    for call in calls:
        with pytest.raises(DcpcArgumentError, match="meta tensor|must be floats"):
            call()
