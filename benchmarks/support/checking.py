"""Helpers the check sections share: snapshots of step outputs, scores, layout tables.

Peer-written buffers are snapshotted right after the step that writes them, on the same
stream, as an engine's attention would read them: after a later step of the schedule
peers may already be writing the next call's data there (shared/design/domain.md).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch

from benchmarks.support.reference import Ref, bad_count, random_layout


def snapshotter(snaps: dict[str, torch.Tensor]) -> Any:
    """An ``after`` hook that copies every step output into ``snaps`` (allocated once)."""

    def after(step: str, outs: dict[str, torch.Tensor]) -> None:
        for name, t in outs.items():
            if name not in snaps:
                snaps[name] = torch.empty_like(t)
            snaps[name].copy_(t)

    return after


def score(snaps: dict[str, torch.Tensor], refs: dict[str, Ref]) -> dict[str, Any]:
    """Per buffer: wrong elements and max error (host values: this syncs)."""
    res: dict[str, Any] = {}
    for name, got in snaps.items():
        if name in refs:
            try:
                bad, err = bad_count(got, refs[name])
                res[name] = {"bad": int(bad.item()), "max_err": float(err.item())}
            except ValueError as exc:  # wrong shape: report it, score the other buffers
                res[name] = {"bad": -1, "error": str(exc)}
    return res


def layout_table(T: int, B: int, W: int, n: int, seed: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """n random layouts of fixed B as device tables ([n, B], [n, B+1]): one upload."""
    rnd = random.Random(seed)
    rows = [random_layout(rnd, T, B, W) for _ in range(n)]
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    qsl = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    return seq, qsl


def on_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
