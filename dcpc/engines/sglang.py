"""SGLang's DCP interface (sglang/srt/layers/dcp, SGLang 0.5.23) on dcpc modules.

- ``dcp_a2a_lse_reduce``: the output of this rank's heads [B, H/W, D] (dcpc path
  ``fused``); no masking, no LSE returned, as SGLang;
- ``cp_lse_ag_out_rs_mla``: the ag_rs combine in fp32, head-major [H/W, B, D] (a
  transposed view), default base 2 as SGLang;
- ``all_gather_q_for_mla_decode``: the query gather of (q_nope, q_pe) along heads.

Results are views of the modules' persistent buffers (valid until the next call of
the same shapes). The group is SGLang's GroupCoordinator (``get_dcp_group()`` when
not given), a torch ProcessGroup or a dcpc LocalRank. Switches: ``DCPC_SGLANG``
(unset = auto, 1 = force, 0 = torch fallback), ``DCPC_BACKEND``, ``DCPC_MAX_NUM_TOKENS``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

import torch

from dcpc.engines import capture, runners
from dcpc.engines.agree import agree, refusing
from dcpc.engines.call_ids import begin_forward, enter_layer
from dcpc.engines.combine import (
    GatherRunner,
    check_tensors,
    combine_call,
    combine_settings,
    reset,
)
from dcpc.engines.common import (
    DTYPE_NAMES,
    GatherSpec,
    log,
    log_once,
    rebind,
    resolve_group,
    switch,
)
from dcpc.engines.fallback import Comm
from dcpc.runtime.errors import DcpcArgumentError

SWITCH = "DCPC_SGLANG"
DEFAULT_MAX_NUM_TOKENS = 256


_installed_tokens: list[int] = []  # install(): the free functions' workspace


def _tokens() -> int:
    """The free functions' workspace: DCPC_MAX_NUM_TOKENS, else what install() chose
    (``max_num_tokens=``, else SGLang's graph batch sizes), else 256."""
    env = os.environ.get("DCPC_MAX_NUM_TOKENS")
    if env:
        return int(env)
    return _installed_tokens[0] if _installed_tokens else DEFAULT_MAX_NUM_TOKENS


def _server_args() -> Any:
    """SGLang's server args of this process, or None (not SGLang, or not set yet)."""
    try:
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()
    except Exception:  # noqa: BLE001 - ImportError, or SGLang's ValueError: not set yet
        return None


def _capture_sizes() -> tuple[list[int] | None, str]:
    """SGLang's graph batch sizes in tokens (dcpc.engines.capture)."""
    def now() -> tuple[list[int] | None, str]:
        args = _server_args()
        return (None, "no SGLang server args") if args is None else capture.sglang_sizes(args)

    return capture.sizes_for("sglang", now)


def _warm(tensors: tuple[torch.Tensor, ...], extra: Any, group: Any, label: str,
          call: Any) -> None:
    """The capture warm-up of a family's first call (dcpc.engines.capture)."""
    tokens = _tokens()
    rest = ("sglang", label, id(group.handle), group.rank, extra, _backend(), tokens)
    capture.first_use((*rest, *[(t.shape[1:], t.stride(), t.dtype) for t in tensors]),
                      lambda: (*rest, *[capture.layout(t) for t in tensors]), group.handle,
                      label, _capture_sizes, tokens, call, lambda: switch(SWITCH) != "off")


def _backend() -> str:
    return os.environ.get("DCPC_BACKEND", "auto")


def _dcp_group() -> Any:
    from sglang.srt.distributed.parallel_state import get_dcp_group

    return get_dcp_group()


def _combine(path: str, out: torch.Tensor, lse: torch.Tensor, cp_group: Any, base_e: bool,
             label: str, again: Any) -> torch.Tensor:
    """One combine without SGLang's mask arguments: ``out`` itself on a group of one,
    else [B, H/W, D] of this rank's heads. ``again(out, lse)``: the public function,
    for the capture warm-up."""
    with refusing(cp_group, out, label, lambda: combine_settings(SWITCH, _tokens(), _backend())):
        check_tensors(label, out=out, lse=lse)  # every rank raises, or none
    group = resolve_group(cp_group, out.device)
    if group.world == 1:
        return out
    _warm((out, lse), base_e, group, label,
          lambda n: again(capture.like(out, n), capture.like(lse, n)))
    got, _ = combine_call(path, out, lse, group, base2=not base_e, seq_lens=None, qsl=None,
                          switch_name=SWITCH, max_tokens=_tokens(), backend=_backend(),
                          label=label)
    return got


def dcp_a2a_lse_reduce(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                       is_lse_base_on_e: bool = True, cuda_graph_buffers: dict | None = None,
                       comm_backend: str = "a2a") -> torch.Tensor:
    """SGLang's dcp_a2a_lse_reduce: [B, H, D] partials of all heads and their fp32 LSE
    [B, H] -> [B, H/W, D] of this rank's heads (the input itself on a group of one, as
    SGLang, before any check). ``cuda_graph_buffers`` is not needed (the module's
    buffers are persistent); every ``comm_backend`` (``a2a``, ``fi_a2a``) runs the same
    dcpc path."""
    if resolve_group(cp_group, cp_attn_out.device).world == 1:
        return cp_attn_out
    with refusing(cp_group, cp_attn_out, "dcp_a2a_lse_reduce",
                  lambda: combine_settings(SWITCH, _tokens(), _backend())):
        if cp_attn_lse.dtype != torch.float32:  # every rank raises, or none
            raise DcpcArgumentError(f"dcp_a2a_lse_reduce: the LSE must be float32, got "
                                    f"{cp_attn_lse.dtype}")
    return _combine("fused", cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e,
                    "dcp_a2a_lse_reduce", lambda o, lse: dcp_a2a_lse_reduce(
                        o, lse, cp_group, is_lse_base_on_e, cuda_graph_buffers, comm_backend))


def cp_lse_ag_out_rs_mla(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any,
                         ctx: Any = None, is_lse_base_on_e: bool = False) -> torch.Tensor:
    """SGLang's cp_lse_ag_out_rs_mla: [B, H, D] partials -> this rank's heads, head-major
    [H/W, B, D] in cp_attn_out's dtype (corrected and summed in fp32). Unlike SGLang, a
    NaN partial with weight 0 (an empty shard) contributes 0, not NaN."""
    out = _combine("ag_rs", cp_attn_out, cp_attn_lse, cp_group, is_lse_base_on_e,
                   "cp_lse_ag_out_rs_mla", lambda o, lse: cp_lse_ag_out_rs_mla(
                       o, lse, cp_group, ctx, is_lse_base_on_e))
    return out if out is cp_attn_out else out.transpose(0, 1)


def all_gather_q_for_mla_decode(q_nope_out: torch.Tensor, q_pe: torch.Tensor,
                                group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's all_gather_q_for_mla_decode: (q_nope [B, H/W, Dn], q_pe [B, H/W, Dpe])
    of this rank's heads -> ([B, H, Dn], [B, H, Dpe]) of all heads, rank order: views
    of one gathered [B, H, Dpe + Dn] buffer (SGLang's are transposed views too)."""
    given = group
    cp_group = _dcp_group() if group is None else group
    with refusing(cp_group, q_pe, "all_gather_q_for_mla_decode", _gather_settings):
        check_tensors("all_gather_q_for_mla_decode", q_nope=q_nope_out, q_pe=q_pe)
        if q_nope_out.shape[:2] != q_pe.shape[:2] or q_nope_out.dtype != q_pe.dtype:
            raise DcpcArgumentError(
                f"all_gather_q_for_mla_decode: q_nope {tuple(q_nope_out.shape)} "
                f"{q_nope_out.dtype} and q_pe {tuple(q_pe.shape)} {q_pe.dtype} must agree "
                "in tokens, heads and dtype")  # every rank raises, or none
    group = resolve_group(cp_group, q_pe.device)
    if group.world == 1:
        return q_nope_out, q_pe
    _warm((q_nope_out, q_pe), None, group, "all_gather_q_for_mla_decode",
          lambda n: all_gather_q_for_mla_decode(
              capture.like(q_nope_out, n), capture.like(q_pe, n), given))
    dpe = q_pe.shape[2]
    combined = torch.cat([q_pe, q_nope_out], dim=-1)  # [B, H/W, Dpe + Dn], as SGLang
    full = _gather(group, combined)
    return full[..., dpe:], full[..., :dpe]


def _gather_settings() -> dict[str, Any]:
    return {SWITCH: switch(SWITCH), "workspace tokens": _tokens(), "backend": _backend()}


def _gather(group: Any, combined: torch.Tensor) -> torch.Tensor:
    tokens, local_heads, d = combined.shape
    settings = _gather_settings()
    mode = settings[SWITCH]
    agree(group, "all_gather_q_for_mla_decode", settings, Comm(group).all_gather)
    why = "" if combined.dtype in DTYPE_NAMES else f"dtype {combined.dtype}"
    if mode == "on" and why:
        raise DcpcArgumentError(f"all_gather_q_for_mla_decode: {SWITCH}=1 but {why}")
    if mode != "off" and not why:
        spec = GatherSpec("q", d, DTYPE_NAMES[combined.dtype], _tokens())
        r = runners.runner(GatherRunner, spec, group, local_heads * group.world, _backend())
        runners.used(group, "all_gather_q_for_mla_decode", r, 0)
        if r.fits(tokens):
            return r.run(combined)
        r.skip(combined)  # every rank falls back, or every rank fails
        why = f"{tokens} tokens exceed the workspace {_tokens()}"
    if why:
        log_once(f"sglang-q:{why}", f"all_gather_q_for_mla_decode: torch fallback: {why}")
    parts = Comm(group).all_gather(combined)  # [W, B, H/W, D]
    return parts.permute(1, 0, 2, 3).reshape(tokens, -1, d)


PATCHED = ("dcp_a2a_lse_reduce", "cp_lse_ag_out_rs_mla", "all_gather_q_for_mla_decode")


def install(max_num_tokens: int | None = None) -> list[str]:
    """Put this module's functions over SGLang's (sglang.srt.layers.dcp.comm), once,
    and choose the free functions' workspace (DCPC_MAX_NUM_TOKENS, read at each call,
    wins; else ``max_num_tokens``, else SGLang's largest graph batch in tokens when its
    server args are set, else 256) and the CUDA-graph capture sizes warmed up
    (dcpc.engines.capture); one INFO line says both:

    - from a plugin, inside SGLang's ``load_plugins()``: REPLACE hooks in SGLang's
      HookRegistry only, which SGLang applies after its plugins ran (rewriting ``from
      ... import`` bindings too). SGLang sets its ``_plugins_loaded`` flag BEFORE it
      runs the plugins, so the flag cannot tell this case from a late call: the call
      stack does (a ``load_plugins`` frame of ``sglang.srt.plugins``). Assigning here
      as well made SGLang wrap dcpc's function a second time;
    - before SGLang loads its plugins (the flag unset): the hooks, as above;
    - later (plugins loaded, not inside ``load_plugins``), or an SGLang without the
      registry: by assignment now, in every module that holds SGLang's functions (no
      hooks: nothing would apply them).

    Returns the hook targets registered or the bindings assigned."""
    _choose(max_num_tokens)
    ours = {name: globals()[name] for name in PATCHED}
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        HookRegistry = None  # noqa: N806 - an older SGLang: patch by hand
    if HookRegistry is not None:
        import sglang.srt.plugins as plugins

        if not getattr(plugins, "_plugins_loaded", False) or _inside_load_plugins():
            done = []
            for name in PATCHED:
                target = f"sglang.srt.layers.dcp.comm.{name}"
                HookRegistry.register(target, ours[name], HookType.REPLACE)
                done.append(target)
            before = getattr(HookType, "BEFORE", None)  # SGLang 0.5.23 has it
            for target, hook in CALL_HOOKS.items() if before is not None else ():
                HookRegistry.register(target, hook, before)  # the call ids' forward, layer
                done.append(target)
            return done  # load_plugins() applies them in this process
    import sglang.srt.layers.dcp.comm as comm

    missing = [name for name in PATCHED if name not in vars(comm)]
    if missing:
        raise ImportError(f"dcpc.engines.sglang.install(): sglang.srt.layers.dcp.comm has "
                          f"no {', '.join(missing)} (the adapters follow SGLang 0.5.23)")
    done = []
    for name in PATCHED:
        old = vars(comm)[name]
        if old is not ours[name]:
            done += rebind(name, old, ours[name])
    return done + _hook_methods()


def _before_forward(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``ModelRunner.forward``: a forward begins (dcpc.engines.call_ids)."""
    begin_forward()


def _before_attention(layer: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``RadixAttention.forward``: its ``layer_id`` runs next. DeepSeek's query
    gather (forward_mla.py) runs before its layer's RadixAttention: it carries the
    previous layer's id (the same on every rank: a skip is still seen)."""
    layer_id = getattr(layer, "layer_id", None)
    # not while torch.compile traces it (a context variable is unsupported there)
    if type(layer_id) is int and not torch.compiler.is_compiling():
        enter_layer(layer_id)  # else the previous layer stays (alike on every rank)


CALL_HOOKS = {"sglang.srt.model_executor.model_runner.ModelRunner.forward": _before_forward,
              "sglang.srt.layers.radix_attention.RadixAttention.forward": _before_attention}


def _hook_methods() -> list[str]:
    """Without SGLang's HookRegistry: wrap the two methods of CALL_HOOKS by hand (once)."""
    done = []
    for target, hook in CALL_HOOKS.items():
        where, cls_name, method = target.rsplit(".", 2)
        try:
            cls = getattr(importlib.import_module(where), cls_name)
        except Exception as err:  # noqa: BLE001 - no hook, no ids from it
            log.info("dcpc.engines.sglang.install(): no call ids from %s (%s: %s)", target,
                     type(err).__name__, err)
            continue
        original = vars(cls).get(method)
        if original is None or getattr(original, "_dcpc_hook", False):
            continue

        def hooked(*args: Any, _original: Any = original, _hook: Any = hook,
                   **kwargs: Any) -> Any:
            _hook(*args, **kwargs)
            return _original(*args, **kwargs)

        functools.update_wrapper(hooked, original)
        hooked._dcpc_hook = True  # type: ignore[attr-defined]
        setattr(cls, method, hooked)
        done.append(target)
    return done


def _choose(max_num_tokens: int | None) -> None:
    """install()'s workspace and capture sizes (see install), said in one line."""
    sizes = capture.at_install("sglang", _capture_sizes)
    args = _server_args()
    if max_num_tokens is not None:
        _installed_tokens[:], source = [int(max_num_tokens)], "install(max_num_tokens=)"
    elif args is not None and (sizes[0] or getattr(args, "cuda_graph_max_bs", None)):
        per = capture.tokens_per_batch(args)
        largest = max(getattr(args, "cuda_graph_bs", None) or [args.cuda_graph_max_bs])
        _installed_tokens[:] = [int(largest) * per]
        source = f"SGLang's largest graph batch {largest} x {per} token(s)"
    else:
        _installed_tokens[:], source = [], "the default: no SGLang server args"
    if os.environ.get("DCPC_MAX_NUM_TOKENS"):
        source = "DCPC_MAX_NUM_TOKENS"
    log.info("dcpc.engines.sglang.install(): the free functions' workspace is %d tokens "
             "(%s); %s", _tokens(), source, capture.said(*sizes))


def _inside_load_plugins() -> bool:
    """Called (indirectly) from SGLang's ``load_plugins()``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "load_plugins" and \
                str(frame.f_globals.get("__name__", "")).startswith("sglang.srt.plugins"):
            return True
        frame = frame.f_back
    return False


__all__ = ["all_gather_q_for_mla_decode", "cp_lse_ag_out_rs_mla", "dcp_a2a_lse_reduce",
           "install", "reset"]
