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

A rank whose arguments fail an adapter's checks still takes part in the call
(``refuse`` below): at a first call its settings carry the error (``REFUSED``)
and every rank raises here, naming that rank and its error; at a later call it makes
the empty call, and a peer that ran the kernel raises the contract error below.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from dcpc.engines import runners
from dcpc.engines.common import Group, resolve_group
from dcpc.engines.fallback import Comm
from dcpc.runtime.errors import DcpcArgumentError, DcpcContractError, DcpcError
from dcpc.runtime.local import sync_stream, to_host

_WIDTH = 512  # bytes of one rank's settings (JSON), padded with zeros
REFUSED = "refused"  # the settings key of a rank that refused its call's arguments
_agreed: dict[tuple, tuple[Any, tuple]] = {}  # (group id, rank, label) -> (handle, settings)
_lock = threading.Lock()
COUNTS: Counter[int] = Counter()  # agreements made through a group, per rank (for tests)


def _key(group: Group, label: str, mine: tuple) -> tuple:
    """The setting NAMES are part of the key: vLLM's and SGLang's dcp_a2a_lse_reduce
    share a label but not their switch, and must not undo each other's agreement at
    every call (an all-gather and a stream sync per call: refused inside a CUDA-graph
    capture, found on one H200)."""
    return (id(group.handle), group.rank, label, tuple(k for k, _ in mine))


def agree(group: Group, label: str, settings: dict[str, Any],
          all_gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise unless every rank of ``group`` has the same ``settings`` for ``label``
    (collective the first time, and whenever this rank's settings change; else a dict
    lookup). ``all_gather``: [n] -> [W, n] over the group (the fallback's collectives)."""
    if group.world == 1:
        return
    mine = tuple(sorted((k, str(v)) for k, v in settings.items()))
    key = _key(group, label, mine)
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
    refused = [(p, s[REFUSED]) for p, s in enumerate(seen) if REFUSED in s]
    if refused:  # no agreement kept: the next call agrees again
        if REFUSED in settings:
            return  # this rank's caller raises its own error
        p, why = refused[0]
        raise DcpcArgumentError(f"{label}: rank {p} refused its arguments of this call "
                                f"({why}); every rank of the DCP group raises in this call")
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


def agreed(group: Group, label: str, settings: dict[str, Any]) -> bool:
    """The ranks agreed on these ``settings`` for ``label`` (the next ``agree`` is a
    lookup on every rank: no exchange)."""
    mine = tuple(sorted((k, str(v)) for k, v in settings.items()))
    with _lock:
        known = _agreed.get(_key(group, label, mine))
    return known is not None and known[1] == mine


def forget(handles: set[int] | None = None) -> None:
    """Drop the agreements of the group handles with these ids (all: None), for
    dcpc.engines.combine.reset: the next call of each function agrees again (refuse's
    record of their modules goes with the modules: dcpc.engines.runners.close)."""
    with _lock:
        for key in [k for k in _agreed if handles is None or k[0] in handles]:
            del _agreed[key]


# ---- a rank that refuses its call's arguments -------------------------------------------
def refuse(group: Group, label: str | None, settings: dict[str, Any], err: Exception,
           slot: int | None = None, fail: bool = False, instance: int = 0) -> NoReturn:
    """This rank's arguments failed the adapter's checks (``err``): make every peer raise
    in this same call too, then raise ``err``. Where the peers run ``agree(label)`` in
    this call (a first call, or settings changed), this rank's settings carry the error
    and every peer raises naming it. Else this rank makes an empty call (T = 0) through
    ``label``'s last module: a peer that ran the kernel raises a ``DcpcContractError``
    (T=0 on this rank), peers that refused too make the same empty call (no error
    there: their modules stay usable). ``fail`` (the KV gathers: no empty call there):
    this rank fails its modules of the group instead; every peer's wait on it stops
    with ``DcpcPeerFailedError``. Not reached: a peer that waits on no dcpc module in
    this call (dcpc switched off). No cost to calls that pass."""
    if group.world > 1:
        last = runners.last(group, label, instance)
        if label is not None and not agreed(group, label, settings):
            why = str(err).encode("ascii", "replace").decode()[:200]
            agree(group, label, {**settings, REFUSED: f"{type(err).__name__}: {why}"},
                  Comm(group).all_gather)
        elif last is not None:
            try:  # the empty call: a peer that ran the kernel raises a contract error
                last[0].mark(last[1] if slot is None else slot)
            except DcpcError:
                pass  # this rank raises its own error
        elif fail or last is None:
            # no empty call possible (a KV gather; or no module of this label and
            # instance yet, e.g. a second microbatch's first call): fail this rank's
            # modules of the group, every peer's wait on them stops loudly, and build
            # none on the group here until reset()
            runners.fail(group, label, err)
    raise err


@contextlib.contextmanager
def refusing(cp_group: Any, t: Any, label: str | None, settings: Callable[[], dict[str, Any]],
             slot: int | None = None, fail: bool = False, instance: int = 0) -> Iterator[None]:
    """An adapter's argument checks: an argument error raised inside is ``refuse``d on
    the DCP group ``cp_group`` (what the engine passes, or a Group) of tensor ``t``'s
    device (``settings()``: what the call's ``agree(label)`` would be given)."""
    try:
        yield
    except (DcpcArgumentError, ValueError) as err:
        try:
            group = cp_group if isinstance(cp_group, Group) else resolve_group(
                cp_group, call_device(t))
        except DcpcArgumentError:
            raise err from None
        refuse(group, label, settings(), err, slot, fail, instance)


def call_device(t: Any) -> torch.device:
    """The device of a call's tensor ``t``; a meta tensor's call runs on this process's
    device (the group's collectives cannot run on meta)."""
    device = getattr(t, "device", None)
    if isinstance(device, torch.device) and device.type != "meta":
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def explain(err: DcpcContractError) -> DcpcContractError:
    """A contract error that shows ``T=0`` on one side: say that this is a rank that took
    the fallback (its call did not fit the workspace)."""
    if "T=0" not in str(err):
        return err
    return DcpcContractError(
        err.step, f"{err}. T=0 is the empty call of a rank that took the fallback path "
        "(its call did not fit the module's workspace) while the other ran the dcpc kernel: "
        "every rank must pass the same token count; or of a rank that refused its "
        "arguments (a DcpcArgumentError there names them)", err.peer)
