"""Tile shapes of the generated kernels (a GPU tuning knob, decided at construction).

A kernel walks a [rows, row_len] space in tiles of BLOCK_R x BLOCK_C elements:
columns are contiguous (16-byte vector accesses), rows are independent.
"""

from __future__ import annotations

MAX_COLS = 1024
MIN_DIVISOR = 16


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pick(row_len_max: int, block: int, static: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for rows of ``row_len_max`` elements and ``block`` per tile.

    A static row length uses the largest power of two dividing it (576 -> 64: no
    masked lanes); a run-time one, or one with a small power-of-two divisor, the next
    power of two above it, capped.
    """
    cap = min(MAX_COLS, next_pow2(block))
    cols = 0
    if static and row_len_max > 0:
        cols = min(row_len_max & -row_len_max, cap)
        if cols < min(MIN_DIVISOR, next_pow2(row_len_max)):
            cols = 0
    if cols == 0:
        cols = min(next_pow2(max(row_len_max, 1)), cap)
    rows = max(1, next_pow2(block) // cols)
    return rows, cols


REQUEST_BLOCK_MAX = 1024


def request_block(batch_max: int) -> int:
    """BLOCK_B of the merge's request lookup: the request ends as one vector when there
    are at most REQUEST_BLOCK_MAX requests (one memory round trip), else 0 (binary search)."""
    block = next_pow2(max(batch_max, 1))
    return block if block <= REQUEST_BLOCK_MAX else 0
