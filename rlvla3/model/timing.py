"""Timing and memory helpers: medians of device-synchronised calls, peak memory, rounding.

Role: the one place the FP8 backend choice (``fp8_select``, which times its candidates at run
time) and the GPU check's entries (``measure.gpu``) take them from.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import overload

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], repeats: int, device: torch.device,
          warmup: int = 1) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_gb(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@overload
def round_sig(x: float, digits: int = 4) -> float: ...


@overload
def round_sig(x: None, digits: int = 4) -> None: ...


def round_sig(x: float | None, digits: int = 4) -> float | None:
    """``x`` rounded to ``digits`` significant digits (None, inf and nan as they are)."""
    if x is None or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")
