"""Warming the adapters up for CUDA-graph capture: every capture size, before capture.

Inside a capture nothing may compile, load a kernel or allocate a module buffer, and
a generated method's first call per shape key runs its checked path and records a
call plan (dcpc.runtime.calls); a combine's ``release`` first runs at the start of the
module's next call. So each size the engine captures needs two eager calls first,
which the engines' own warm-up does not make for the free functions (issue 23), so
the adapters make them:

- at the first call of a *family* (the function, group, microbatch, and everything
  but the token count: heads, head dims, dtypes, LSE base, the mask arguments, the
  inputs' layout), two calls at every capture size, with inputs of the first call's
  layout (``like``), before the call itself; ``MLADCPManager`` at construction (it
  knows its shapes then);
- the sizes: ``DCPC_CAPTURE_SIZES`` (comma-separated tokens), else the engine's config:
  vLLM's ``compilation_config.cudagraph_capture_sizes`` of the first config the adapter
  sees (dcpc.engines.vllm.note_config: the manager's construction, each forward's
  ``set_forward_context``, or the config current at the first call; vLLM loads plugins
  with none current, so not at ``install()``); SGLang's ``cuda_graph_bs`` times the
  tokens per batch, read by ``install()`` or at the first call; none known: nothing is
  warmed (said once);
- bounded: sizes up to the workspace (larger ones take the fallback: the smallest of
  them is warmed once, for the fallback's empty call), at most ``MAX_SIZES``;
- ``DCPC_WARM_CAPTURE=0`` turns it off; one INFO line per family says what was warmed.

A first call made inside a capture cannot be warmed (it would compile there): it is
warned about once and not warmed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from dcpc.engines.common import log, log_once, switch
from dcpc.runtime.errors import DcpcArgumentError

SWITCH = "DCPC_WARM_CAPTURE"
SIZES_ENV = "DCPC_CAPTURE_SIZES"
MAX_SIZES = 512  # sizes warmed per family (vLLM's default list has ~50)

_lock = threading.Lock()
_done: dict[Hashable, Any] = {}  # family -> group handle (kept: its id is not reused)
_fast: dict[Hashable, Any] = {}  # a call's cheap key -> group handle (first_use)
MAX_FAST = 65536
_found: dict[str, tuple[list[int], str]] = {}  # engine -> (sizes, source) of its config
_said: dict[str, bool] = {}  # labels told that no sizes are known
_tls = threading.local()


def enabled() -> bool:
    """``DCPC_WARM_CAPTURE``: unset or 1 = warm, 0 = do not."""
    return switch(SWITCH) != "off"


def parse_sizes(text: str, where: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise DcpcArgumentError(f"{where}={text!r}: expected comma-separated token counts, "
                                "e.g. 1,2,4,8") from None
    if any(s <= 0 for s in sizes):
        raise DcpcArgumentError(f"{where}={text!r}: token counts must be positive")
    return sizes


def remember(engine: str, sizes: list[int] | None, source: str) -> None:
    """What the engine's config says (vLLM: the first config seen; SGLang: install()'s
    read), kept: none is current later."""
    with _lock:
        if sizes:
            _found[engine] = (sorted({int(s) for s in sizes}), source)
        else:
            _found.pop(engine, None)


def sizes_for(engine: str, config: Callable[[], tuple[list[int] | None, str]]
              ) -> tuple[list[int] | None, str]:
    """(the capture sizes, where they came from): DCPC_CAPTURE_SIZES, else what
    ``remember`` kept, else ``config()`` (the engine's config current now), else
    (None, why)."""
    env = os.environ.get(SIZES_ENV)
    if env and env.strip():
        return parse_sizes(env, SIZES_ENV), SIZES_ENV
    with _lock:
        found = _found.get(engine)
    if found is not None:
        return found
    return config()


def vllm_sizes(vllm_config: Any) -> tuple[list[int] | None, str]:
    """vLLM's CUDA-graph capture sizes (tokens per captured batch) of ``vllm_config``."""
    sizes = getattr(getattr(vllm_config, "compilation_config", None),
                    "cudagraph_capture_sizes", None)
    if not sizes:
        return None, "vLLM's config has no cudagraph_capture_sizes"
    return sorted({int(s) for s in sizes}), "vLLM's compilation_config.cudagraph_capture_sizes"


def sglang_sizes(server_args: Any) -> tuple[list[int] | None, str]:
    """SGLang's graph batch sizes in tokens: ``cuda_graph_bs`` times the tokens per batch
    (the speculative draft tokens when a speculative algorithm is set, else 1); None
    without a ``cuda_graph_bs`` (SGLang's own list for a ``cuda_graph_max_bs`` is not
    guessed)."""
    bs = getattr(server_args, "cuda_graph_bs", None)
    if not bs:
        return None, "SGLang's server args have no cuda_graph_bs"
    per = tokens_per_batch(server_args)
    return sorted({int(b) * per for b in bs}), (
        f"SGLang's cuda_graph_bs x {per} token(s) per batch")


def at_install(engine: str, now: Callable[[], tuple[list[int] | None, str]]
               ) -> tuple[list[int] | None, str]:
    """install()'s read of the capture sizes: ``now()`` (DCPC_CAPTURE_SIZES or the
    engine's config current now), kept for later first calls when from the config."""
    remember(engine, None, "")
    sizes, source = now()
    if sizes and source != SIZES_ENV:
        remember(engine, sizes, source)
    return sizes, source


def said(sizes: list[int] | None, source: str) -> str:
    """install()'s words for the capture sizes."""
    if not enabled():
        return f"capture warm-up off ({SWITCH}=0)"
    if not sizes:
        return f"no CUDA-graph capture sizes ({source}): nothing warmed"
    return (f"CUDA-graph capture sizes {sizes} ({source}), warmed up at each function's "
            "first call")


def tokens_per_batch(server_args: Any) -> int:
    if getattr(server_args, "speculative_algorithm", None):
        return max(int(getattr(server_args, "speculative_num_draft_tokens", 1) or 1), 1)
    return 1


def plan(sizes: list[int], workspace: int) -> tuple[list[int], list[int]]:
    """(the sizes to warm, the sizes above the workspace): every size up to the workspace
    and the smallest above it (the fallback's empty call is the same for all of them),
    at most MAX_SIZES."""
    inside = [s for s in sizes if s <= workspace]
    above = [s for s in sizes if s > workspace]
    return (inside[:MAX_SIZES] + above[:1])[:MAX_SIZES], above


def mask_kind(seq_lens: torch.Tensor | None, qsl: torch.Tensor | None) -> tuple | None:
    """The mask arguments' part of a family (None: no mask)."""
    if seq_lens is None or qsl is None:
        return None
    return (seq_lens.dtype, qsl.dtype, str(seq_lens.device))


def mask_args(seq_lens: torch.Tensor | None, qsl: torch.Tensor | None, tokens: int
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A decode batch's mask arguments for ``tokens`` tokens: one request per token, each
    with local KV length 1 (no empty shard, no padding row)."""
    if seq_lens is None or qsl is None:
        return None, None
    return (seq_lens.new_ones(tokens),
            torch.arange(tokens + 1, dtype=qsl.dtype, device=qsl.device))


def warming() -> bool:
    """This thread is inside a warm-up (its calls must not warm again)."""
    return getattr(_tls, "on", False)


def first_use(fast: Hashable, family: Callable[[], Hashable], handle: Any, label: str,
              sizes: Callable[[], tuple[list[int] | None, str]], workspace: int,
              call: Callable[[int], Any], wanted: Callable[[], bool] = lambda: True) -> None:
    """At the first call of ``family()``: ``call(tokens)`` twice at every planned size of
    ``sizes()`` (see plan), then one INFO line. Nothing when off, inside a warm-up,
    already done, not ``wanted()`` (the function's switch at 0), or no sizes are known
    (said once). ``fast``: a cheap key of the call (shapes and strides as they are) that
    names one family; a call whose ``fast`` was seen costs one dict lookup."""
    if fast in _fast or warming():  # the hot path: a plain read (the GIL orders it)
        return
    key = family()
    with _lock:
        if len(_fast) >= MAX_FAST:
            _fast.clear()
        _fast[fast] = handle
        if key in _done:
            return
        _done[key] = handle
    if not enabled() or not wanted():
        return
    got, source = sizes()
    if not got:
        with _lock:
            said, _said[label] = label in _said, True
        if not said:  # INFO: an eager-only engine has no capture sizes, rightly
            log.info("%s: no CUDA-graph capture sizes known (%s): not warmed up for "
                     "capture (set %s; vLLM: its config once one is seen; SGLang: "
                     "install() with the server args set)", label, source, SIZES_ENV)
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        log_once(f"capture:inside:{label}", f"{label}: first called inside a CUDA-graph "
                 "capture: too late to warm up (make one eager call first)")
        return
    warm, above = plan(got, workspace)
    start = time.perf_counter()
    _tls.on = True
    try:
        for tokens in warm:
            for _ in range(2):  # the second call runs the first's release and replays
                call(tokens)
    except BaseException:
        # not warmed (e.g. a peer refused this family's first call: the warm-up's first
        # call met its refusal and raised, before any kernel): the next call of the
        # family warms again, on every rank alike
        with _lock:
            _done.pop(key, None)
            _fast.pop(fast, None)
        raise
    finally:
        _tls.on = False
    rest = f"; above the workspace {workspace} (fallback): {above}" if above else ""
    log.info("%s: warmed up for CUDA-graph capture sizes %s (%s; 2 calls each, %.2f s)%s",
             label, [s for s in warm if s <= workspace], source,
             time.perf_counter() - start, rest)


def forget(handles: set[int] | None = None) -> None:
    """Families of these group handles (all: None) warm again at their next first call
    (dcpc.engines.combine.reset: the modules are new)."""
    with _lock:
        for table in (_done, _fast):
            for key in [k for k, h in table.items() if handles is None or id(h) in handles]:
                del table[key]


def _order(t: torch.Tensor) -> list[int]:
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def layout(t: torch.Tensor) -> tuple:
    """What of ``t``'s layout a call plan's key sees, apart from the token count (dim 0):
    the other dims, the dtype, the device, and the strides (token-major: the token dim's
    stride does not depend on the count) or else the order of the dims by stride."""
    order = _order(t)
    strides = tuple(t.stride()) if order[:1] == [0] else tuple(order)
    return (tuple(t.shape[1:]), t.dtype, str(t.device), strides)


def like(t: torch.Tensor, tokens: int) -> torch.Tensor:
    """Zeros of ``t``'s dtype and device with ``tokens`` rows, laid out as ``t``: its
    strides when ``t`` is token-major (a contiguous tensor, a slice of a padded buffer),
    else the same order of dims (a transposed LSE)."""
    shape = (tokens, *t.shape[1:])
    order = _order(t)
    if t.dim() <= 1 or order[0] == 0:
        inner = sum((n - 1) * s for n, s in zip(shape[1:], t.stride()[1:], strict=True)) + 1
        stride = (max(t.stride(0), inner) if t.dim() else 1, *t.stride()[1:])
        out = torch.empty_strided(shape, stride[: len(shape)], dtype=t.dtype,
                                  device=t.device)
        return out.zero_()
    base = torch.zeros([shape[d] for d in order], dtype=t.dtype, device=t.device)
    return base.permute([order.index(d) for d in range(t.dim())])
