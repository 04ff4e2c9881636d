"""Putting dcpc's adapters over vLLM's DCP functions: which layout this vLLM has, and
the names to patch in it.

Two layouts are known (docs/engines.md, "Versions"):

- ``0.33.0``: vLLM 0.33.0's ``vllm.v1.attention.ops.dcp`` defines cp_lse_ag_out_rs,
  dcp_a2a_lse_reduce, cp_lse_ag_out_ar and MLADCPManager with
  ``init_kv_gather(workspace, max_gathered_tokens)``;
- ``main``: vLLM's git main (read at commit 1d57ea3a and a later snapshot of
  vllm/v1/attention/ops/dcp_utils.py, 2026-12) moved the managers to
  ``vllm.v1.attention.ops.dcp_utils`` (MLADCPKVGather, MLADCPManager deriving from it,
  ``init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim, dtype) -> bool``,
  ``direct_kv_gather``); the free functions are defined in ``ops.common`` and
  ``ops.dcp_alltoall`` and imported by name into dcp_utils, so the same rebinding
  reaches every binding.

The layout is recognised by what the module holds (the names and init_kv_gather's
parameters), not by a version string. Anything else: nothing is patched, vLLM's own
path stays, one warning says why, and install() returns [] (it runs inside vLLM's
plugin loader: it never raises for a layout it does not know).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from dcpc.engines import capture
from dcpc.engines import vllm as V
from dcpc.engines.call_ids import forward_hook, layer_hook
from dcpc.engines.common import log, log_once, rebind

FREE = ("cp_lse_ag_out_rs", "dcp_a2a_lse_reduce")  # replaced by dcpc's
KEPT = ("cp_lse_ag_out_ar",)  # not replaced (no dcpc schedule): vLLM's own is called
KV_033 = ["workspace", "max_gathered_tokens"]
KV_MAIN = ["max_gathered_tokens", "token_dim", "plane_split_dim", "dtype"]
MODULES = ("vllm.v1.attention.ops.dcp", "vllm.v1.attention.ops.dcp_utils")
# where a forward begins and which attention layer runs (vLLM 0.33.0): the call ids
CALL_HOOKS = (("vllm.forward_context", "set_forward_context", forward_hook),
              ("vllm.model_executor.layers.attention.attention", "get_attention_context",
               layer_hook))


@dataclass(frozen=True)
class Layout:
    """A vLLM DCP layout met: its name, the module holding the names, and dcpc's
    replacement of each name patched."""

    name: str
    module: Any
    ours: dict[str, Any]


def _ours(kv: list[str]) -> dict[str, Any]:
    free = {name: getattr(V, name) for name in FREE}
    if kv == KV_033:
        return {**free, "MLADCPManager": V.MLADCPManager}
    from dcpc.engines.vllm_kv import MLADCPKVGather, MLADCPManagerMain

    return {**free, "MLADCPManager": MLADCPManagerMain, "MLADCPKVGather": MLADCPKVGather}


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _classify(module: Any) -> tuple[Layout | None, str]:
    """The layout of one candidate module, or (None, why not)."""
    namespace = vars(module)
    missing = [n for n in (*FREE, *KEPT, "MLADCPManager") if n not in namespace]
    if missing:
        return None, f"{module.__name__} has no {', '.join(missing)}"
    manager = namespace["MLADCPManager"]
    init = getattr(manager, "init_kv_gather", None)
    kv = KV_033 if init is None else _params(init)[1:]  # none: as the checks before
    if kv == KV_033:
        name = "0.33.0"
    elif kv == KV_MAIN and hasattr(manager, "direct_kv_gather"):
        name = "main"
    else:
        return None, (f"{module.__name__}.MLADCPManager.init_kv_gather({', '.join(kv)}) is "
                      f"neither 0.33.0's ({', '.join(KV_033)}) nor main's "
                      f"({', '.join(KV_MAIN)}) with direct_kv_gather")
    ours = _ours(kv)
    if name == "main" and "MLADCPKVGather" not in namespace:
        ours.pop("MLADCPKVGather")
    for fn in FREE:  # vLLM's parameters must sit where ours take them (extras by keyword)
        theirs, mine = _params(namespace[fn]), _params(ours[fn])
        shared = [p for p in theirs if p in mine]
        if shared != theirs[: len(shared)] or shared != mine[: len(shared)]:
            return None, (f"{module.__name__}.{fn}({', '.join(theirs)}) does not take "
                          f"dcpc's arguments in dcpc's order ({', '.join(mine[:8])})")
    return Layout(name, module, ours), ""


def known_layout() -> tuple[Layout | None, str]:
    """The first module of MODULES that imports and holds a known layout, else
    (None, every reason)."""
    why = []
    for where in MODULES:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001 - any import error leaves vLLM's path
            why.append(f"{where} does not import ({type(err).__name__}: {err})")
            continue
        layout, reason = _classify(module)
        if layout is not None:
            return layout, ""
        why.append(reason)
    return None, "; ".join(why)


def install(max_num_tokens: int | None = None) -> list[str]:
    """Put dcpc's functions over vLLM's in every module that holds them (``from ...
    import`` bindings included), keeping vLLM's own as the fallback of calls dcpc does
    not take (more tokens than the workspace, an unsupported dtype, a switch at 0, a
    keyword of vLLM main's that asks for its own path) and for PCP's all-reduce.
    ``max_num_tokens``: the free functions' workspace (else DCPC_MAX_NUM_TOKENS, else
    vLLM's config, else 256: see dcpc.engines.vllm.workspace_choice). Idempotent;
    returns the bindings patched. Call it from a vLLM general plugin (docs/engines.md,
    "Switching vLLM"). For a layout it does not know it patches nothing, logs why once
    and returns []: vLLM's own path stays."""
    layout, why = known_layout()
    if layout is None:
        log_once("vllm-layout", f"dcpc.engines.vllm.install(): vLLM's own DCP path stays: "
                 f"{why} (the adapters know vLLM 0.33.0's and git main's layouts)")
        return []
    if max_num_tokens is not None:
        V._installed_tokens[:] = [int(max_num_tokens)]
        V._free_tokens.cache_clear()
    tokens, source = V.workspace_choice()
    if source.startswith("vLLM"):  # kept: in forward no config is current any more
        V._installed_tokens[:] = [tokens]
        V._free_tokens.cache_clear()
    sizes = capture.at_install("vllm", capture.vllm_sizes_now)  # kept likewise
    log.info("dcpc.engines.vllm.install(): vLLM's %s layout (%s); the free functions' "
             "workspace is %d tokens (%s); %s", layout.name, layout.module.__name__, tokens,
             source, capture.said(*sizes))
    namespace = vars(layout.module)
    patched: list[str] = []
    for name in (*layout.ours, *KEPT):
        old = namespace[name]
        if not V._is_ours(old):  # never keep a dcpc function as vLLM's own: its
            V._originals.setdefault(name, old)  # fallback would recurse
        new = layout.ours.get(name)
        if new is not None and old is not new:
            patched += rebind(name, old, new)
    return patched + hook_calls()


def hook_calls() -> list[str]:
    """Wrap vLLM's ``set_forward_context`` (a forward begins) and ``get_attention_context``
    (its custom attention ops name the layer) in every module that holds them, for the
    call ids (dcpc.engines.call_ids). Idempotent; a module that does not import, or has
    no such function, is logged (info) and left alone (no ids from it)."""
    patched: list[str] = []
    for where, name, hook in CALL_HOOKS:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001 - any import error: no hook, no ids
            log.info("dcpc.engines.vllm.install(): no call ids from %s (%s does not import: "
                     "%s: %s)", name, where, type(err).__name__, err)
            continue
        old = vars(module).get(name)
        if old is None:
            log.info("dcpc.engines.vllm.install(): no call ids from %s (%s has none)", name,
                     where)
            continue
        new = hook(old)
        if new is not old:
            patched += rebind(name, old, new)
    return patched


__all__ = ["Layout", "hook_calls", "install", "known_layout"]
