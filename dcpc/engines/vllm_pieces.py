"""The pieces of vLLM's DCP interface that dcpc stands in for: each name ``install()``
replaces (dcpc.engines.vllm_install) and dcpc's candidates for it, in the order the
contract check tries them (dcpc.engines.contract; ``python -m dcpc.engines.contract``
reads them here too)."""

from __future__ import annotations

from typing import Any

from dcpc.engines import vllm_free
from dcpc.engines.vllm_kv import MLADCPKVGather, MLADCPManagerPR52239
from dcpc.engines.vllm_manager import MLADCPManager

FREE = ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce", "dcp_a2a_v_up_proj_lse_reduce")
CLASSES = ("MLADCPManager", "MLADCPKVGather")
KEPT = ("cp_lse_ag_out_ar",)  # not replaced (no dcpc schedule): vLLM's own is called


def candidates(name: str) -> list[Any]:
    """dcpc's stand-ins for vLLM's ``name``, in the order tried: the released layout's
    manager before open PR #52239's."""
    if name in FREE:
        return [getattr(vllm_free, name)]
    return {"MLADCPManager": [MLADCPManager, MLADCPManagerPR52239],
            "MLADCPKVGather": [MLADCPKVGather]}[name]


def replacements() -> dict[str, Any]:
    """Every name dcpc replaces, with the released layout's stand-in (contract.main)."""
    return {name: candidates(name)[0] for name in (*FREE, *CLASSES)}


__all__ = ["CLASSES", "FREE", "KEPT", "candidates", "replacements"]
