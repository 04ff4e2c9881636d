"""A wait refuses a signal from a failed instance (issue 22, item 1).

Ranks 0..W-2 time out in out_exchange because the last rank arrives late; they fail and
set their failure flags. The late rank then reaches out_exchange, where the failed
peers' signals of that very call are already there. The old wait accepted them and the
call passed silently on the late rank while every peer raised; it must raise
DcpcPeerFailedError naming the first failed peer instead. Host backend, W = 2 and 3.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from support.kernels import SCHEDULES, compile_file
from test_guard import _class

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host

# the survivors' wait, in CPU seconds of the waiting thread (the CPU watchdog: progress,
# not wall time; many more wall seconds on a loaded machine). Every call before the late
# one must pass in it: the most one took (calls 0 and 1 on time, W = 2 and 3, a 2-core
# machine at load 4) was 1.6 s of CPU; each survivor spins all of it out in call 1
TIMEOUT_S = 6.0
# at most: the late rank goes on once its peers failed and flagged
LATE_S = 600.0
SIZES = {"H": 6, "T": 8, "B": 8}  # H: a multiple of W = 2 and 3


def _inputs(call: int, rank: int, world: int, T: int) -> dict[str, Any]:
    import torch

    H = SIZES["H"]

    def rand(*shape: int, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    return {
        "q_local": rand(T, H // world, 576, seed=1000 * call + rank).bfloat16(),
        "o_part": rand(T, H, 512, seed=2000 * call + rank).bfloat16(),
        "lse_part": rand(T, H, seed=3000 * call + rank),
        "seq_lens": torch.full((T,), 64, dtype=torch.int32),
        "query_start_loc": torch.arange(T + 1, dtype=torch.int32),
    }


def late_rank_worker(rank: int, world: int, path: str, failed: str) -> dict[str, Any]:
    import torch.distributed as dist

    cls = _class(path)
    m = cls(dist.group.WORLD, sizes=SIZES, device="cpu", backend="host", poison=True,
            timeout_s=TIMEOUT_S)
    late = rank == world - 1
    x = _inputs(0, rank, world, 2)
    m.query_gather(x["q_local"])
    m.out_exchange(x["o_part"], x["lse_part"])
    m.merge(x["seq_lens"], x["query_start_loc"])  # call 0: every rank on time
    x = _inputs(1, rank, world, 2)
    m.query_gather(x["q_local"])
    if late:  # until every peer has failed (each leaves ``failed.<rank>``), LATE_S at most
        until = time.monotonic() + LATE_S
        while time.monotonic() < until and not all(
                os.path.exists(f"{failed}.{r}") for r in range(world - 1)):
            time.sleep(0.2)
    try:
        m.out_exchange(x["o_part"], x["lse_part"])
        m.merge(x["seq_lens"], x["query_start_loc"])
        return {"error": ("none", "out_exchange and merge of call 1 raised nothing")}
    except Exception as exc:  # noqa: BLE001 (the test asserts on it)
        if not late:  # raised, so its failure flag is set
            open(f"{failed}.{rank}", "w").close()
        return {"error": (type(exc).__name__, str(exc)),
                "fields": [getattr(exc, k, None) for k in ("step", "peer", "epoch")]}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    return str(compile_file(SCHEDULES / "kimi_k3_dcp.yaml", tmp_path_factory.mktemp("fp")))


@pytest.mark.parametrize("world", [2, 3])
def test_a_wait_refuses_the_signal_of_a_failed_peer(kimi: str, world: int, tmp_path) -> None:
    result = launch("test_failed_peer:late_rank_worker", world,
                    {"path": kimi, "failed": str(tmp_path / "failed")},
                    timeout_s=LATE_S + 240)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    *early, last = result.values()
    for r, got in enumerate(early):
        assert got["error"][0] == "DcpcTimeoutError", (r, got)
        assert f"rank {r} timed out waiting for peer {world - 1}" in got["error"][1], got
    print(last)
    assert last["error"][0] == "DcpcPeerFailedError", last
    assert last["fields"] == ["out_exchange", 0, 2], last
    assert (f"step 'out_exchange': rank {world - 1} stopped waiting for peer 0 (epoch 2): "
            "peer 0 failed") in last["error"][1], last
