"""The claims a gallery or conformance file states in its header (``# check: 2..8``)."""

from __future__ import annotations

import re
from pathlib import Path

from dcpc.lang.mesh import parse_shapes

CALLS = 4  # per rank: enough for both slots twice; the shipped schedules run 20-30


def header(path: Path, key: str) -> str | None:
    found = re.search(rf"^# {key}: (.+)$", path.read_text(), re.M)
    return found.group(1).strip() if found else None


def worlds(text: str) -> list[int]:
    """`2..16 32` -> [2, ..., 16, 32]; mesh shapes `2x2 2..3x4` -> [2x2, 2x4, 3x4]."""
    out: list[int] = []
    for part in text.split():
        if "x" in part:
            out += parse_shapes(part, 1024)
            continue
        lo, _, hi = part.partition("..")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out
