"""Packing variable-length samples into fixed-budget rows (shared by the data lake and learners).

Input: token lengths of samples. Output: rows, each a list of sample indices whose lengths sum
to at most ``max_tokens`` and that hold at most ``max_segments`` samples. Best-fit-decreasing:
samples are taken longest first and each goes into the row whose remaining room is smallest
but still sufficient, which keeps the number of rows within 11/9 OPT + 1 of the optimum.

Invariants: every index appears in exactly one row; a sample longer than ``max_tokens`` is an
error (it could never be trained on), not a silent truncation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def pack_best_fit(lengths: Sequence[int] | np.ndarray, max_tokens: int,
                  max_segments: int = 64) -> list[list[int]]:
    """Group sample indices into rows of at most ``max_tokens`` tokens and ``max_segments`` samples."""
    if max_tokens < 1 or max_segments < 1:
        raise ValueError("max_tokens and max_segments must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    rows: list[list[int]] = []
    # (remaining room, row index) kept sorted; rows that hit max_segments leave the list.
    open_rows: list[tuple[int, int]] = []
    for i in order:
        n = int(lengths[i])
        if n > max_tokens:
            raise ValueError(f"sample {i} has {n} tokens, more than max_tokens={max_tokens}")
        pos = bisect.bisect_left(open_rows, (n, -1))
        if pos < len(open_rows):
            room, r = open_rows.pop(pos)
        else:
            room, r = max_tokens, len(rows)
            rows.append([])
        rows[r].append(i)
        if len(rows[r]) < max_segments:
            bisect.insort(open_rows, (room - n, r))
    return rows


def cu_seqlens(lengths: Sequence[int]) -> np.ndarray:
    """Cumulative sequence boundaries ``[0, l0, l0+l1, ...]`` as int32 (the varlen-kernel format)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    out[1:] = np.cumsum(np.asarray(lengths, dtype=np.int64))
    return out
