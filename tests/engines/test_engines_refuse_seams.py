"""Seams of this session's engine changes, found by an independent review (2026-12-02):
an adapter's argument refusal (dcpc.engines.agree.refuse) against the capture warm-up,
against a second microbatch, and SGLang's layer-0 query gather's call id. Each case
returned wrong data without an error before its fix. Ranks as threads (local), W = 2."""

from __future__ import annotations

import threading

import pytest
import torch
from support.kernels import run_ranks

from dcpc.engines import call_ids as C
from dcpc.engines import combine
from dcpc.engines import reference as ref
from dcpc.engines import sglang as S
from dcpc.engines import vllm as V
from dcpc.engines import vllm_free as F
from dcpc.runtime.local import LocalGroup, LocalRankError

W, T, H, D = 2, 4, 4, 16


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DCPC_MAX_NUM_TOKENS", "8")
    combine.reset()
    yield
    combine.reset()


def _inputs(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(T, H, D, generator=g).bfloat16() for _ in range(W)],
            [torch.randn(T, H, generator=g) * 2 for _ in range(W)])


def _a2a(rank, c: int, refuse_at: int) -> str:
    outs, lses = _inputs(c)
    r = rank.rank
    lse = lses[r].int() if (r == 1 and c == refuse_at) else lses[r]  # refused: int LSE
    try:
        got = V.dcp_a2a_lse_reduce(outs[r], lse, rank)
    except Exception as err:  # noqa: BLE001 - the outcome is what is compared
        return type(err).__name__
    want = ref.vllm_combine(outs, lses)[r][0]
    return "ok" if bool(((got.double() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all()) \
        else "WRONG"


def test_a_refused_first_call_leaves_the_capture_warm_up_to_the_next_call(monkeypatch):
    """Before: rank 0's warm-up met rank 1's refusal and raised, but the family stayed
    marked warm on rank 0 only; rank 1 warmed at its next call (2 calls per size) while
    rank 0 made one: 'WRONG' on rank 0 at every later call, then a 60 s timeout."""
    monkeypatch.setenv("DCPC_CAPTURE_SIZES", "4")
    got = run_ranks(W, lambda rank: [_a2a(rank, c, refuse_at=0) for c in range(3)])
    assert got == [["DcpcArgumentError", "ok", "ok"]] * 2, got


def test_a_refused_first_call_of_a_second_microbatch_never_pairs_wrongly(monkeypatch):
    """Microbatches 0, 1, 1; rank 1 refuses microbatch 1's first call, where no module
    of that microbatch exists to carry the refusal. Before: rank 0's call 1 returned
    'WRONG' (it paired with rank 1's call 2), then a 60 s timeout. Now rank 1's modules
    of the group are failed and no module is built there until reset(): rank 1's call 2
    raises, rank 0's call 1 waits for a peer that never comes (bounded here by the
    LocalGroup's barrier; on the host and torch backends by the construction's
    rendezvous, which names the missing rank)."""
    tls = threading.local()
    monkeypatch.setenv("DCPC_WARM_CAPTURE", "0")
    monkeypatch.setattr(F, "ubatch", lambda: getattr(tls, "ub", 0))
    seen: dict[int, list[str]] = {0: [], 1: []}

    def body(rank):
        for c, ub in enumerate((0, 1, 1)):
            tls.ub = ub
            seen[rank.rank].append(_a2a(rank, c, refuse_at=1))

    try:
        LocalGroup(W, "cpu", timeout_s=20).run(body, timeout_s=30)
    except LocalRankError:
        pass  # rank 0 bounded by the group's barrier (its peer built no module)
    assert seen[1] == ["ok", "DcpcArgumentError", "DcpcFailedError"], seen
    assert seen[0][0] == "ok" and all(s not in ("ok", "WRONG") for s in seen[0][1:]), seen


def test_sglang_layer_0_query_gather_has_its_own_call_id():
    """SGLang's query gather runs before its layer's RadixAttention, so it carries the
    previous layer's id; layer 0's carried the forward's bare id, equal to layer 1's
    (layer 0): a rank skipping layer 0's gather returned wrong data on both ranks."""
    def body(rank):
        r, seen = rank.rank, []
        C.begin_forward()
        for layer in range(2):
            if not (r == 1 and layer == 0):  # rank 1 skips layer 0's query gather
                g = torch.Generator().manual_seed(layer)
                nope = [torch.randn(3, 2, 16, generator=g).bfloat16() for _ in range(W)]
                pe = [torch.randn(3, 2, 8, generator=g).bfloat16() for _ in range(W)]
                try:
                    got = S.all_gather_q_for_mla_decode(nope[r], pe[r], rank)
                except Exception as err:  # noqa: BLE001
                    seen.append(type(err).__name__)
                    return seen
                want = torch.cat([ref.gather_heads(nope), ref.gather_heads(pe)], -1)
                seen.append("ok" if torch.equal(torch.cat(got, -1).double(), want)
                            else "WRONG")
            C.enter_layer(layer)
        return seen

    got = run_ranks(W, lambda rank: __import__("contextvars").copy_context().run(body, rank))
    # each rank raises at its first gather: a contract error where the ids met, or
    # the peer's failure where that peer raised first (its flag is seen before the ids)
    assert all(len(g) == 1 and g[0] in ("DcpcContractError", "DcpcPeerFailedError")
               for g in got) and ["DcpcContractError"] in got, got
