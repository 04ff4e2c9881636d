"""Putting dcpc's adapters over vLLM's DCP functions: where this vLLM keeps them, and
which of them dcpc can stand in for (the contract check).

Where (``dcpc.engines.vllm_free.MODULES``, the first that imports and holds a replaced
name):

- ``vllm.v1.attention.ops.dcp``: the releases, vLLM 0.33.0 and 0.34.0 (cp_lse_ag_out_rs,
  dcp_a2a_lse_reduce, cp_lse_ag_out_ar, MLADCPManager with
  ``init_kv_gather(workspace, max_gathered_tokens)``; 0.34.0 adds
  dcp_a2a_v_up_proj_lse_reduce, ``dcp_a2a_lse_reduce(..., out=)`` and the manager's
  ``v_up_proj_combine`` and ``direct_query_gather_max_tokens``);
- ``vllm.v1.attention.ops.dcp_utils``: open vLLM PR #52239 (unreleased; read at commit
  1d57ea3a and a later snapshot, 2026-12): MLADCPKVGather, MLADCPManager deriving from
  it, ``init_kv_gather(max_gathered_tokens, token_dim, plane_split_dim, dtype) -> bool``,
  ``direct_kv_gather``; the free functions defined in ``ops.common`` and
  ``ops.dcp_alltoall`` and imported by name into dcp_utils (the same rebinding reaches
  every binding).

Which (dcpc.engines.contract): each replaced name is a piece (dcpc.engines.vllm_pieces).
A function is replaced when dcpc's takes every parameter of vLLM's (same position, same
default; open PR #52239's ``use_b12x`` keywords through ``ENGINE_ONLY``); a class when
dcpc's has every public attribute and method of vLLM's (read from vLLM's source, its
bases included) and takes every method's parameters. Any difference keeps vLLM's own
piece and logs one WARNING naming it and what differs; the other pieces are still
replaced. A vLLM where neither module imports or holds a name: nothing is patched, one
warning says why, install() returns [] (it runs inside vLLM's plugin loader: it never
raises).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from dcpc.engines import capture
from dcpc.engines import vllm_free as F
from dcpc.engines.call_ids import forward_hook, layer_hook
from dcpc.engines.common import log, log_once, rebind
from dcpc.engines.contract import compare_callable, compare_class
from dcpc.engines.vllm_pieces import CLASSES, FREE, KEPT, candidates

LAYOUT_NAMES = {  # what each module of F.MODULES is
    "vllm.v1.attention.ops.dcp": "vLLM's released layout (vllm.v1.attention.ops.dcp: "
                                 "0.33.0, 0.34.0)",
    "vllm.v1.attention.ops.dcp_utils": "open vLLM PR #52239's layout "
                                       "(vllm.v1.attention.ops.dcp_utils, unreleased)",
}


def _note_forward(*args: Any, **kwargs: Any) -> None:
    """set_forward_context(attn_metadata, vllm_config, ...): the config of the forward."""
    F.note_config(kwargs.get("vllm_config", args[1] if len(args) > 1 else None))


# where a forward begins (and its config) and which attention layer runs: the call ids
CALL_HOOKS = (("vllm.forward_context", "set_forward_context",
               lambda old: forward_hook(old, before=_note_forward)),
              ("vllm.model_executor.layers.attention.attention", "get_attention_context",
               layer_hook))


@dataclass(frozen=True)
class Layout:
    """A vLLM DCP layout met: its name, the module holding the names, dcpc's replacement
    of each name it replaces, and why each name it keeps as vLLM's is kept."""

    name: str
    module: Any
    ours: dict[str, Any]
    kept: dict[str, list[str]]


def contract(name: str, theirs: Any) -> tuple[Any | None, list[str]]:
    """(dcpc's stand-in for vLLM's ``theirs``, []) when one holds its contract, else
    (None, what differs for the closest one)."""
    best: list[str] | None = None
    for mine in candidates(name):
        if isinstance(theirs, type) and isinstance(mine, type):
            diffs = compare_class(name, theirs, mine)
        elif callable(theirs) and not isinstance(theirs, type):
            diffs = compare_callable(name, theirs, mine, engine_only=F.ENGINE_ONLY)
        else:
            diffs = [f"{name}: vLLM's is a {type(theirs).__name__}, dcpc's a "
                     f"{type(mine).__name__}"]
        if not diffs:
            return mine, []
        if best is None or len(diffs) < len(best):
            best = diffs
    return None, best or []


def _layout(module: Any) -> Layout | None:
    namespace = vars(module)
    present = [n for n in (*FREE, *CLASSES) if n in namespace]
    if not present:
        return None
    ours, kept = {}, {}
    for name in present:
        mine, diffs = contract(name, namespace[name])
        if mine is not None:
            ours[name] = mine
        else:
            kept[name] = diffs
    name = LAYOUT_NAMES.get(module.__name__, module.__name__)
    return Layout(name, module, ours, kept)


def known_layout() -> tuple[Layout | None, str]:
    """The first module of F.MODULES that imports and holds a replaced name, with the
    contract check of each name, else (None, every reason)."""
    why = []
    for where in F.MODULES:
        try:
            module = importlib.import_module(where)
        except Exception as err:  # noqa: BLE001 - any import error leaves vLLM's path
            why.append(f"{where} does not import ({type(err).__name__}: {err})")
            continue
        layout = _layout(module)
        if layout is not None:
            return layout, ""
        why.append(f"{where} holds none of {', '.join((*FREE, *CLASSES))}")
    return None, "; ".join(why)


def _settings_said() -> str:
    """install()'s words for the workspace and the capture sizes (decided later, at the
    first call, unless an override is set now)."""
    if F.workspace_set():
        tokens, source = F.workspace_choice()
        ws = f"the free functions' workspace is {tokens} tokens ({source})"
    else:
        ws = ("the free functions' workspace comes from vLLM's config once one is seen (the "
              "manager's construction in load_model, the first forward's "
              "set_forward_context, or the config current at the first call)")
    sizes = os.environ.get(capture.SIZES_ENV)
    cs = (f"CUDA-graph capture sizes {capture.SIZES_ENV}={sizes}" if sizes else
          "the CUDA-graph capture sizes likewise")
    return f"{ws}; {cs}"


def install(max_num_tokens: int | None = None) -> list[str]:
    """Put dcpc's functions over vLLM's in every module that holds them (``from ...
    import`` bindings included), each one whose contract dcpc holds (see the module's
    docstring: a difference keeps vLLM's piece, warned once), keeping vLLM's own as the
    fallback of calls dcpc does not take (more tokens than the workspace, an unsupported
    dtype, a switch at 0, a keyword dcpc leaves to vLLM) and for PCP's all-reduce.
    ``max_num_tokens``: the free functions' workspace (else DCPC_MAX_NUM_TOKENS, else
    vLLM's config once one is seen, else 256: see dcpc.engines.vllm_free.workspace_choice).
    Idempotent; returns the bindings patched. Call it from a vLLM general plugin
    (docs/engines.md, "Switching vLLM"). For a layout it does not know it patches
    nothing, logs why once and returns []: vLLM's own path stays."""
    layout, why = known_layout()
    if layout is None:
        log_once("vllm-layout", f"dcpc.engines.vllm.install(): vLLM's own DCP path stays: "
                 f"{why} (the adapters know vLLM 0.33.0's and 0.34.0's layout and open "
                 "PR #52239's)")
        return []
    if max_num_tokens is not None:
        F.set_workspace(max_num_tokens)
    for name, diffs in layout.kept.items():
        log_once(f"vllm-contract:{layout.module.__name__}.{name}",
                 f"dcpc.engines.vllm.install(): vLLM's own {name} stays (dcpc's does not "
                 f"hold its contract): {'; '.join(diffs)}")
    log.info("dcpc.engines.vllm.install(): %s; dcpc's %s; vLLM's own %s; %s", layout.name,
             ", ".join(layout.ours) or "none", ", ".join([*layout.kept, *KEPT]),
             _settings_said())
    namespace = vars(layout.module)
    for name in (*layout.ours, *layout.kept, *KEPT):
        F.keep_original(name, namespace.get(name))  # never a dcpc function: it would recurse
    patched: list[str] = []
    for name, new in layout.ours.items():
        old = namespace[name]
        if old is not new:
            patched += rebind(name, old, new)
    return patched + hook_calls()


def hook_calls() -> list[str]:
    """Wrap vLLM's ``set_forward_context`` (a forward begins; its ``vllm_config`` is
    noted: dcpc.engines.vllm.note_config) and ``get_attention_context`` (its custom
    attention ops name the layer) in every module that holds them, for the call ids
    (dcpc.engines.call_ids). Idempotent; a module that does not import, or has no such
    function, is logged (info) and left alone (no ids from it)."""
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


__all__ = ["Layout", "contract", "hook_calls", "install", "known_layout"]
