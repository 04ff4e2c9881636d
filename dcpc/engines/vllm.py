"""vLLM's DCP interface (vllm/v1/attention/ops/dcp.py, vLLM 0.33.0 and 0.34.0) on dcpc modules:
the plugin face. ``install()`` puts dcpc's functions and manager over vLLM's (see
docs/engines.md, "Switching vLLM"); the names below mirror vLLM's (same names,
arguments and results, docs/engines.md, "Engine adapters: vLLM and SGLang"):

- ``cp_lse_ag_out_rs``, ``dcp_a2a_lse_reduce``, ``dcp_a2a_v_up_proj_lse_reduce``,
  ``cp_lse_ag_out_ar``, ``correct_attn_out``, ``get_dcp_workspace_max_num_tokens``, and
  ``note_config`` / ``forget_config`` (the vLLM config they read): dcpc.engines.vllm_free,
  with the switches, the workspace and vLLM's own functions kept as fallbacks;
- ``MLADCPManager``: dcpc.engines.vllm_manager (open vLLM PR #52239's manager and KV
  gather: dcpc.engines.vllm_kv);
- ``reset``: close the adapters' modules (dcpc.engines.combine.reset).

Which layout, which names and the contract check: dcpc.engines.vllm_install (the pieces:
dcpc.engines.vllm_pieces). vLLM itself reads none of these names from here: install()
rebinds its own modules' names (every ``from ... import`` binding too) to dcpc's
objects. No module of dcpc imports this one.
"""

from __future__ import annotations

from dcpc.engines import vllm_install
from dcpc.engines.combine import reset
from dcpc.engines.vllm_free import (
    correct_attn_out,
    cp_lse_ag_out_ar,
    cp_lse_ag_out_rs,
    dcp_a2a_lse_reduce,
    dcp_a2a_v_up_proj_lse_reduce,
    forget_config,
    get_dcp_workspace_max_num_tokens,
    note_config,
)
from dcpc.engines.vllm_manager import MLADCPManager


def install(max_num_tokens: int | None = None) -> list[str]:
    """Put this module's functions over vLLM's: see dcpc.engines.vllm_install.install."""
    return vllm_install.install(max_num_tokens)


__all__ = [
    "MLADCPManager",
    "install",
    "correct_attn_out",
    "cp_lse_ag_out_ar",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "dcp_a2a_v_up_proj_lse_reduce",
    "forget_config",
    "get_dcp_workspace_max_num_tokens",
    "note_config",
    "reset",
]
