"""vLLM's DCP free functions (vllm/v1/attention/ops/dcp.py, vLLM 0.33.0 and 0.34.0) on dcpc
modules, with the switches, the workspace and the vLLM config they read, and vLLM's own
functions kept as their fallbacks. dcpc.engines.vllm (the plugin face: ``install()``)
exports the public ones.

Same names, arguments and results as vLLM's, so a plugin can assign them over vLLM's
(docs/engines.md, "Engine adapters: vLLM and SGLang"):

- ``cp_lse_ag_out_rs``: all-gather LSE, correct, reduce-scatter (dcpc path ``ag_rs``;
  the correction and the sum run in fp32, rounded once: vLLM reduces in bf16);
- ``dcp_a2a_lse_reduce``: all-to-all + LSE-weighted merge (dcpc path ``fused``: one
  launch); ``out=`` (vLLM 0.34.0) writes the merge into the caller's buffer;
- ``dcp_a2a_v_up_proj_lse_reduce`` (vLLM 0.34.0): the a2a merge with MLA's W_UV
  up-projection applied first (the all-to-all then carries V values per head, not L),
  or, below vLLM's token threshold, after the merge of the latent;
- ``cp_lse_ag_out_ar`` (PCP): torch only, as vLLM's math;
- ``correct_attn_out``: the local correction, in torch (fp32);
- ``get_dcp_workspace_max_num_tokens``; ``MLADCPManager`` is dcpc.engines.vllm_manager's
  (the KV gather of open vLLM PR #52239's layout: dcpc.engines.vllm_kv).

The layout of open vLLM PR #52239 (vllm/v1/attention/ops/dcp_utils.py, unreleased) has
the same free functions with extra keywords (``use_b12x``, ...: ``ENGINE_ONLY``): taken
as ``**engine_kwargs``, and a set one runs vLLM's own function.

``seq_lens`` are THIS rank's local KV lengths [B] (what vLLM passes); rows at or past
``query_start_loc[-1]`` and requests with local length 0 get LSE -inf as in vLLM's
mask_dcp_empty_shards_, but out of place (this adapter never writes its inputs; with
DCPC_KERNEL_MASK=1 the kernels mask instead). Results are views of the module's
persistent buffers: valid until the next call of the same shapes (consume or copy them
before that, as vLLM's layers do); with ``out=`` the result is copied into ``out``.

``install()`` (dcpc.engines.vllm_install: which layout, which names, the contract
check) puts them over vLLM's and keeps vLLM's own as the fallback of every call
dcpc does not take; without it the fallback is torch collectives in fp32.

Switches (tri-state env: unset = auto, 1 = force, 0 = the fallback):
``VLLM_USE_DIRECT_DCP_A2A`` (a2a), ``DCPC_VLLM_AG_RS`` (ag_rs), and, for the manager,
``VLLM_USE_DIRECT_DCP_Q_GATHER`` and ``VLLM_USE_DIRECT_DCP_KV_GATHER``. ``DCPC_BACKEND``
picks the module backend (default ``auto``). The free functions' workspace and the
CUDA-graph capture sizes come from the first vLLM config dcpc sees (``note_config``:
the manager's construction in load_model, each forward's ``set_forward_context``, or
the config current at a first call); ``DCPC_MAX_NUM_TOKENS`` / ``DCPC_CAPTURE_SIZES``
override them. A family's first call warms every capture size up first
(dcpc.engines.capture; ``DCPC_WARM_CAPTURE=0``: off).
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from typing import Any

import torch

from dcpc.engines import capture
from dcpc.engines.agree import refusing
from dcpc.engines.combine import (
    EngineResult,
    check_mask_args,
    check_tensors,
    combine_call,
    combine_settings,
)
from dcpc.engines.common import log, log_once, resolve_group, switch
from dcpc.engines.fallback import Comm, correct, mask_at_source, torch_combine
from dcpc.runtime.errors import DcpcArgumentError

A2A_SWITCH = "VLLM_USE_DIRECT_DCP_A2A"
AG_RS_SWITCH = "DCPC_VLLM_AG_RS"
Q_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_Q_GATHER"
KV_GATHER_SWITCH = "VLLM_USE_DIRECT_DCP_KV_GATHER"
# where vLLM defines its DCP names: the releases (0.33.0, 0.34.0), open PR #52239's layout
MODULES = ("vllm.v1.attention.ops.dcp", "vllm.v1.attention.ops.dcp_utils")
DEFAULT_MAX_NUM_TOKENS = 256  # the free functions' workspace without a vLLM config
# keywords of vLLM's functions that dcpc leaves to vLLM's own path when set (open PR
# #52239's dcp_a2a_lse_reduce), with the value at which dcpc runs the call itself
ENGINE_ONLY = {"use_b12x": False, "b12x_max_batch_size": None, "b12x_query_head_dim": None}
# vLLM 0.34.0's _V_UP_PROJ_FIRST_MIN_TOKENS when vLLM's module does not hold one: below
# it the W_UV-fused merge merges the latent first (a smaller read of W_UV); the two
# orders agree up to rounding
V_UP_PROJ_FIRST_MIN_TOKENS = 8


# ---- helpers --------------------------------------------------------------------------
def _backend() -> str:
    return os.environ.get("DCPC_BACKEND", "auto")


def ubatch() -> int:
    """vLLM's DBO microbatch of this thread (0 without vLLM or DBO)."""
    try:
        from vllm.v1.worker.ubatching import dbo_current_ubatch_id
    except ImportError:
        return 0
    return int(dbo_current_ubatch_id())


_installed_tokens: list[int] = []  # install(max_num_tokens=...): the free functions' workspace
_seen: list[Any] = []  # the first vLLM config dcpc saw (note_config)
_seen_lock = threading.Lock()


def note_config(vllm_config: Any) -> None:
    """A vLLM config became current: keep the first one seen (the free functions'
    workspace and the capture sizes come from it: ``workspace_choice``,
    ``capture_sizes``). Called by the manager's construction (load_model),
    by the hooked ``set_forward_context`` (every forward, the profile run's first), and
    at a free function's first call (the config current then). A config without a
    scheduler config (a stand-in) is not kept."""
    if vllm_config is None or getattr(vllm_config, "scheduler_config", None) is None:
        return
    with _seen_lock:
        if _seen:
            return
        _seen.append(vllm_config)
    sizes, source = capture.vllm_sizes(vllm_config)
    capture.remember("vllm", sizes, source)


def forget_config() -> None:
    """Forget the config seen (tests; a new engine in the same process)."""
    with _seen_lock:
        _seen.clear()
    capture.remember("vllm", None, "")
    _free_tokens.cache_clear()


def _current_config() -> Any:
    """The config seen first, else vLLM's config current now (None without vLLM)."""
    with _seen_lock:
        if _seen:
            return _seen[0]
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    note_config(config)
    return config


def capture_sizes() -> tuple[list[int] | None, str]:
    """vLLM's capture sizes: DCPC_CAPTURE_SIZES, else those of the first vLLM config seen
    (``note_config``), else of the config current now (then noted)."""
    def current() -> tuple[list[int] | None, str]:
        config = _current_config()
        if config is None:
            return None, "no vLLM config seen or current"
        return capture.vllm_sizes(config)

    return capture.sizes_for("vllm", current)


def workspace_choice() -> tuple[int, str]:
    """(the free functions' workspace in tokens, where it came from): ``DCPC_MAX_NUM_TOKENS``,
    else ``install(max_num_tokens=)``, else vLLM's get_dcp_workspace_max_num_tokens of
    the first config seen (``note_config``) or of the config current now, else 256."""
    env = os.environ.get("DCPC_MAX_NUM_TOKENS")
    if env:
        return int(env), "DCPC_MAX_NUM_TOKENS"
    if _installed_tokens:
        return _installed_tokens[0], "install(max_num_tokens=)"
    config = _current_config()
    if config is None:
        return DEFAULT_MAX_NUM_TOKENS, "the default: no vLLM config seen or current"
    return (get_dcp_workspace_max_num_tokens(config),
            "vLLM's config: max_num_batched_tokens, max_num_seqs, speculative tokens, "
            "CUDA-graph capture sizes")


def set_workspace(max_num_tokens: int) -> None:
    """``install(max_num_tokens=)``: the free functions' workspace, below
    DCPC_MAX_NUM_TOKENS (see workspace_choice)."""
    _installed_tokens[:] = [int(max_num_tokens)]
    _free_tokens.cache_clear()


def workspace_set() -> bool:
    """The workspace is chosen now (DCPC_MAX_NUM_TOKENS or ``install(max_num_tokens=)``),
    not at the first call from vLLM's config."""
    return bool(_installed_tokens or os.environ.get("DCPC_MAX_NUM_TOKENS"))


@functools.cache
def _free_tokens() -> int:
    """The workspace of the free functions, decided once per process at their first call
    (every call must find the same module): see workspace_choice. In a vLLM worker
    the first call is in the profile run, inside its ``set_forward_context`` (whose
    config install()'s hook keeps) and with the config current; logged once (INFO)."""
    tokens, source = workspace_choice()
    log.info("dcpc.engines.vllm: the free functions' workspace is %d tokens (%s)", tokens,
             source)
    return tokens


# ---- vLLM's own, saved by install() (dcpc.engines.vllm_install) ---------------------------
_originals: dict[str, Any] = {}  # vLLM's own functions: the fallbacks


def _is_ours(fn: Any) -> bool:
    return getattr(fn, "__module__", "").startswith("dcpc.")


def keep_original(name: str, old: Any) -> None:
    """install(): vLLM's own ``old`` (its ``name`` before dcpc's replaced it) is the
    fallback of ``name``, unless one is kept already, or ``old`` is missing or dcpc's
    (its fallback would recurse)."""
    if old is not None and not _is_ours(old):
        _originals.setdefault(name, old)


def engine_fallback(name: str, *args: Any, **kwargs: Any) -> Any:
    """vLLM's own ``name`` called with these arguments, if install() saved it."""
    original = _originals.get(name)
    if original is None or _is_ours(original):
        return None
    return lambda: original(*args, **kwargs)


def _at_default(value: Any) -> bool:
    """A keyword left at an "off" value: None, False or 0, judged on scalars only (a
    tensor, or any other object, counts as set: never tested for truth)."""
    if value is None:
        return True
    return type(value) in (bool, int, float) and value == 0


def _engine_only(label: str, engine_kwargs: dict[str, Any], engine: Any) -> bool:
    """Keywords of vLLM's that dcpc does not implement (``ENGINE_ONLY``: open PR #52239's
    ``use_b12x``, ``b12x_max_batch_size``, ``b12x_query_head_dim``; any other extra
    keyword alike): at their off values (None, False, 0) dcpc runs the call; a set one
    asks for vLLM's own path, which runs if install() saved it, else the call is
    refused (no silent change of what was asked for)."""
    asked = {k: v for k, v in engine_kwargs.items() if not _at_default(v)}
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


def vllm_combine(path: str, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor,
                 cp_group: Any, return_lse: bool, is_lse_base_on_e: bool, seq_lens: Any,
                 query_start_loc: Any, *, switch_name: str, max_tokens: int | None = None,
                 slots: int = 1, slot: int = 0, instance: int | None = None,
                 backend: str | None = None, label: str, engine: Any = None,
                 again: Any = None, out: torch.Tensor | None = None) -> Any:
    """The free functions and the manager's combine: vLLM's argument handling (a 4-D
    output squeezed, W == 1 returns the inputs), then ``combine_call`` (``engine``:
    vLLM's own function as the fallback); the result as vLLM returns it (``out``, or
    ``(out, lse)`` with ``return_lse``). ``again(out, lse, seq_lens, qsl)``: the public
    function with the caller's other arguments, for the capture warm-up of a family's
    first call (dcpc.engines.capture). ``out``: vLLM 0.34.0's output buffer [B, H/W, D]:
    the merge is written into it (also at W == 1, as vLLM's kernel does) and it is
    what is returned."""
    tokens = max_tokens or _free_tokens()
    backend = backend or _backend()
    instance = ubatch() if instance is None else instance
    with refusing(cp_group, cp_attn_out, label,  # every rank raises, or none
                  lambda: combine_settings(switch_name, tokens, backend), slot,
                  instance=instance):
        check_mask_args(seq_lens, query_start_loc)
        check_tensors(label, out=cp_attn_out, lse=cp_attn_lse)
        o, lse = _squeeze(cp_attn_out, cp_attn_lse)
        group = resolve_group(cp_group, o.device)
        if out is not None:
            _check_out(label, out, o, group.world)
    if group.world == 1:
        if out is None:
            return (o, lse) if return_lse else o
        return _merge_one(o, lse, seq_lens, query_start_loc, out, return_lse)
    if again is not None:
        rest = (label, id(group.handle), group.rank, seq_lens is None, return_lse,
                is_lse_base_on_e, slot, instance, backend, tokens)
        capture.first_use(
            (*rest, o.shape[1:], o.stride(), o.dtype, lse.shape[1:], lse.stride(),
             lse.dtype), lambda: (*rest, capture.layout(o), capture.layout(lse),
                                  capture.mask_kind(seq_lens, query_start_loc)),
            group.handle, label, capture_sizes, tokens,
            lambda n: again(capture.like(o, n), capture.like(lse, n),
                            *capture.mask_args(seq_lens, query_start_loc, n)),
            lambda: switch(switch_name) != "off")
    got = combine_call(
        path, o, lse, group, base2=not is_lse_base_on_e, seq_lens=seq_lens,
        qsl=query_start_loc, switch_name=switch_name, max_tokens=tokens, slots=slots,
        slot=slot, instance=instance, backend=backend, label=label, engine=engine)
    if isinstance(got, EngineResult):  # vLLM's own ran: its result, into ``out``
        return _into(out, got.value)
    got, got_lse = got
    if out is not None:  # a copy of the module's view: vLLM writes the merge in place
        got = out.copy_(got.view(out.shape))
    if not return_lse:
        return got
    # ag_rs: the LSE in cp_attn_lse's dtype (vLLM's lse); a2a: fp32
    return got, (got_lse.to(cp_attn_lse.dtype) if path == "ag_rs" else got_lse)


def _into(out: torch.Tensor | None, value: Any) -> Any:
    """A result of vLLM's own function (a tensor, or (tensor, lse)) as a call with ``out``
    returns it: the tensor copied into ``out``, ``out`` in its place."""
    if out is None:
        return value
    first = value[0] if isinstance(value, tuple) else value
    out.copy_(first.view(out.shape))
    return (out, *value[1:]) if isinstance(value, tuple) else out


def _check_out(label: str, out: torch.Tensor, o: torch.Tensor, world: int) -> None:
    """``out`` must hold this rank's heads of the merge: [B, H/W, D], a float tensor on
    the partials' device (vLLM's kernel writes it through its strides unchecked)."""
    want = (o.shape[0], o.shape[1] // max(world, 1), o.shape[2])
    if not isinstance(out, torch.Tensor):
        raise DcpcArgumentError(f"{label}: out must be a tensor [B, H/W, D] = {want}, got "
                                f"{type(out).__name__}")
    if tuple(out.shape) != want or not out.dtype.is_floating_point or \
            out.device != o.device:
        raise DcpcArgumentError(f"{label}: out has shape {tuple(out.shape)}, dtype "
                                f"{out.dtype} on {out.device}; expected {want}, a float "
                                f"dtype, on {o.device} (this rank's H/W heads of the merge)")


def _merge_one(o: torch.Tensor, lse: torch.Tensor, seq_lens: Any, qsl: Any,
               out: torch.Tensor, return_lse: bool) -> Any:
    """vLLM 0.34.0's dcp_a2a_lse_reduce with ``out=`` on one rank: the merge of one
    partial (weight 1, in either LSE base, where the LSE is finite after the empty-shard
    mask, else 0 with LSE -inf; NaN and +inf count as -inf), written into ``out``."""
    lse32 = lse.float() if seq_lens is None else mask_at_source(lse.float(), seq_lens, qsl)
    lse32 = torch.where(torch.isnan(lse32) | (lse32 == float("inf")),
                        torch.full_like(lse32, float("-inf")), lse32)
    live = torch.isfinite(lse32).unsqueeze(-1)
    out.copy_(torch.where(live, o.float(), torch.zeros((), dtype=torch.float32,
                                                       device=o.device)))
    return (out, lse32) if return_lse else out


# ---- the free functions -----------------------------------------------------------------
def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None,
                     **engine_kwargs: Any) -> Any:
    """vLLM's cp_lse_ag_out_rs: [B, H, D] partials of all heads -> this rank's heads
    [B, H/W, D] (rank r: heads r*H/W ..), with ``return_lse`` also the global LSE of
    those heads [B, H/W] in cp_attn_lse's dtype. ``ctx`` (the Triton context) is unused."""
    engine = engine_fallback("cp_lse_ag_out_rs", cp_attn_out, cp_attn_lse, cp_group, ctx,
                             return_lse, is_lse_base_on_e, seq_lens, query_start_loc,
                             **engine_kwargs)
    if _engine_only("cp_lse_ag_out_rs", engine_kwargs, engine):
        return engine()
    return vllm_combine("ag_rs", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                        is_lse_base_on_e, seq_lens, query_start_loc, switch_name=AG_RS_SWITCH,
                        label="cp_lse_ag_out_rs", engine=engine,
                        again=lambda o, lse, s, q: cp_lse_ag_out_rs(
                            o, lse, cp_group, ctx, return_lse, is_lse_base_on_e, s, q,
                            **engine_kwargs))


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       ctx: Any = None, return_lse: bool = False,
                       is_lse_base_on_e: bool = True, seq_lens: torch.Tensor | None = None,
                       query_start_loc: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, **engine_kwargs: Any) -> Any:
    """vLLM's dcp_a2a_lse_reduce: as cp_lse_ag_out_rs, through one fused all-to-all +
    merge; the returned LSE is fp32. H % W != 0 raises (a ValueError, as vLLM).
    ``out`` (vLLM 0.34.0): a [B, H/W, D] buffer the merge is written into and returned
    (a copy of the module's result), also at W == 1."""
    # vLLM's own, as the fallback, returns a fresh result that vllm_combine copies into out
    # (0.33.0's takes no out=)
    engine = engine_fallback("dcp_a2a_lse_reduce", cp_attn_out, cp_attn_lse, cp_group, ctx,
                             return_lse, is_lse_base_on_e, seq_lens, query_start_loc,
                             **engine_kwargs)
    if _engine_only("dcp_a2a_lse_reduce", engine_kwargs, engine):
        return _into(out, engine())
    return vllm_combine("fused", cp_attn_out, cp_attn_lse, cp_group, return_lse,
                        is_lse_base_on_e, seq_lens, query_start_loc, switch_name=A2A_SWITCH,
                        label="dcp_a2a_lse_reduce", engine=engine, out=out,
                        again=lambda o, lse, s, q: dcp_a2a_lse_reduce(
                            o, lse, cp_group, ctx, return_lse, is_lse_base_on_e, s, q,
                            **engine_kwargs))


def v_up_proj_first_min_tokens() -> int:
    """vLLM's own threshold of the W_UV-fused merge (its module's
    ``_V_UP_PROJ_FIRST_MIN_TOKENS``, when install() saved vLLM's function), else
    V_UP_PROJ_FIRST_MIN_TOKENS: below it the latent is merged first."""
    theirs = _originals.get("dcp_a2a_v_up_proj_lse_reduce")
    found = getattr(theirs, "__globals__", {}).get("_V_UP_PROJ_FIRST_MIN_TOKENS")
    return found if isinstance(found, int) and not isinstance(found, bool) \
        else V_UP_PROJ_FIRST_MIN_TOKENS


def v_up_proj_merge(label: str, latent: torch.Tensor, w_uv: torch.Tensor,
                    out: torch.Tensor, rank: int, world: int, merge: Any) -> None:
    """vLLM 0.34.0's W_UV-fused merge over a merge function ``merge(x, out)`` (the a2a
    merge of partials ``x`` [B, H, C] into ``out`` [B, H/W, C], or a fresh result when
    ``out`` is None): ``latent`` [B, H, L] of all H heads, ``w_uv`` [H, L, V] of all
    heads in rank order, ``out`` [B, H/W * V] this rank's up-projected heads. From
    v_up_proj_first_min_tokens() tokens up each head is projected first, then merged (the
    all-to-all moves V values per head instead of L); below, the latent is merged, then
    this rank's heads are projected. The merge is linear per head, so both orders agree
    up to rounding."""
    if latent.dim() != 3 or w_uv.dim() != 3 or w_uv.shape[:2] != latent.shape[1:]:
        raise DcpcArgumentError(f"{label}: w_uv has shape {tuple(w_uv.shape)}, expected "
                                f"[H, L, V] for partials {tuple(latent.shape)} [B, H, L]")
    b, h, _ = latent.shape
    v, part = w_uv.shape[-1], h // max(world, 1)
    if h % world or not isinstance(out, torch.Tensor) or out.numel() != b * part * v:
        raise DcpcArgumentError(f"{label}: out must hold [B, H/W * V] = [{b}, {part * v}] "
                                f"values (this rank's heads), got "
                                f"{tuple(getattr(out, 'shape', ()))} for {h} heads over "
                                f"{world} ranks")
    if b < v_up_proj_first_min_tokens():
        merged = merge(latent, None)
        torch.bmm(merged.transpose(0, 1), w_uv[rank * part:(rank + 1) * part],
                  out=out.view(b, part, v).transpose(0, 1))
        return
    projected = latent.new_empty((b, h, v))
    # (H, B, L) x (H, L, V) -> (H, B, V), written transposed into (B, H, V)
    torch.bmm(latent.transpose(0, 1), w_uv, out=projected.transpose(0, 1))
    merge(projected, out.view(b, part, v))


def dcp_a2a_v_up_proj_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor,
                                 w_uv: torch.Tensor, out: torch.Tensor, cp_group: Any,
                                 is_lse_base_on_e: bool = True,
                                 seq_lens: torch.Tensor | None = None,
                                 query_start_loc: torch.Tensor | None = None) -> None:
    """vLLM 0.34.0's dcp_a2a_v_up_proj_lse_reduce: the a2a merge of MLA's partial latent
    outputs [B, H, L] with the up-projection ``w_uv`` [H, L, V] (all heads, rank order)
    into ``out`` [B, H/W * V] (see v_up_proj_merge), through dcpc's
    dcp_a2a_lse_reduce (the fused module, or its fallbacks)."""
    group = resolve_group(cp_group, cp_attn_out.device)

    def merge(x: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        return dcp_a2a_lse_reduce(x, cp_attn_lse, cp_group,
                                  is_lse_base_on_e=is_lse_base_on_e, seq_lens=seq_lens,
                                  query_start_loc=query_start_loc, out=into)

    v_up_proj_merge("dcp_a2a_v_up_proj_lse_reduce", cp_attn_out, w_uv, out, group.rank,
                    group.world, merge)


def cp_lse_ag_out_ar(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                     ctx: Any = None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     seq_lens: torch.Tensor | None = None,
                     query_start_loc: torch.Tensor | None = None) -> Any:
    """vLLM's cp_lse_ag_out_ar (PCP + DCP): the corrected output of ALL heads [B, H, D]
    (all-reduce) and the full LSE [B, H]. No dcpc schedule: vLLM's own after install(),
    else torch collectives (fp32)."""
    theirs = engine_fallback("cp_lse_ag_out_ar", cp_attn_out, cp_attn_lse, cp_group, ctx,
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
    """vLLM's own function when vLLM is installed; else vLLM 0.34.0's formula:
    min(max_num_batched_tokens, max(max_num_seqs * tokens_per_seq, the largest CUDA-graph
    capture size)) with tokens_per_seq = max(1 + k, max_decode_query_len), k speculative
    tokens and max_decode_query_len = 1 + k + the speculator's extra drafting slots
    (``max_num_new_slots_for_drafting``; 1 without a speculative config). 0.34.0
    deprecated ``parallel_drafting`` (no effect): its slots are counted there."""
    theirs = None
    for where in MODULES:
        try:
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
    widest = 1  # vLLM's max_decode_query_len
    if spec is not None and getattr(spec, "num_speculative_tokens", None) is not None:
        widest = (1 + spec.num_speculative_tokens
                  + (getattr(spec, "max_num_new_slots_for_drafting", 0) or 0))
    per_seq = max(1 + k, widest)
    sched = vllm_config.scheduler_config
    graphs = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return min(sched.max_num_batched_tokens, max(sched.max_num_seqs * per_seq, graphs))


__all__ = ["A2A_SWITCH", "AG_RS_SWITCH", "DEFAULT_MAX_NUM_TOKENS", "ENGINE_ONLY",
           "KV_GATHER_SWITCH", "MODULES", "Q_GATHER_SWITCH", "V_UP_PROJ_FIRST_MIN_TOKENS",
           "capture_sizes", "correct_attn_out", "cp_lse_ag_out_ar", "cp_lse_ag_out_rs",
           "dcp_a2a_lse_reduce", "dcp_a2a_v_up_proj_lse_reduce", "engine_fallback",
           "forget_config", "get_dcp_workspace_max_num_tokens", "keep_original",
           "note_config", "set_workspace", "ubatch", "v_up_proj_first_min_tokens",
           "v_up_proj_merge", "vllm_combine", "workspace_choice", "workspace_set"]
