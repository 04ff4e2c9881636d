"""One path per call on every rank: a dcpc kernel on all of them, or the fallback on all.

A rank that took the fallback while its peer ran the kernel used to leave the module's
epochs one call apart: the peer's wait then paired with this rank's NEXT call, and an
ordinary later call returned wrong data without an error. What decides the path:

- the process's settings (the function's switch, ``DCPC_KERNEL_MASK``, the workspace's
  token count, the module backend): they can differ between ranks (another
  environment, another ``install(max_num_tokens=)``), so the ranks agree on them: one
  small all-gather at a function's first call on a group, and again whenever this
  rank's settings change; a difference raises ``DcpcArgumentError`` on every rank,
  naming the setting and each rank's value;
- the call's shapes (tokens, requests, dtypes): the same on every rank of a DCP group
  (every rank runs the same batch). A rank whose call does not fit the module still
  makes an empty call through it (``T = 0``, see the runners' ``skip``): the epochs
  stay in step, and a peer that ran the kernel with ``T > 0`` fails with a
  ``DcpcContractError`` on both ranks ("T=5 here, T=0 on peer 1") instead of wrong data.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from dcpc.engines.common import Group
from dcpc.runtime.errors import DcpcArgumentError, DcpcContractError
from dcpc.runtime.local import sync_stream, to_host

_WIDTH = 512  # bytes of one rank's settings (JSON), padded with zeros
_agreed: dict[tuple, tuple[Any, tuple]] = {}  # (group id, rank, label) -> (handle, settings)
_lock = threading.Lock()
COUNTS: Counter[int] = Counter()  # agreements made through a group, per rank (for tests)


def agree(group: Group, label: str, settings: dict[str, Any],
          all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise unless every rank of ``group`` has the same ``settings`` for ``label``
    (collective the first time, and whenever this rank's settings change; else a dict
    lookup). ``all_gather``: [n] -> [W, n] over the group (the fallback's collectives)."""
    if group.world == 1:
        return
    mine = tuple(sorted((k, str(v)) for k, v in settings.items()))
    # the setting NAMES are part of the key: vLLM's and SGLang's dcp_a2a_lse_reduce share
    # a label but not their switch, and must not undo each other's agreement each call
    key = (id(group.handle), group.rank, label, tuple(k for k, _ in mine))
    with _lock:
        known = _agreed.get(key)
    if known is not None and known[1] == mine:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise DcpcArgumentError(
            f"{label}: its first call on this group (or the first after a change of "
            f"{', '.join(settings)}) is inside a CUDA-graph capture, where the ranks cannot "
            "agree on the path: make one eager call first (the engines' warm-up does)")
    COUNTS[group.rank] += 1
    text = json.dumps(dict(mine)).encode()
    if len(text) > _WIDTH:
        raise DcpcArgumentError(f"{label}: settings too long to agree on: {text[:80]!r}...")
    row = torch.zeros(_WIDTH, dtype=torch.uint8)
    row[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    sync_stream(group.device)  # no blocking copy while this stream may wait on a peer
    rows = to_host(all_gather(row.to(group.device)))
    seen = [json.loads(bytes(r.tolist()).rstrip(b"\0").decode()) for r in rows]
    differ = sorted({k for s in seen for k in s if any(t.get(k) != s.get(k) for t in seen)})
    if differ:
        what = "; ".join(f"{k}: " + ", ".join(f"{s.get(k)!r} on rank {p}"
                                              for p, s in enumerate(seen)) for k in differ)
        raise DcpcArgumentError(
            f"{label}: the ranks of the DCP group disagree on what picks the path (dcpc "
            f"kernel or fallback): {what}. Set them alike on every rank (the environment, "
            "install(max_num_tokens=))")
    with _lock:
        _agreed[key] = (group.handle, mine)  # the handle kept: its id is not reused


def forget(handles: set[int] | None = None) -> None:
    """Drop the agreements of the group handles with these ids (all: None), for
    dcpc.engines.combine.reset: the next call of each function agrees again."""
    with _lock:
        for key in [k for k in _agreed if handles is None or k[0] in handles]:
            del _agreed[key]


def explain(err: DcpcContractError) -> DcpcContractError:
    """A contract error that shows ``T=0`` on one side: say that this is a rank that took
    the fallback (its call did not fit the workspace)."""
    if "T=0" not in str(err):
        return err
    return DcpcContractError(
        err.step, f"{err}. T=0 is the empty call of a rank that took the fallback path "
        "(its call did not fit the module's workspace) while the other ran the dcpc kernel: "
        "every rank must pass the same token count", err.peer)
