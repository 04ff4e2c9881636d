"""Construction's rendezvous: every rank meets every peer, bounded in time, and the
ranks compare what they constructed before anything collective is allocated.

A generated module's construction is collective (the heap's allocation, the barrier
after it). Without a bounded first meeting, a rank that never constructs (killed,
stuck, started late) leaves its peers in gloo's own wait (minutes, or a raw
"Connection closed by peer"), and ranks constructed with different sizes learn it
only as a byte count. Here each rank sends every peer one small message of facts
(the schedule's hash, the backend, the sizes, the knobs that shape the signal bank)
and waits for each peer's at most ``timeout_s`` seconds of progress (wall seconds on an
idle machine, more on a loaded one: dcpc.runtime.clock.wall_timeout):

- a peer whose message does not come is named: ``DcpcConstructionError`` lists every
  missing rank and why (not arrived within timeout_s, or gone);
- a peer with other facts is named with the argument and every rank's value:
  ``DcpcArgumentError: KvGather: the ranks constructed it with different arguments:
  size N: 4 (rank 0), 8 (rank 1)``.

Over gloo the messages are point-to-point with a bounded wait; on other backends
(NCCL) ``all_gather_object`` (the communicator's own timeout applies).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from dcpc.runtime.clock import wall_timeout
from dcpc.runtime.errors import DcpcArgumentError, DcpcConstructionError

Fact = tuple[str, int]  # (what it is, as the error names it; its value)


def meet(group: Any, rank: int, world: int, owner: str, facts: Sequence[Fact],
         timeout_s: float) -> None:
    """Meet every peer of ``group`` (collective); raise if one is missing or differs."""
    import torch.distributed as dist

    if world == 1:
        return
    facts = fold(facts)
    mine = [len(facts), *(int(v) for _, v in facts)]
    if "gloo" in str(dist.get_backend(group)):
        theirs = _exchange_gloo(dist, group, rank, world, owner, mine, timeout_s)
    else:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine, group=group)
        theirs = dict(enumerate(gathered))
    theirs[rank] = mine
    _compare(owner, rank, facts, theirs)


MESSAGE = 64  # int64 slots of one rank's message over gloo: the count and 63 facts


def fold(facts: Sequence[Fact]) -> list[Fact]:
    """``facts`` fitted into one message: past the first 62 (the schedule, backend, sizes,
    knobs and the first steps' tuning), the rest as one digest fact that names them, so a
    long unrolled schedule (two tuning facts per step) constructs, and a difference among
    the rest is still found (named by the range of facts it is in)."""
    keep = MESSAGE - 2
    if len(facts) <= MESSAGE - 1:
        return list(facts)
    rest = facts[keep:]
    text = ";".join(f"{what}={int(v)}" for what, v in rest).encode()
    digest = int(hashlib.sha256(text).hexdigest()[:15], 16)
    return [*facts[:keep], (f"one of {rest[0][0]} .. {rest[-1][0]} ({len(rest)} facts)",
                            digest)]


def _exchange_gloo(dist: Any, group: Any, rank: int, world: int, owner: str,
                   mine: list[int], timeout_s: float) -> dict[int, list[int]]:
    peers = [(rank + k) % world for k in range(1, world)]
    size = MESSAGE
    assert len(mine) <= size, len(mine)  # meet() folds the facts to fit
    out = torch.zeros(size, dtype=torch.int64)
    out[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
    inbox = {p: torch.zeros(size, dtype=torch.int64) for p in peers}
    # timeout_s of progress: more wall seconds on a loaded machine, where a healthy peer
    # also comes later (dcpc.runtime.clock); a gloo wait's timeout is fixed when it starts
    deadline = time.monotonic() + wall_timeout(timeout_s)
    missing: dict[int, str] = {}
    sends = {}
    for p in peers:  # a send to a peer that is gone may fail at once
        try:
            sends[p] = dist.isend(out, dist.get_global_rank(group, p), group=group)
        except RuntimeError as exc:
            missing[p] = _why(exc, timeout_s)
    recvs = {}
    for p in peers:  # every receive posted at once: the messages arrive in parallel
        if p not in missing:
            try:
                recvs[p] = dist.irecv(inbox[p], dist.get_global_rank(group, p), group=group)
            except RuntimeError as exc:
                missing[p] = _why(exc, timeout_s)
    for p, work in recvs.items():
        try:  # at least a moment per peer: a message already here completes at once
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.5)))
        except RuntimeError as exc:
            missing[p] = _why(exc, timeout_s)
    for p, work in sends.items():
        if p in missing:
            continue
        try:
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.5)))
        except RuntimeError as exc:
            missing[p] = _why(exc, timeout_s)
    if missing:
        raise DcpcConstructionError(owner, rank, missing)
    out_of = {}
    for p in peers:
        n = int(inbox[p][0])
        out_of[p] = [int(v) for v in inbox[p][: n + 1].tolist()] if 0 <= n < size else [n]
    return out_of


def _why(exc: RuntimeError, timeout_s: float) -> str:
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return f"did not construct within {timeout_s:g} s (timeout_s)"
    return f"is gone (gloo: {(text.strip().splitlines() or ['?'])[0][:160]})"


def _compare(owner: str, rank: int, facts: Sequence[Fact], theirs: dict[int, list[int]]) -> None:
    mine = theirs[rank]
    if any(len(v) != len(mine) or v[1] != mine[1] for v in theirs.values()):
        odd = sorted(p for p, v in theirs.items() if len(v) != len(mine) or v[1] != mine[1])
        raise DcpcArgumentError(
            f"{owner}: rank(s) {odd} constructed another schedule (or another dcpc version) "
            f"than rank {rank}; every rank constructs the same generated class"
        )
    differ = []
    for i, (what, _) in enumerate(facts):
        values: dict[int, list[int]] = {}
        for p in sorted(theirs):
            values.setdefault(theirs[p][i + 1], []).append(p)
        if len(values) > 1:
            parts = [f"{v} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                     for v, r in values.items()]
            differ.append(f"{what}: {', '.join(parts)}")
    if differ:
        raise DcpcArgumentError(
            f"{owner}: the ranks constructed it with different arguments: "
            + "; ".join(differ)
            + "; every rank passes the same sizes=, backend=, guard=, epoch_start=, "
            "programs= and tuning="
        )
