"""CUDA-event timing shared by the GPU diagnostics."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def median_cuda_ms(fn: Callable[[], object], *, repeats: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` calls timed by CUDA events, after ``warmup``
    untimed-in-the-median calls."""
    times = []
    for _ in range(repeats + warmup):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])
