"""Call ids for the adapters' calls: which call of the engine this is, from what the engine
knows and every rank of the DCP group shares (docs/engines.md, "Call ids").

A generated module pairs its calls by order on each slot: the k-th call on one rank with
the k-th on its peers. A rank that skips one call (one layer's DCP call skipped by an
empty-KV-shard shortcut, one micro-batch's) pairs every later call with its peers'
previous one, and both sides return mixed data. The module's ``call_id=`` closes that
hole when the id says which call this is on every rank: here it is made of

- the LAYER: the engine's attention layer around the call (vLLM: the ``layer_name`` its
  custom op passes to ``get_attention_context``, e.g. ``model.layers.5.self_attn.attn``
  -> 5; SGLang: ``RadixAttention.layer_id``); the adapters' install() hooks both, or
  an engine calls ``enter_layer``. A rank that skipped layer 1's call makes layer 2's
  call while its peers make layer 1's: the ids differ and that call raises on every rank;
- the FORWARD: this thread's count of the engine's forwards (vLLM: each
  ``set_forward_context`` entered; SGLang: each ``ModelRunner.forward``), or the
  engine's own step number given to ``begin_forward(step)``. A rank that skipped every
  call of a forward raises at its next forward's first call.

A rank's own count of its DCP calls would not do: after a skip it pairs with exactly the
calls it counts alike. Both parts live in context variables (per thread: ranks run as
threads in the ``local`` backend; vLLM's DBO micro-batch threads see the layer, not the
forward number, which is set on the main thread). No forward and no layer: no id (the
module's old pairing by order).
"""

from __future__ import annotations

import contextlib
import functools
import re
import zlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from dcpc.runtime.errors import DcpcArgumentError, DcpcContractError

FORWARD_STRIDE = 101  # an odd stride: a rank k forwards behind differs unless 256 | k

_forward: ContextVar[int | None] = ContextVar("dcpc_forward", default=None)
_layer: ContextVar[tuple[int, str] | None] = ContextVar("dcpc_layer", default=None)


def begin_forward(step: int | None = None) -> int:
    """A forward of the engine begins on this thread: ``step`` (the engine's step number,
    the same on every rank) or this thread's previous forward number + 1. Forgets the
    layer. Returns the forward number."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise DcpcArgumentError(f"begin_forward(): step must be an int, got {step!r}")
    number = step if step is not None else (_forward.get() or 0) + 1
    _forward.set(number)
    _layer.set(None)
    return number


def enter_layer(layer: int | str) -> None:
    """The engine's attention layer ``layer`` (its index, or its name: the one integer in
    the dotted name, else a crc32 of the name) runs next on this thread."""
    if isinstance(layer, bool) or not isinstance(layer, (int, str)):
        raise DcpcArgumentError(f"enter_layer(): layer must be an int (its index) or a str "
                                f"(its name), got {layer!r}")
    _layer.set((layer_number(layer), str(layer)))


def layer_number(layer: int | str) -> int:
    """``model.layers.5.self_attn.attn`` -> 5; a name without exactly one integer part ->
    its crc32 (the same on every rank: Python's hash() of a str is not)."""
    if isinstance(layer, int) and not isinstance(layer, bool):
        return layer
    numbers = [int(p) for p in re.split(r"[.:/]", str(layer)) if p.isdigit()]
    return numbers[0] if len(numbers) == 1 else zlib.crc32(str(layer).encode())


def current_call_id() -> int | None:
    """The id of a call made now on this thread: layer + FORWARD_STRIDE * forward (the
    module keeps it mod 256); a call of a forward before its first layer counts as layer
    -1 (SGLang's query gather of layer 0 runs before layer 0's RadixAttention: it must
    differ from layer 1's, which carries layer 0); None when neither is known."""
    forward, layer = _forward.get(), _layer.get()
    if forward is None and layer is None:
        return None
    if layer is None:
        return FORWARD_STRIDE * forward - 1  # type: ignore[operator]
    return layer[0] + FORWARD_STRIDE * (forward or 0)


def call_site() -> str:
    """The current call for messages: "layer 'model.layers.2.attn' of forward 7"."""
    forward, layer = _forward.get(), _layer.get()
    where = "before the first layer" if layer is None else f"layer {layer[1]!r}"
    return where + ("" if forward is None else f" of forward {forward}")


def name_call(err: DcpcContractError) -> DcpcContractError:
    """A call-id mismatch (``err`` names "call_id"), with this rank's call named."""
    if "call_id" not in str(err):
        return err
    return DcpcContractError(
        err.step, f"{err}. This rank's call: {call_site()} (dcpc.engines call ids: the "
        "peers' call is another layer's or forward's: a rank skipped or repeated a DCP "
        "call, e.g. one layer's, before this one)", err.peer)


# ---- the engines' hooks (installed by the adapters' install()) ----------------------------
def forward_hook(original: Callable[..., Any],
                 before: Callable[..., None] | None = None) -> Callable[..., Any]:
    """vLLM's ``set_forward_context`` (a context manager), beginning a forward first;
    ``before(*args, **kwargs)`` sees the call's arguments first (vLLM's adapter notes
    the forward's ``vllm_config``: dcpc.engines.vllm.note_config)."""
    if getattr(original, "_dcpc_hook", False):
        return original

    @functools.wraps(original)
    @contextlib.contextmanager
    def hooked(*args: Any, **kwargs: Any) -> Iterator[Any]:
        if before is not None:
            before(*args, **kwargs)
        begin_forward()
        with original(*args, **kwargs) as context:
            yield context

    hooked._dcpc_hook = True  # type: ignore[attr-defined]
    return hooked


def layer_hook(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_attention_context(layer_name, ...)``, entering that layer first."""
    if getattr(original, "_dcpc_hook", False):
        return original

    @functools.wraps(original)
    def hooked(layer_name: Any, *args: Any, **kwargs: Any) -> Any:
        # traced by torch.compile (vLLM's direct-call path off CUDA, fullgraph): no
        # context variable in the graph, and no id from here (it would be baked in)
        if not torch.compiler.is_compiling():
            enter_layer(layer_name if type(layer_name) is int else str(layer_name))
        return original(layer_name, *args, **kwargs)

    hooked._dcpc_hook = True  # type: ignore[attr-defined]
    return hooked


def reset_calls() -> None:
    """Forget this thread's forward and layer (no ids from here on, until the next
    begin_forward or enter_layer)."""
    _forward.set(None)
    _layer.set(None)


__all__ = ["begin_forward", "call_site", "current_call_id", "enter_layer", "forward_hook",
           "layer_hook", "layer_number", "name_call", "reset_calls"]
