"""The run-time guard of the call contract, at two ranks in real processes (issue 12).

Each contract violation ends in a clear error on BOTH ranks within seconds, never in
wrong data, a hang or a crash; later calls raise DcpcFailedError. Host backend
(Triton interpreter, shared memory) and torch backend (gloo). Every call before the
violation is checked against the expected gather and a float64 merge.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
from support.kernels import SCHEDULES, compile_file, load, the_class

from dcpc.harness.launch import launch

pytestmark = pytest.mark.host

SIZES = {"H": 4, "T": 8, "B": 8}
WAIT_S = 60.0  # the module's timeout: every error below must come long before it
FAST_S = 15.0  # "within seconds" (the interpreter on a shared 2-core machine is slow)


def _class(path: str) -> type:
    warnings.filterwarnings("ignore")
    os.environ["TRITON_INTERPRET"] = "1"
    return the_class(load(path))


def _inputs(call: int, rank: int, world: int, T: int) -> dict[str, Any]:
    import torch

    H, heads = SIZES["H"], SIZES["H"] // world

    def rand(*shape: int, seed: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    q = [rand(T, heads, 576, seed=1000 * call + r).bfloat16() for r in range(world)]
    o = [rand(T, H, 512, seed=2000 * call + r).bfloat16() for r in range(world)]
    lse = [rand(T, H, seed=3000 * call + r) for r in range(world)]
    return {
        "q_local": q[rank], "q_want": torch.cat(q, dim=1), "o_part": o[rank],
        "lse_part": lse[rank], "o_all": torch.stack(o), "lse_all": torch.stack(lse),
        "seq_lens": torch.full((T,), 64, dtype=torch.int32),  # no empty shard
        "query_start_loc": torch.arange(T + 1, dtype=torch.int32),  # one row per request
    }


def _call(m: Any, rank: int, world: int, call: int, T: int, skip: str = "",
          bad_argument: bool = False, exchange_T: int = 0) -> list[str]:
    """One full call (slot = call % 2); returns what did not match. ``exchange_T``:
    the partials of out_exchange have that many rows instead (another T)."""
    import torch

    from dcpc.runtime import merge

    x = _inputs(call, rank, world, T)
    if exchange_T:
        x.update({k: v for k, v in _inputs(call, rank, world, exchange_T).items()
                  if k in ("o_part", "lse_part")})
    slot, wrong = call % 2, []
    q_local = x["q_local"].float() if bad_argument else x["q_local"]
    if not torch.equal(m.query_gather(q_local, slot=slot), x["q_want"]):
        wrong.append(f"call {call}: q_full")
    if skip != "out_exchange":
        m.out_exchange(x["o_part"], x["lse_part"], slot=slot)
    out = m.merge(x["seq_lens"], x["query_start_loc"], slot=slot)
    heads = slice(rank * SIZES["H"] // world, (rank + 1) * SIZES["H"] // world)
    want, _ = merge.lse_combine(x["o_all"][:, :, heads].double(),
                                x["lse_all"][:, :, heads].double(), "e", None)
    want = want.double()
    if not torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2):
        wrong.append(f"call {call}: out off by {float((out.double() - want).abs().max()):.3g}")
    return wrong


def violation_worker(rank: int, world: int, path: str, backend: str,
                     violation: str) -> dict[str, Any]:
    """Two good calls, then ``violation`` at call 2, then one more call attempt."""
    import torch.distributed as dist

    cls = _class(path)
    # out_exchange: one program per row, up to 8: ranks with another T launch another grid
    m = cls(dist.group.WORLD, sizes=SIZES, device="cpu", backend=backend, poison=True,
            timeout_s=WAIT_S, tuning={"out_exchange": {"programs": 8}})
    wrong = _call(m, rank, world, 0, 4) + _call(m, rank, world, 1, 6)
    if violation == "close" and rank == 0:
        m.close()
    start = time.monotonic()
    try:
        if violation == "argument":
            wrong += _call(m, rank, world, 2, 4, bad_argument=rank == 0)
        elif violation == "sizes":  # rank 0 binds T=5, rank 1 T=3
            wrong += _call(m, rank, world, 2, 5 if rank == 0 else 3)
        elif violation == "grids":  # the same query, partials of 5 rows here, 3 there
            wrong += _call(m, rank, world, 2, 4, exchange_T=5 if rank == 0 else 3)
        elif violation == "skip":
            wrong += _call(m, rank, world, 2, 4, skip="out_exchange" if rank == 1 else "")
        else:
            wrong += _call(m, rank, world, 2, 4)
        error = ("none", "the violation raised nothing")
    except Exception as exc:  # noqa: BLE001 (the test asserts on it)
        error = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    try:
        _call(m, rank, world, 3, 4)
        after = ("none", "the call after the violation raised nothing")
    except Exception as exc:  # noqa: BLE001
        after = (type(exc).__name__, str(exc))
    return {"wrong": wrong, "error": error, "elapsed": elapsed, "after": after}


# what each rank raises: (exception type, regex of its message)
EXPECTED = {
    "argument": [
        ("DcpcArgumentError", r"query_gather\(\): argument 'q_local' has dtype torch.float32"),
        ("DcpcPeerFailedError", r"step 'query_gather': rank 1 stopped waiting for peer 0 "
                                r"\(epoch 2\): peer 0 failed"),
    ],
    "sizes": [
        ("DcpcContractError", r"step 'query_gather': rank 0's call differs from peer 1's: "
                              r"T=5 here, T=3 on peer 1 \(epoch 2\)"),
        ("DcpcContractError", r"step 'query_gather': rank 1's call differs from peer 0's: "
                              r"T=3 here, T=5 on peer 0 \(epoch 2\)"),
    ],
    "grids": [  # programs 3 and 4 of rank 0 have no twin on rank 1: they stop at once too
        ("DcpcContractError", r"step 'out_exchange': rank 0's call differs from peer 1's: "
                              r"T=5 here, T=3 on peer 1 \(epoch 2\)"),
        ("DcpcContractError", r"step 'out_exchange': rank 1's call differs from peer 0's: "
                              r"T=3 here, T=5 on peer 0 \(epoch 2\)"),
    ],
    "skip": [  # rank 1 fails on the host as it calls merge(); rank 0 may still be in
        # query_gather's wait then, which refuses a failed peer's signal even when it
        # arrived (templates/sync.j2), so it names that step: never wrong data
        ("DcpcPeerFailedError", r"step '(query_gather|out_exchange)': rank 0 stopped waiting "
                                r"for peer 1 \(epoch 2\): peer 1 failed"),
        ("DcpcContractError", r"step 'merge': called before out_exchange\(\) in this call "
                              r"of slot 0; per call, every rank runs query_gather\(\) -> "
                              r"out_exchange\(\) -> merge\(\)"),
    ],
    "close": [
        ("DcpcFailedError", r"query_gather\(\): this KimiK3Dcp instance was closed"),
        ("DcpcPeerFailedError", r"step 'query_gather': rank 1 stopped waiting for peer 0 "
                                r"\(epoch 2\): peer 0 (was closed|failed)"),
    ],
}


# Host backend, where both ranks detect the violation (their words meet): a rank may see
# the peer's failure flag, set as that peer raised its own contract error, before the
# peer's word (a wait refuses a flagged peer first, templates/sync.j2). On the torch
# backend the handshake's messages come in order: both ranks name the contract.
PEER_FIRST = {
    "sizes": r"step 'query_gather': rank {rank} stopped waiting for peer {peer} \(epoch 2\): "
             r"peer {peer} failed",
    "grids": r"step 'out_exchange': rank {rank} stopped waiting for peer {peer} \(epoch 2\): "
             r"peer {peer} failed",
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> str:
    return str(compile_file(SCHEDULES / "kimi_k3_dcp.yaml", tmp_path_factory.mktemp("guard")))


@pytest.mark.parametrize("backend", ["host", "torch"])
@pytest.mark.parametrize("violation", list(EXPECTED))
def test_a_contract_violation_fails_both_ranks_at_once(kimi: str, backend: str,
                                                       violation: str) -> None:
    result = launch("test_guard:violation_worker", 2,
                    {"path": kimi, "backend": backend, "violation": violation}, timeout_s=240)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    import re

    for rank, (got, (kind, pattern)) in enumerate(zip(result.values(), EXPECTED[violation],
                                                      strict=True)):
        print(f"rank {rank}: {got['error'][0]} after {got['elapsed']:.1f} s: {got['error'][1]}")
        assert got["wrong"] == [], got["wrong"]  # never wrong data
        if (backend == "host" and violation in PEER_FIRST
                and got["error"][0] == "DcpcPeerFailedError"):  # the peer raised first
            kind, pattern = got["error"][0], PEER_FIRST[violation].format(rank=rank,
                                                                          peer=1 - rank)
        assert got["error"][0] == kind, got["error"]
        assert re.search(pattern, got["error"][1]), got["error"][1]
        assert got["elapsed"] < FAST_S, f"rank {rank} took {got['elapsed']:.1f} s"
        assert got["after"][0] == "DcpcFailedError", got["after"]
        assert re.search(r"(failed earlier|was closed)", got["after"][1]), got["after"][1]
    if violation in PEER_FIRST:  # the first rank to raise names the contract
        assert any(got["error"][0] == "DcpcContractError" for got in result.values()), \
            result.values()


def absent_peer_worker(rank: int, world: int, path: str, backend: str,
                       wait_s: float, done: str) -> dict[str, Any]:
    """Rank 1 constructs, then stays away, alive, until rank 0 has given up (the file
    ``done``; 600 s at most): rank 0's wait counts its own CPU time, so on a loaded
    machine it ends later than wait_s wall seconds, and a rank that exits is named dead."""
    import os

    import torch
    import torch.distributed as dist

    cls = _class(path)
    m = cls(dist.group.WORLD, sizes={"N": 4}, device="cpu", backend=backend, timeout_s=wait_s)
    if rank == 1:
        until = time.monotonic() + 600
        while time.monotonic() < until and not os.path.exists(done):
            time.sleep(0.2)
        return {}
    start = time.monotonic()
    try:
        m.kv_gather(torch.randn(4, 576).bfloat16())
        return {"error": ("none", "")}
    except Exception as exc:  # noqa: BLE001
        return {"error": (type(exc).__name__, str(exc)), "elapsed": time.monotonic() - start,
                "fields": [getattr(exc, k, None) for k in ("step", "peer", "epoch")]}
    finally:
        open(done, "w").close()


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_waits_are_bounded_in_seconds_and_name_step_peer_and_epoch(tmp_path,
                                                                   backend: str) -> None:
    path = str(compile_file(SCHEDULES / "kv_gather.yaml", tmp_path))
    wait_s = 2.0
    result = launch("test_guard:absent_peer_worker", 2,
                    {"path": path, "backend": backend, "wait_s": wait_s,
                     "done": str(tmp_path / "done")}, timeout_s=900)
    assert result.ok, result.summary() + "".join(o.traceback for o in result.outcomes)
    got = result.values()[0]
    print(got)
    assert got["error"][0] == "DcpcTimeoutError", got
    assert got["fields"] == ["kv_gather", 1, 1], got
    assert "step 'kv_gather': rank 0 timed out waiting for peer 1 to signal epoch 1 " \
           "(waited 2 s, timeout_s)" in got["error"][1]
    assert wait_s - 0.1 <= got["elapsed"] < wait_s + 10, got["elapsed"]


# ---- one rank: the guard's parts, and run-time argument errors (issue 13, item 7) -------


def test_fingerprints_carry_the_sizes_exactly() -> None:
    from dcpc.runtime.sync import Fingerprints, pack

    fps = Fingerprints({"gather": ["T"], "combine": ["B", "T"], "sync": []},
                       {"T": 512, "B": 256}, "bbcd6933" + "0" * 56)
    here, there = fps.of("combine", {"T": 5, "B": 2}), fps.of("combine", {"T": 3, "B": 2})
    assert here != there and 0 <= here < 2**31 and 0 <= there < 2**31
    assert fps.decode("combine", here) == {"B": 2, "T": 5}
    assert fps.differ("combine", here, there, 1) == "T=5 here, T=3 on peer 1"
    assert fps.of("sync", {}) == fps.of("sync", {"T": 9})  # a signal and its wait agree
    other = Fingerprints({"gather": ["T"]}, {"T": 512}, "12345678" + "0" * 56)
    assert other.of("gather", {"T": 5}) != fps.of("gather", {"T": 5})  # another schedule
    assert "another schedule" in fps.differ("gather", fps.of("gather", {"T": 5}),
                                            other.of("gather", {"T": 5}), 0)
    huge = Fingerprints({"s": ["A", "B", "C"]}, {"A": 2**20, "B": 2**20, "C": 2**20}, "ab")
    assert huge.of("s", {"A": 1}) != huge.of("s", {"A": 2})  # hashed, still compared
    assert huge.decode("s", huge.of("s", {"A": 1})) is None
    assert pack(7, -1) == (7 << 32) | 0xFFFFFFFF and pack(-1, 3) < 0  # the failed marker


def test_call_order_is_checked_per_slot() -> None:
    from dcpc.runtime import DcpcContractError
    from dcpc.runtime.guard import CallOrder

    order = CallOrder(["gather", "exchange", "merge"], slots=2)
    order.enter("gather", 0)
    order.enter("gather", 1)
    order.enter("exchange", 1)
    order.enter("exchange", 0)
    order.enter("exchange", 0)  # again in the same call: allowed (benchmarks loop a step)
    order.enter("merge", 0)
    order.enter("gather", 0)
    with pytest.raises(DcpcContractError, match=r"'merge': called before exchange\(\) in "
                                                r"this call of slot 0"):
        order.enter("merge", 0)
    with pytest.raises(DcpcContractError, match=r"called before gather\(\), exchange\(\)"):
        CallOrder(["gather", "exchange", "merge"], 1).enter("merge", 0)


@pytest.fixture(scope="module")
def kimi_class(kimi: str) -> type:
    return _class(kimi)


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_constructor_arguments_are_refused_by_name(kimi_class: type, backend: str) -> None:
    import torch

    from dcpc.runtime import DcpcArgumentError

    def make(**kw: Any) -> Any:
        return kimi_class(None, **{"sizes": {"H": 2}, "backend": backend, **kw})

    cases = [
        ({"sizes": "T"}, r"sizes must be a dict of size names to ints"),
        ({"device": "meta"}, r"device meta is not supported; generated modules run on 'cpu'"),
        ({"device": "cpu:1"}, r"device cpu:1 does not exist; the CPU is device 'cpu'"),
        ({"device": "gpu"}, r"device 'gpu' is not a device"),
        ({"device": 3}, r"device must be 'cpu', 'cuda', 'cuda:<index>' or a torch.device"),
        ({"tuning": {"query_gather": {"warps": 4}}}, r"tuning\['query_gather'\] has unknown "
                                                     r"knob 'warps'; the knobs are programs"),
        ({"tuning": {"query_gather": {"num_warps": 3}}}, r"num_warps'\] must be a power of "
                                                         r"two 1..32 \(warps per program\)"),
        ({"tuning": {"query_gather": {"block": 0}}}, r"block'\] must be a power of two "
                                                     r"1..65536"),
        ({"tuning": {"attention": {}}}, r"tuning for unknown step 'attention'"),
        ({"tuning": {"merge": {"programs": True}}}, r"programs'\] must be"),
        ({"programs": 0}, r"programs must be 1..1024"),
        ({"timeout_s": 0}, r"timeout_s \(seconds\) must be a number in 0.001..1e\+07"),
        ({"timeout_s": "60"}, r"timeout_s"),
        ({"guard": "yes"}, r"guard must be True or False"),
        ({"handshake": 1}, r"handshake must be True or False"),
        ({"backend": "nccl"}, r"backend must be one of auto, symm_mem, host, torch"),
        ({"backend": "symm_mem"}, r"backend 'symm_mem' needs a CUDA device, got cpu; on CPU "
                                  r"use backend 'host'"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, r"device cuda: CUDA is not available on this "
                                          r"machine; use device='cpu'"))
    for kwargs, pattern in cases:
        with pytest.raises(DcpcArgumentError, match=pattern):
            make(**kwargs)
    assert make(device="cpu:0").device == torch.device("cpu")


@pytest.mark.parametrize("backend", ["host", "torch"])
def test_call_arguments_are_refused_by_name(kimi_class: type, backend: str) -> None:
    import torch

    from dcpc.runtime import DcpcArgumentError, DcpcContractError, DcpcFailedError

    def make(**kw: Any) -> Any:
        return kimi_class(None, sizes={"H": 2, "T": 4, "B": 4}, backend=backend, **kw)

    q = torch.zeros(2, 2, 576, dtype=torch.bfloat16)
    sl, qsl = torch.full((2,), 8, dtype=torch.int32), torch.arange(3, dtype=torch.int32)
    with pytest.raises(DcpcArgumentError, match=r"slot must be an int in 0..1, got True"):
        make().query_gather(q, slot=True)
    with pytest.raises(DcpcArgumentError, match=r"sizes must be a dict, got 'T'"):
        make().query_gather(q, sizes="T")
    # merge() first: the call order (guard on), else the unbound size, never a KeyError
    with pytest.raises(DcpcContractError, match=r"'merge': called before query_gather\(\), "
                                                r"out_exchange\(\)"):
        make().merge(sl, qsl)
    with pytest.raises(DcpcArgumentError, match=r"size T (of buffer .o_recv. )?is not bound yet"):
        make(guard=False).merge(sl, qsl)
    m = make()
    with pytest.raises(DcpcArgumentError):
        m.query_gather(q.float())
    with pytest.raises(DcpcFailedError, match=r"query_gather\(\): this KimiK3Dcp instance "
                                              r"failed earlier \(DcpcArgumentError: "):
        m.query_gather(q)
    m.close()
    m.close()  # idempotent
    with pytest.raises(DcpcFailedError, match="failed earlier"):
        m.query_gather(q)
    closed = make()
    closed.close()
    with pytest.raises(DcpcFailedError, match=r"this KimiK3Dcp instance was closed"):
        closed.query_gather(q)
    with pytest.raises(DcpcFailedError, match=r"was closed"):
        closed.check_errors()
