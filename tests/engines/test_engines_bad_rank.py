"""One rank's bad argument fails the call on EVERY rank, in that call (issue 22: no
silent wrong data). It used to raise on that rank only, before any exchange: its peers
paired their call with its NEXT one and both returned wrong data without an error.

The bad rank still takes part in the call (dcpc.engines.combine.refuse): at a first
call (``agree`` runs) its settings carry the error and every peer raises naming it; at
a later call it makes an empty call (T = 0) through its module, and every peer raises a
contract error (T=0 on peer 1, "refused its arguments"); every call then raises until
``reset()``. Every rank refusing the same call leaves the modules usable (the
adapters' existing scenarios, tests/engines/test_engines_local.py).

Sequence per rank (rank 1 passes an int LSE in calls 0 and 2): 0 refused everywhere;
1 correct (float64 reference); 2 refused everywhere; 3 DcpcFailedError; reset; 4
correct. ``local`` (threads) at W = 2, 3; ``torch`` and ``host`` (processes) at W = 2."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from support.kernels import run_ranks

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host

BAD = "lse has dtype torch.int32"  # check_tensors' text for rank 1's argument
# a later call: the peers' contract error against rank 1's empty call; a rank may learn
# it from a peer that failed first (its failure flag is seen before the words: rank 1's
# own empty call fails on the peers' T > 0), except on the torch backend, whose
# handshake delivers every peer's message of the call before its failure notice
LATER = ("DcpcContractError", "DcpcPeerFailedError")
REFUSED_LATER = "T=0 on peer 1"


def _later(r: int, seen: str) -> None:
    """A peer's outcome of the call rank 1 refused later: the contract error against rank
    1's empty call (the only word of another call), or its failure flag seen first."""
    assert seen.split(":")[0] in LATER, (r, seen)
    if seen.startswith("DcpcContractError"):
        assert REFUSED_LATER in seen and "refused its arguments" in seen, (r, seen)
    else:
        assert f"rank {r} stopped waiting for peer " in seen, (r, seen)


def _inputs(seed: int, world: int, heads: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed)
    outs = [torch.randn(4, heads, 16, generator=g).bfloat16() for _ in range(world)]
    lses = [torch.randn(4, heads, generator=g) * 2 for _ in range(world)]
    return outs, lses


def calls(group: Any, r: int, world: int, fn: str, upto: int = 4) -> list[str]:
    """Each call's outcome on rank ``r``: 'ok' (matched float64), 'WRONG', or the error.
    ``fn``: vLLM's dcp_a2a_lse_reduce or its Helix all-to-all (the free functions: their
    first call on a group agrees on the settings)."""
    from dcpc.engines import reference as ref
    from dcpc.engines import vllm as V
    from dcpc.engines.helix import helix_alltoall_lse_reduce

    seen = []
    for c in range(upto + 1):
        if c == 4:
            V.reset(group)
        outs, lses = _inputs(10 + c, world, 2 * world)
        lse = lses[r].int() if r == 1 and c in (0, 2) else lses[r]
        try:
            if fn == "helix":
                got = helix_alltoall_lse_reduce(outs[r], lse, group)
            else:
                got = V.dcp_a2a_lse_reduce(outs[r], lse, group)
        except Exception as err:  # noqa: BLE001 - reported, then asserted on
            seen.append(f"{type(err).__name__}: {err}")
            continue
        want = ref.vllm_combine(outs, lses)[r][0]
        close = ((got.double() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all()
        seen.append("ok" if bool(close) else "WRONG")
    V.reset(group)
    return seen


def _check(found: list[list[str]], upto: int = 4, ordered: bool = False) -> None:
    for r, seen in enumerate(found):
        if r == 1:  # its own error, at once
            assert seen[0].startswith("DcpcArgumentError") and BAD in seen[0], (r, seen)
            assert seen[2].startswith("DcpcArgumentError") and BAD in seen[2], (r, seen)
        else:  # in the same call: the agreement names it; later, the contract error
            assert seen[0].startswith("DcpcArgumentError"), (r, seen)
            assert "rank 1 refused its arguments" in seen[0] and BAD in seen[0], (r, seen)
            _later(r, seen[2])
        assert seen[1] == "ok", (r, seen)
        if upto >= 3:
            assert seen[3].startswith("DcpcFailedError"), (r, seen)
        if upto >= 4:
            assert seen[4] == "ok", (r, seen)
    if ordered:  # torch: every peer's handshake meets rank 1's empty call first
        assert any(REFUSED_LATER in f[2] and "refused its arguments" in f[2] for f in found), \
            found


@pytest.mark.parametrize(("world", "fn"), [(2, "helix"), (3, "vllm")])
def test_local_bad_argument_on_one_rank_fails_every_rank(world, fn, tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    found = run_ranks(world, lambda rank: calls(rank, rank.rank, world, fn))
    _check(found)


def worker(rank: int, world: int, cache: str, backend: str) -> list[str]:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ["DCPC_CACHE_DIR"] = cache
    os.environ["DCPC_MAX_NUM_TOKENS"] = "8"
    os.environ["DCPC_BACKEND"] = backend
    return calls(dist.group.WORLD, rank, world, "vllm", upto=2)  # gloo: no reuse after


@pytest.mark.parametrize("backend", ["torch", "host"])
def test_processes_bad_argument_on_one_rank_fails_every_rank(backend):
    with tempfile.TemporaryDirectory(prefix="dcpc-bad-rank-") as cache:
        result = launch("test_engines_bad_rank:worker", 2, {"cache": cache, "backend": backend},
                        timeout_s=300, gloo_timeout_s=60)
    assert result.ok, result.summary()
    _check([o.value for o in result.outcomes], upto=2, ordered=backend == "torch")


def gathers(rank: Any, world: int, fn: str) -> list[str]:
    """The gathers: SGLang's query all-gather (rank 1: q_nope in another dtype in calls 0
    and 2) or the vLLM manager's (rank 1: a meta query in calls 0 and 2; the manager
    agreed at construction, so call 0 already fails its modules)."""
    from dcpc.engines import reference as ref
    from dcpc.engines import sglang as S
    from dcpc.engines import vllm as V

    r, seen = rank.rank, []
    m = V.MLADCPManager(None, "cpu", 2, 16, 16, torch.bfloat16, torch.bfloat16,
                        group=rank, max_num_tokens=8, num_ubatches=1, comm_backend="a2a",
                        backend="local") if fn == "manager" else None
    for c in range(4):
        g = torch.Generator().manual_seed(20 + c)
        nope = [torch.randn(3, 2, 16, generator=g).bfloat16() for _ in range(world)]
        pe = [torch.randn(3, 2, 8, generator=g).bfloat16() for _ in range(world)]
        bad = r == 1 and c in (0, 2)
        try:
            if m is None:
                got = torch.cat(S.all_gather_q_for_mla_decode(
                    nope[r].float() if bad else nope[r], pe[r], rank), dim=-1)
                want = torch.cat([ref.gather_heads(nope), ref.gather_heads(pe)], dim=-1)
            else:
                got = m.query_gather(nope[r].to("meta") if bad else nope[r])
                want = ref.gather_heads(nope)
        except Exception as err:  # noqa: BLE001 - reported, then asserted on
            seen.append(f"{type(err).__name__}: {err}")
            continue
        seen.append("ok" if bool((got.double() == want).all()) else "WRONG")
    V.reset(rank)
    return seen


@pytest.mark.parametrize(("world", "fn"), [(2, "sglang"), (3, "manager")])
def test_local_bad_gather_argument_on_one_rank_fails_every_rank(world, fn, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    found = run_ranks(world, lambda rank: gathers(rank, world, fn))
    bad = "must agree in tokens, heads and dtype" if fn == "sglang" else "is a meta tensor"
    for r, seen in enumerate(found):
        if r == 1:
            assert seen[0].startswith("DcpcArgumentError") and bad in seen[0], (r, seen)
            assert seen[2].startswith("DcpcArgumentError") and bad in seen[2], (r, seen)
        elif fn == "sglang":  # a first call: the agreement names rank 1's error
            assert "rank 1 refused its arguments" in seen[0] and bad in seen[0], (r, seen)
            _later(r, seen[2])
        else:
            _later(r, seen[0])
        if fn == "sglang":
            assert seen[1] == "ok", (r, seen)
        assert seen[3].startswith("DcpcFailedError"), (r, seen)
