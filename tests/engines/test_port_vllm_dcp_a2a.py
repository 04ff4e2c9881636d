"""vLLM's tests/distributed/test_dcp_a2a.py (vllm-project/vllm 03dbed78), ported onto
dcpc's vLLM adapters: the cases and assertions are in tests/engine_ports/vllm_dcp_a2a.py
(what was replaced, what was not ported, and why). W = 2 and 3 on the ``local`` backend
(the generated kernels under the interpreter, threads: the kernels the ``host`` backend
runs, in one process); the ``torch`` (W = 2, 3) and ``host`` (W = 2) backends run the
same cases in tests/engines/test_port_vllm_direct.py (its last test)."""

from __future__ import annotations

import pytest
from engine_ports import vllm_dcp_a2a as P
from engine_ports.harness import local_run, port_cache, port_cache_dir  # noqa: F401

from dcpc.runtime.local import LocalGroup

MODULE = "engine_ports.vllm_dcp_a2a"


def check(found: list[dict]) -> None:
    """vLLM's LSE check: must pass for fp32, cannot pass for bf16/fp16 (the module's
    docstring); the fp32 reference within vLLM's 1e-4 always."""
    for r, per_case in enumerate(found):
        assert len(per_case) == 13, (r, sorted(per_case))  # 12 dtype/flag cases + empty
        for key, got in per_case.items():
            if not key.startswith("float") or "return_lse=True" not in key:
                continue
            if key.startswith("float32"):
                assert got["their_lse_check"] == "passed", (r, key, got)
            else:  # not only the dtype: their bf16/fp16 reference is off by more than 1e-4
                assert got["their_lse_check"] != "passed", (r, key, got)
                assert got["their_lse_err"] > 1e-4, (r, key, got)
            assert got["fp32_lse_err"] <= 1e-4, (r, key, got)


def test_reference_cases_through_dcpc():
    done = LocalGroup(2, "cpu", timeout_s=300).run(
        lambda rank: P.reference_cases(rank, rank.rank, 2))
    assert done[0] == done[1] and len(done[0]) == 6
    P.single_rank()
    P.ag_rs_masks_empty_shard_and_padded_lse()


@pytest.mark.parametrize("world", [2, 3])
def test_local(world):
    check(local_run(MODULE, world))
