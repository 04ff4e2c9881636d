"""The runners this process built (one generated module instance each), in one table that
the adapters read through the functions here, never through its dicts:

- ``runner`` finds the runner of (group, device, spec, heads, backend, rank, instance),
  or builds it (collectively: every rank reaches the same call);
- ``used`` / ``last``: the runner a label's call went through on this rank (the module
  of a refused call's empty call, dcpc.engines.agree.refuse);
- ``fail``: this rank's runners of a group failed (every peer's wait on them stops) and
  no runner built on the group here until ``close`` (a refusal no module could carry);
- ``built``: the runners, for a reader (tests, benchmarks); ``close``: reset's part.

The runner classes (CombineRunner, GatherRunner) are dcpc.engines.combine's.
"""

from __future__ import annotations

import threading
from typing import Any

from dcpc.engines.common import CombineSpec, GatherSpec, Group
from dcpc.runtime.errors import DcpcFailedError

_lock = threading.Lock()
# (group handle id, device, spec, heads, backend, rank, instance) -> runner
_runners: dict[tuple, Any] = {}
# (group handle id, rank, label, instance) -> (group handle, its last runner, slot): the
# module of refuse's empty call
_last: dict[tuple, tuple[Any, Any, int]] = {}
# (group handle id, rank) -> (handle, label, error): a rank that refused a call with no
# module to carry the refusal to its peers (a microbatch's or a new shape's first call):
# a module built afterwards would pair its first call with a peer's refused one
_poisoned: dict[tuple, tuple[Any, str | None, Exception]] = {}


def runner(kind: type, spec: CombineSpec | GatherSpec, group: Group, heads: int | None,
           backend: str, instance: int = 0) -> Any:
    """The cached runner for (group, device, spec, heads, backend, instance); built
    (collectively: every rank reaches the same call) the first time. ``instance``: one
    module per microbatch for callers that have no slot to pass. The key holds the group
    handle's id, and the runner a reference to it, so the id is not reused while cached."""
    key = (id(group.handle), str(group.device), spec, heads, backend, group.rank, instance)
    with _lock:
        found = _runners.get(key)
    if found is None:
        check_not_poisoned(group)
        found = kind(spec, group, heads, backend)
        with _lock:
            _runners.setdefault(key, found)
    return found


def built() -> list[tuple[tuple, Any]]:
    """(key, runner) of every runner built and not closed, the key as ``runner`` makes
    it: (group handle id, device, spec, heads, backend, rank, instance)."""
    with _lock:
        return list(_runners.items())


def used(group: Group, label: str, run: Any, slot: int, instance: int = 0) -> None:
    """Remember ``run`` as ``label``'s module on this rank of ``group`` (for refuse)."""
    _last[(id(group.handle), group.rank, label, instance)] = (group.handle, run, slot)


def last(group: Group, label: str | None, instance: int = 0) -> tuple[Any, int] | None:
    """(the runner, its slot) that ``label``'s last call on this rank of ``group`` went
    through (``used``), or None."""
    found = _last.get((id(group.handle), group.rank, label, instance))
    if found is None or found[0] is not group.handle:
        return None
    return found[1], found[2]


def fail(group: Group, label: str | None, err: Exception) -> None:
    """Fail this rank's runners of ``group`` with ``err`` (each flags, or notifies, every
    peer, as a failed call: their waits stop loudly), and build none on the group here
    until ``close`` (see check_not_poisoned)."""
    with _lock:
        mine = [run for run in _runners.values()
                if run.group.handle is group.handle and run.group.rank == group.rank]
    for run in mine:
        run.module._fail(err)  # flags (or notifies) every peer, as a failed call
    with _lock:  # and no module is built on the group here until reset()
        _poisoned[(id(group.handle), group.rank)] = (group.handle, label, err)


def check_not_poisoned(group: Group) -> None:
    """Raise if this rank refused an earlier call that no module carried (see
    dcpc.engines.agree.refuse): every later module of the group would pair with the
    peers' call of that one."""
    with _lock:
        found = _poisoned.get((id(group.handle), group.rank))
    if found is not None and found[0] is group.handle:
        raise DcpcFailedError(
            f"{found[1]}: this rank refused the arguments of an earlier call ({found[2]}) "
            "that no dcpc module of the group could carry to its peers; its modules of "
            "the group are failed: call dcpc.engines.reset(group) on every rank")


def close(handles: set[int] | None = None) -> int:
    """Close the runners' modules of the group handles with these ids (all: None) and
    forget them, with what ``used`` and ``fail`` recorded of those groups (for
    dcpc.engines.combine.reset). Returns the number of modules closed."""
    with _lock:
        found = [k for k, run in _runners.items()
                 if handles is None or id(run.group.handle) in handles]
        closing = [_runners.pop(k) for k in found]
    for run in closing:
        run.module.close()
    with _lock:
        for key in [k for k in _last if handles is None or k[0] in handles]:
            del _last[key]
        for key in [k for k in _poisoned if handles is None or k[0] in handles]:
            del _poisoned[key]
    return len(closing)
