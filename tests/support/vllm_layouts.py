"""Stand-ins for vLLM's DCP modules with the names, module paths and signatures of open
vLLM PR #52239's layout (tests/engines/test_engines_vllm_pr52239.py), called "vLLM main" here
before: no vLLM release has vllm/v1/attention/ops/dcp_utils.py (0.33.0 and 0.34.0 keep
vllm/v1/attention/ops/dcp.py).

Excerpted from vllm/v1/attention/ops/dcp_utils.py (a snapshot after commit 1d57ea3a that
has MLADCPKVGather: the index holds it without its commit hash),
vllm/v1/attention/ops/dcp_alltoall.py (its dcp_a2a_lse_reduce with the b12x keywords)
and ops/common.py. What is kept: every public name the adapters replace,
each function's and method's parameters in vLLM's order with vLLM's defaults, the
module each name is defined in and the ``from ... import`` bindings between them (what
install() must find and rebind). What is stubbed, and why that is honest: the bodies
(vLLM's need CUDA kernels: torch.ops._C.direct_dcp_*, NCCL, symmetric memory) record
their call and return a marker, so a test sees exactly when vLLM's own path runs; the
import chain of dcp_utils (vllm.envs, vllm.config, vllm.platforms, ...: ~60
dependencies) is not loaded, since install() reads only the module namespaces and the
signatures.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

CALLS: list[tuple[str, tuple, dict]] = []


def _record(name: str, args: tuple, kwargs: dict) -> str:
    CALLS.append((name, args, kwargs))
    return f"vllm {name}"


# ---- vllm/v1/attention/ops/common.py (main) ---------------------------------------------------
def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    return _record("cp_lse_ag_out_rs", (cp_attn_out, cp_attn_lse, cp_group, ctx, return_lse,
                                        is_lse_base_on_e, seq_lens, query_start_loc), {})


def cp_lse_ag_out_ar(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    return _record("cp_lse_ag_out_ar", (cp_attn_out, cp_attn_lse, cp_group), {})


# ---- vllm/v1/attention/ops/dcp_alltoall.py (main) -------------------------------------------
def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       ctx: Any = None, return_lse: bool = False,
                       is_lse_base_on_e: bool = True, seq_lens: torch.Tensor | None = None,
                       query_start_loc: torch.Tensor | None = None, use_b12x: bool = False,
                       b12x_max_batch_size: int | None = None,
                       b12x_query_head_dim: int | None = None) -> Any:
    return _record("dcp_a2a_lse_reduce", (cp_attn_out, cp_attn_lse, cp_group),
                   {"use_b12x": use_b12x, "b12x_max_batch_size": b12x_max_batch_size,
                    "b12x_query_head_dim": b12x_query_head_dim})


# ---- vllm/v1/attention/ops/dcp_utils.py (main) ----------------------------------------------
def get_dcp_workspace_max_num_tokens(vllm_config: Any) -> int:
    return 28  # stubbed: dcpc's own formula is tested in test_engines_install


def reserve_query_head_storage(query: torch.Tensor, padded_num_heads: int) -> torch.Tensor:
    raise NotImplementedError


class MLADCPKVGather:
    def __init__(self, group: Any, device: torch.device, num_ubatches: int) -> None:
        _record("MLADCPKVGather", (group, device, num_ubatches), {})

    def init_kv_gather(self, max_gathered_tokens: int, token_dim: int, plane_split_dim: int,
                       dtype: torch.dtype) -> bool:
        raise NotImplementedError

    @property
    def use_direct_kv_gather(self) -> bool:
        raise NotImplementedError

    @property
    def uses_packed_records(self) -> bool:
        raise NotImplementedError

    def packed_dma_planes(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def unpack_context_planes(self, packed_c: torch.Tensor, packed_rope: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def kv_gather_slots(self) -> int:
        raise NotImplementedError

    def direct_kv_gather_dma(self, local_kv_c: torch.Tensor, local_k_pe: torch.Tensor,
                             runs: torch.Tensor, output_tokens: int, buffer_slot: int,
                             partner_runs: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def kv_gather_relay(self) -> tuple[int, int] | None:
        raise NotImplementedError

    def kv_gather(self, gathered_kv: torch.Tensor, local_kv: torch.Tensor) -> object:
        raise NotImplementedError

    def direct_kv_gather(self, local_kv: torch.Tensor, dst_rows: torch.Tensor,
                         output_tokens: int, buffer_slot: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class MLADCPManager(MLADCPKVGather):
    def __init__(self, vllm_config: Any, device: torch.device, num_heads: int,
                 query_head_dim: int, output_head_dim: int, query_dtype: torch.dtype,
                 output_dtype: torch.dtype, padded_num_heads: int | None,
                 is_lse_base_on_e: bool, use_pcp: bool) -> None:
        _record("MLADCPManager", (), {})


def modules() -> dict[str, types.ModuleType]:
    """The module tree of open PR #52239's layout, every name bound where vLLM binds it (no
    vllm.v1.attention.ops.dcp: main has none)."""
    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    tree = {name: module(name) for name in (
        "vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops")}
    here = sys.modules[__name__]
    tree["vllm.v1.attention.ops.common"] = module(
        "vllm.v1.attention.ops.common", cp_lse_ag_out_rs=cp_lse_ag_out_rs,
        cp_lse_ag_out_ar=cp_lse_ag_out_ar)
    tree["vllm.v1.attention.ops.dcp_alltoall"] = module(
        "vllm.v1.attention.ops.dcp_alltoall", dcp_a2a_lse_reduce=dcp_a2a_lse_reduce)
    tree["vllm.v1.attention.ops.dcp_utils"] = module(  # from ... import, as main does
        "vllm.v1.attention.ops.dcp_utils", cp_lse_ag_out_rs=cp_lse_ag_out_rs,
        cp_lse_ag_out_ar=cp_lse_ag_out_ar, dcp_a2a_lse_reduce=dcp_a2a_lse_reduce,
        get_dcp_workspace_max_num_tokens=get_dcp_workspace_max_num_tokens,
        reserve_query_head_storage=reserve_query_head_storage,
        MLADCPKVGather=here.MLADCPKVGather, MLADCPManager=here.MLADCPManager)
    tree["vllm.model_executor.layers.attention.mla_attention"] = module(
        "vllm.model_executor.layers.attention.mla_attention", MLADCPManager=MLADCPManager)
    tree["vllm.config"] = module("vllm.config", get_current_vllm_config_or_none=lambda: None)
    return tree
