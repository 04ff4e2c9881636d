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
    """n random layouts of fixed B as device tables ([n, B], [n, B+1]): one upload.

    Rows start 16-byte aligned (each row padded to a multiple of 4 int32): Triton
    specialises a pointer argument on 16-byte alignment, so rows of unpadded tables
    would need a second compiled variant of the merge kernels part-way through a run,
    and on one GPU a compile while peers spin hangs (seen in DBO on one H200)."""
    rnd = random.Random(seed)
    rows = [random_layout(rnd, T, B, W) for _ in range(n)]

    def table(width: int, values: list[list[int]]) -> torch.Tensor:
        padded = -(-width // 4) * 4
        full = torch.tensor([v + [0] * (padded - width) for v in values], dtype=torch.int32,
                            device=device)
        return full[:, :width]

    return table(B, [r[0] for r in rows]), table(B + 1, [r[1] for r in rows])


def on_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
