"""The path agreement (dcpc.engines.agree): one collective per function, group and set of
settings, then a dict lookup; never inside a CUDA-graph capture.

Found on one H200 (benchmarks/capture_warm.py, 2026-12-02): vLLM's and SGLang's
dcp_a2a_lse_reduce share the label but not their switch (VLLM_USE_DIRECT_DCP_A2A,
DCPC_SGLANG), so each call of one undid the other's agreement and agreed again: an
all-gather and a stream synchronisation per call, which a CUDA-graph capture refuses
("operation not permitted when stream is capturing")."""

from __future__ import annotations

import torch

from dcpc.engines import agree as A
from dcpc.engines.common import resolve_group
from dcpc.engines.fallback import Comm
from dcpc.runtime.local import LocalGroup


def test_two_engines_sharing_a_label_agree_once_each() -> None:
    def rank_main(rank):
        group = resolve_group(rank, torch.device("cpu"))
        gather = Comm(group).all_gather
        vllm = {"VLLM_USE_DIRECT_DCP_A2A": "auto", "workspace tokens": 4}
        sglang = {"DCPC_SGLANG": "auto", "workspace tokens": 4}
        counts = []
        for _ in range(3):
            before = A.COUNTS[rank.rank]
            A.agree(group, "dcp_a2a_lse_reduce", vllm, gather)
            A.agree(group, "dcp_a2a_lse_reduce", sglang, gather)
            counts.append(A.COUNTS[rank.rank] - before)
        changed = dict(vllm, **{"workspace tokens": 8})  # a change of a setting: again
        before = A.COUNTS[rank.rank]
        A.agree(group, "dcp_a2a_lse_reduce", changed, gather)
        counts.append(A.COUNTS[rank.rank] - before)
        return counts

    A.forget()
    try:
        got = LocalGroup(2, "cpu").run(rank_main)
    finally:
        A.forget()
    assert got == [[2, 0, 0, 1]] * 2, got  # each function once, then lookups; a change: once
