"""vLLM's DCP interface (vllm/v1/attention/ops/dcp.py, vLLM 0.33.0) on dcpc modules.

Same names, arguments and results as vLLM's, so a plugin can assign them over vLLM's
(docs/engines.md, "Engine adapters: vLLM and SGLang"):

- ``cp_lse_ag_out_rs``: all-gather LSE, correct, reduce-scatter (dcpc path ``ag_rs``;
  the correction and the sum run in fp32, rounded once: vLLM reduces in bf16);
- ``dcp_a2a_lse_reduce``: all-to-all + LSE-weighted merge (dcpc path ``fused``: one
  launch);
- ``cp_lse_ag_out_ar`` (PCP): torch only, as vLLM's math;
- ``correct_attn_out``: the local correction, in torch (fp32);
- ``get_dcp_workspace_max_num_tokens`` and ``MLADCPManager`` (dcpc.engines.vllm_manager;
  vLLM main's, with its KV gather: dcpc.engines.vllm_kv).

vLLM git main's layout (vllm/v1/attention/ops/dcp_utils.py) has the same free functions
with extra keywords (``use_b12x``, ...): they are taken as ``**engine_kwargs``, and a set
one runs vLLM's own function.

``seq_lens`` are THIS rank's local KV lengths [B] (what vLLM passes); rows at or past
``query_start_loc[-1]`` and requests with local length 0 get LSE -inf as in vLLM's
mask_dcp_empty_shards_, but out of place (this adapter never writes its inputs; with
DCPC_KERNEL_MASK=1 the kernels mask instead). Results are views of the module's
persistent buffers: valid until the next call of the same shapes (consume or copy them
before that, as vLLM's layers do).

``install()`` (dcpc.engines.vllm_install: which layout, which names) puts them over
vLLM's and keeps vLLM's own as the fallback of every call
dcpc does not take; without it the fallback is torch collectives in fp32.

Switches (tri-state env: unset = auto, 1 = force, 0 = the fallback):
``VLLM_USE_DIRECT_DCP_A2A`` (a2a), ``DCPC_VLLM_AG_RS`` (ag_rs), and, for the manager,
``VLLM_USE_DIRECT_DCP_Q_GATHER`` and ``VLLM_USE_DIRECT_DCP_KV_GATHER``. ``DCPC_BACKEND``
picks the module backend (default ``auto``), ``DCPC_MAX_NUM_TOKENS`` the workspace of
the free functions when no vLLM config is current. A family's first call warms every
CUDA-graph capture size up first (dcpc.engines.capture; ``DCPC_WARM_CAPTURE=0``: off).
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import torch

from dcpc.engines import capture
from dcpc.engines.combine import (
    EngineResult,
    check_mask_args,
    check_tensors,
    combine_call,
    combine_settings,
    refusing,
    reset,
)
from dcpc.engines.common import log_once, resolve_group, switch
from dcpc.engines.fallback import Comm, correct, mask_at_source, torch_combine
from dcpc.runtime.errors import DcpcArgumentError

A2A_SWITCH = "VLLM_USE_DIRECT_DCP_A2A"
AG_RS_SWITCH = "DCPC_VLLM_AG_RS"
Q_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_Q_GATHER"
KV_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_KV_GATHER"
DEFAULT_MAX_NUM_TOKENS = 256  # the free functions' workspace without a vLLM config


# ---- helpers --------------------------------------------------------------------------
def _backend() -> str:
    return os.environ.get("DCPC_BACKEND", "auto")


def _ubatch() -> int:
    """vLLM's DBO microbatch of this thread (0 without vLLM or DBO)."""
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    except ImportError:
        return 0
    return int(dbo_current_ubatch_id())


_installed_tokens: list[int] = []  # install(max_num_tokens=...): the free functions' workspace


def workspace_choice() -> tuple[int, str]:
    """(the free functions' workspace in tokens, where it came from): ``DCPC_MAX_NUM_TOKENS``,
    else ``install(max_num_tokens=)``, else vLLM's get_dcp_workspace_max_num_tokens of
    the config current now (vLLM sets one around model construction, where plugins and
    install() run in a worker), else 256."""
    env = os.environ.get("DCPC_MAX_NUM_TOKENS")
    if env:
        return int(env), "DCPC_MAX_NUM_TOKENS"
    if _installed_tokens:
        return _installed_tokens[0], "install(max_num_tokens=)"
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return DEFAULT_MAX_NUM_TOKENS, "the default: no vLLM config"
    config = get_current_vllm_config_or_none()
    if config is None:
        return DEFAULT_MAX_NUM_TOKENS, "the default: no vLLM config is current"
    return (get_dcp_workspace_max_num_tokens(config),
            "vLLM's config: max_num_batched_tokens, max_num_seqs, speculative tokens, "
            "CUDA-graph capture sizes")


@functools.cache
def _free_tokens() -> int:
    """The workspace of the free functions, decided once per process (every call must
    find the same module): see workspace_choice. In a vLLM server no config is current
    in forward, so the first call's choice may be the default: install() from a plugin
    (a config is current when vLLM loads plugins in a worker), or set one of the
    first two, and read install()'s log line."""
    return workspace_choice()[0]


# ---- vLLM's own, saved by install() (dcpc.engines.vllm_install) ---------------------------
_originals: dict[str, Any] = {}  # vLLM's own functions: the fallbacks


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "__module__", "").startswith("dcpc.")


def _engine_fallback(name: str, *args: Any, **kwargs: Any) -> Any:
    """vLLM's own ``name`` called with these arguments, if install() saved it."""
    original = _originals.get(name)
    if original is None or _is_ours(original):
        return None
    return lambda: original(*args, **kwargs)


def _engine_only(label: str, engine_kwargs: dict[str, Any], engine: Any) -> bool:
    """vLLM main's extra keywords (e.g. dcp_a2a_lse_reduce's ``use_b12x``,
    ``b12x_max_batch_size``, ``b12x_query_head_dim``): at their defaults (None, False, 0)
    dcpc runs the call; a set one asks for vLLM's own path, which runs if install()
    saved it, else the call is refused (no silent change of what was asked for)."""
    asked = {k: v for k, v in engine_kwargs.items() if v not in (None, False, 0)}
    if not asked:
        return False
    if engine is None:
        raise DcpcArgumentError(f"{label}: {', '.join(sorted(asked))} asks for vLLM's own "
                                "path, which install() did not save")
    log_once(f"{label}:engine-kwargs:{sorted(asked)}", f"{label}: vLLM's own path for "
             f"{', '.join(sorted(asked))}")
    return True


def _squeeze(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM squeezes a [B, 1, H, D] output (and a 1-sized dim of the LSE)."""
    if out.dim() == 4:
        out = out.squeeze(1)
    if lse.dim() == 3:
        lse = lse.squeeze(1) if lse.shape[1] == 1 else lse.squeeze(-1)
    if out.dim() != 3 or lse.dim() != 2:
        raise DcpcArgumentError(f"expected an output [B, H, D] and an LSE [B, H], got "
                                f"{tuple(out.shape)} and {tuple(lse.shape)}")
    return out, lse


def _combine(path: str, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
             return_lse: bool, is_lse_base_on_e: bool, seq_lens: Any, query_start_loc: Any,
             *, switch_name: str, max_tokens: int | None = None, slots: int = 1,
             slot: int = 0, instance: int | None = None, backend: str | None = None,
             label: str, engine: Any = None, again: Any = None) -> Any:
    """The free functions and the manager's combine: vLLM's argument handling (a 4-D
    output squeezed, W == 1 returns the inputs), then ``combine_call`` (``engine``:
    vLLM's own function as the fallback); the result as vLLM returns it (``out``, or
    ``(out, lse)`` with ``return_lse``). ``again(out, lse, seq_lens, qsl)``: the public
    function with the caller's other arguments, for the capture warm-up of a family's
    first call (dcpc.engines.capture)."""
    tokens, backend = max_tokens or _free_tokens(), backend or _backend()
    instance = _ubatch() if instance is None else instance
    with refusing(cp_group, cp_attn_out, label,  # every rank raises, or none
                  lambda: combine_settings(switch_name, tokens, backend), slot,
                  instance=instance):
        check_mask_args(seq_lens, query_start_loc)
        check_tensors(label, out=cp_attn_out, lse=cp_attn_lse)
        out, lse = _squeeze(cp_attn_out, cp_attn_lse)
    group = resolve_group(cp_group, out.device)
    if group.world == 1:
        return (out, lse) if return_lse else out
    if again is not None:
        rest = (label, id(group.handle), group.rank, seq_lens is None, return_lse,
                is_lse_base_on_e, slot, instance, backend, tokens)
        capture.first_use(
            (*rest, out.shape[1:], out.stride(), out.dtype, lse.shape[1:], lse.stride(),
             lse.dtype), lambda: (*rest, capture.layout(out), capture.layout(lse),
                                  capture.mask_kind(seq_lens, query_start_loc)),
            group.handle, label, capture.vllm_sizes_now, tokens,
            lambda n: again(capture.like(out, n), capture.like(lse, n),
                            *capture.mask_args(seq_lens, query_start_loc, n)),
            lambda: switch(switch_name) != "off")
    got = combine_call(
        path, out, lse, group, base2=not is_lse_base_on_e, seq_lens=seq_lens,
        qsl=query_start_loc, switch_name=switch_name, max_tokens=tokens, slots=slots,
        slot=slot, instance=instance, backend=backend, label=label, engine=engine)
    if isinstance(got, EngineResult):
        return got.value
    got, got_lse = got
    if not return_lse:
        return got
    # ag_rs: the LSE in cp_attn_lse's dtype (vLLM's lse); a2a: fp32
    return got, (got_lse.to(cp_attn_lse.dtype) if path == "ag_rs" else got_lse)


# ---- the free functions -----------------------------------------------------------------
def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None,
                     **engine_kwargs: Any) -> Any:
    """vLLM's cp_lse_ag_out_rs: [B, H, D] partials of all heads -> this rank's heads
    [B, H/W, D] (rank r: heads r*H/W ..), with ``return_lse`` also the global LSE of
    those heads [B, H/W] in cp_attn_lse's dtype. ``ctx`` (the Triton context) is unused."""
    engine = _engine_fallback("cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx,
                              return_lse, is_lse_base_on_e, seq_lens, query_start_loc,
                              **engine_kwargs)
    if _engine_only("cp_lse_ag_out_rs", engine_kwargs, engine):
        return engine()
    return _combine("ag_rs", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                    is_lse_base_on_e, seq_lens, query_start_loc, switch_name=AG_RS_SWITCH,
                    label="cp_lse_ag_out_rs", engine=engine,
                    again=lambda o, lse, s, q: cp_lse_ag_out_rs(
                        o, lse, cp_group, ctx, return_lse, is_lse_base_on_e, s, q,
                        **engine_kwargs))


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       ctx: Any = None, return_lse: bool = False,
                       is_lse_base_on_e: bool = True, seq_lens: torch.Tensor | None = None,
                       query_start_loc: torch.Tensor | None = None,
                       **engine_kwargs: Any) -> Any:
    """vLLM's dcp_a2a_lse_reduce: as cp_lse_ag_out_rs, through one fused all-to-all +
    merge; the returned LSE is fp32. H % W != 0 raises (a ValueError, as vLLM)."""
    engine = _engine_fallback("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx,
                              return_lse, is_lse_base_on_e, seq_lens, query_start_loc,
                              **engine_kwargs)
    if _engine_only("dcp_a2a_lse_reduce", engine_kwargs, engine):
        return engine()
    return _combine("fused", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                    is_lse_base_on_e, seq_lens, query_start_loc, switch_name=A2A_SWITCH,
                    label="dcp_a2a_lse_reduce", engine=engine,
                    again=lambda o, lse, s, q: dcp_a2a_lse_reduce(
                        o, lse, cp_group, ctx, return_lse, is_lse_base_on_e, s, q,
                        **engine_kwargs))


def cp_lse_ag_out_ar(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    """vLLM's cp_lse_ag_out_ar (PCP + DCP): the corrected output of ALL heads [B, H, D]
    (all-reduce) and the full LSE [B, H]. No dcpc schedule: vLLM's own after install(),
    else torch collectives (fp32)."""
    theirs = _engine_fallback("cp_lse_ag_out_ar", cp_attn_out, cp_attn_lse, cp_group, ctx,
                              return_lse, is_lse_base_on_e, seq_lens, query_start_loc)
    if theirs is not None:  # installed: vLLM's own (one all-reduce, its kernels)
        return theirs()
    mask = check_mask_args(seq_lens, query_start_loc)
    check_tensors("cp_lse_ag_out_ar", out=cp_attn_out, lse=cp_attn_lse)
    out, lse = _squeeze(cp_attn_out, cp_attn_lse)
    group = resolve_group(cp_group, out.device)
    if group.world == 1:
        return (out, lse) if return_lse else out
    lse32 = mask_at_source(lse.float(), seq_lens, query_start_loc) if mask else lse.float()
    got, total = torch_combine(Comm(group), "ag_rs", out, lse32, not is_lse_base_on_e,
                               out.dtype, all_heads=True)
    return (got, total.to(lse.dtype)) if return_lse else got


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, cp_rank: int, ctx: Any = None,
                     is_lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's correct_attn_out: ``out`` [B, H, D] *= exp(lses[cp_rank] - G) IN PLACE (as
    vLLM: 0 where the factor is 0), G merged over lses [N, B, H]; returns (out, G [B, H]
    in lses' dtype). Local math (no communication), in torch fp32."""
    check_tensors("correct_attn_out", out=out, lse=lses)
    if out.dim() == 4:
        out = out.squeeze(1)
    if lses.dim() == 4 and lses.shape[-1] == 1:  # vLLM: [N, B, H, 1], then [N, 1, B, H]
        lses = lses.squeeze(-1)
    if lses.dim() == 4 and lses.shape[1] == 1:
        lses = lses.squeeze(1)
    if lses.dim() != 3 or lses.shape[1:] != out.shape[:2]:
        raise DcpcArgumentError(f"correct_attn_out: lses {tuple(lses.shape)} is not [N, B, H] "
                                f"for out {tuple(out.shape)}")
    if not 0 <= cp_rank < lses.shape[0]:
        raise DcpcArgumentError(f"correct_attn_out: cp_rank {cp_rank} outside "
                                f"0..{lses.shape[0] - 1}")
    fixed, total = correct(out, lses, cp_rank, not is_lse_base_on_e)
    out.copy_(fixed)
    return out, total.to(lses.dtype)


def get_dcp_workspace_max_num_tokens(vllm_config: Any) -> int:
    """vLLM's own function when vLLM is installed; else vLLM's formula (git main,
    2026-12): min(max_num_batched_tokens, max(max_num_seqs * tokens_per_seq, the
    largest CUDA-graph capture size)), tokens_per_seq = 1 + k speculative tokens, or
    1 + 2k with parallel drafting (vLLM's own test: 4 sequences, k = 3 -> 28)."""
    theirs = None
    for where in ("vllm.v1.attention.ops.dcp", "vllm.v1.attention.ops.dcp_utils"):
        try:  # 0.33.0's module, vLLM main's
            theirs = getattr(importlib.import_module(where),
                             "get_dcp_workspace_max_num_tokens", None)
        except ImportError:
            continue
        if theirs is not None:
            break
    if theirs is not None:
        return int(theirs(vllm_config))
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(vllm_config, "num_speculative_tokens", None)
    if k is None:  # vLLM's VllmConfig has the property; older configs only the spec's
        k = getattr(spec, "num_speculative_tokens", 0) or 0
    per_seq = 1 + (2 if getattr(spec, "parallel_drafting", False) else 1) * k
    sched = vllm_config.scheduler_config
    graphs = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return min(sched.max_num_batched_tokens, max(sched.max_num_seqs * per_seq, graphs))



def install(max_num_tokens: int | None = None) -> list[str]:
    """Put this module's functions over vLLM's: see dcpc.engines.vllm_install.install."""
    from dcpc.engines.vllm_install import install as _install

    return _install(max_num_tokens)


def __getattr__(name: str) -> Any:
    """``MLADCPManager`` lives in dcpc.engines.vllm_manager (imported on first use: it
    imports this module)."""
    if name == "MLADCPManager":
        from dcpc.engines.vllm_manager import MLADCPManager

        return MLADCPManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")



__all__ = [
    "MLADCPManager",  # noqa: F822 (module __getattr__: dcpc.engines.vllm_manager)
    "install",
    "correct_attn_out",
    "cp_lse_ag_out_ar",
    "cp_lse_ag_out_rs",
    "dcp_a2a_lse_reduce",
    "get_dcp_workspace_max_num_tokens",
    "reset",
]
