"""The host-side guard against silent wrong data (issue 22, items 2-6), in real processes.

Each case runs W = 2 and 3 ranks (gloo + shared memory, the Triton interpreter) on the
host backend and on the torch backend where it applies, and asserts that every call
either returns exactly the right data or raises a DcpcError that names what happened.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import pytest
from test_kernels_helpers import SCHEDULES, compile_file, load, the_class

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host

N = 4  # kv_gather rows per rank
WAIT_S = 30.0  # the module's timeout: every error below must come long before it


def _class(path: str) -> type:
    warnings.filterwarnings("ignore")
    os.environ["TRITON_INTERPRET"] = "1"
    return the_class(load(path))


def _rows(call: int, rank: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(N, 576, generator=g).bfloat16()


def _gathered(call: int, world: int) -> Any:
    """kv_full of call ``call``: row j of rank r at row j * W + r (interleave 1)."""
    import torch

    return torch.stack([_rows(call, r) for r in range(world)], dim=1).reshape(N * world, 576)


def _error(exc: BaseException) -> tuple[str, str, bool]:
    from dcpc.runtime import DcpcError

    return type(exc).__name__, str(exc), isinstance(exc, DcpcError)


@pytest.fixture(scope="module")
def kv_gather(tmp_path_factory) -> str:
    return str(compile_file(SCHEDULES / "kv_gather.yaml", tmp_path_factory.mktemp("kv")))


# ---- item 3: two threads on one instance ------------------------------------------------


def concurrent_worker(rank: int, world: int, path: str, backend: str) -> dict[str, Any]:
    """Rank 0: thread A's kv_gather waits for the (late) peers; meanwhile the main thread
    calls kv_gather on the same instance. Every call returns the right rows or raises."""
    import torch.distributed as dist

    m = _class(path)(dist.group.WORLD, sizes={"N": N}, device="cpu", backend=backend,
                     poison=True, timeout_s=WAIT_S)
    got: dict[str, Any] = {}

    def call(who: str, k: int) -> None:
        try:
            out = m.kv_gather(_rows(k, rank))
            got[who] = ("ok", bool(out.equal(_gathered(k, world))))
        except Exception as exc:  # noqa: BLE001 (the test asserts on it)
            got[who] = _error(exc)

    if rank == 0:
        first = threading.Thread(target=call, args=("A", 0), name="engine-A")
        first.start()
        time.sleep(1.0)  # A is inside kv_gather, waiting for the peers
        threading.current_thread().name = "engine-B"
        start = time.monotonic()
        call("B", 0)
        got["B_s"] = time.monotonic() - start
        first.join(WAIT_S + 30)
    else:
        time.sleep(3.0)
        call("A", 0)
    m.close()
    return got


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["host", "torch"])
def test_two_threads_on_one_instance_raise_never_wrong_data(kv_gather: str, backend: str,
                                                             world: int) -> None:
    result = launch("test_guard_runtime:concurrent_worker", world,
                    {"path": kv_gather, "backend": backend}, timeout_s=240)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    for rank, got in enumerate(result.values()):
        print(rank, got)
        for who in ("A", "B"):
            if who not in got:
                continue
            if got[who][0] == "ok":
                assert got[who][1], f"rank {rank} thread {who}: wrong data, no error"
            else:
                assert got[who][2], f"rank {rank} thread {who}: not a DcpcError: {got[who]}"
    kind, message, _ = result.values()[0]["B"]
    assert kind == "DcpcConcurrentUseError", message
    assert ("kv_gather(slot=0) on thread 'engine-B': this KvGather instance is already in "
            "kv_gather(slot=0) on thread 'engine-A'") in message, message
    assert result.values()[0]["B_s"] < 5.0  # refused at once, not after a wait
