"""What ``--profile``, ``--memory-snapshot`` and ``--first-step-profile`` record of a worker's steps.

``--profile``: torch.profiler over the measured steps, summarized for the row: the top kernels by
GPU time, the top ops by self CPU time, the time in ATen's copy kernels (the casts and layout copies
that fusion removes), and how busy the GPU was. ``--memory-snapshot``: the CUDA allocator's history
of the measured steps, for <https://pytorch.org/memory_viz>. ``--first-step-profile``: Python's
cProfile over the first step, where compilation happens, to tell dynamo's, Thunder's, the passes'
and inductor's shares apart (cProfile slows Python code, so the step itself is longer).
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
from collections.abc import Callable, Iterable, Iterator

import torch

from benchmarks.fsdp2.trial import KERNEL_NAME_CHARS

TOP_OPS = 10  # kernels and CPU ops a row keeps
TOP_FUNCTIONS = 80  # Python functions of the first step a row keeps, by cumulative time
PRINTED_FUNCTIONS = 250  # and prints to the log
PRINTED_OPS = 25  # rows of the profiler's table by CPU time printed to the worker's log
PRINTED_KERNELS = 80  # rows of its table by GPU time
COPY_KERNEL = "copy_kernel"  # in the names of ATen's copy kernels: direct_copy_kernel_cuda, bfloat16_copy_kernel_cuda
MEMORY_HISTORY_ENTRIES = 100_000
# What a step's GPU time is spent on, by kernel name: the first class whose words the name holds.
KERNEL_CLASSES = (
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma")),
    ("fused (Triton)", ("triton_",)),
    ("copy", (COPY_KERNEL,)),
    ("optimizer", ("multi_tensor_apply",)),
    # The profiler's names of copies between pinned host memory and the device (offload's).
    ("host copies", ("memcpy dtoh", "memcpy htod")),
)


def profiler_for(profile: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """A torch.profiler over CPU (and CUDA on a GPU) when ``profile``, else a context that yields None."""
    if not profile:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals (kernels on several streams)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def print_table(profiler: torch.profiler.profile, device: torch.device) -> None:
    """The profiler's own tables of ops by self CPU time and, on a GPU, of kernels by GPU time, for
    the worker's log."""
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=PRINTED_OPS), flush=True)
    if device.type == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=PRINTED_KERNELS), flush=True)


def profile_summary(profiler: torch.profiler.profile, wall_s: float) -> dict:
    """Top kernels by GPU time, top ops by self CPU time ([name, ms, calls] over the measured
    steps), the copy kernels' time and calls, the GPU time by kernel class (``KERNEL_CLASSES``, and
    "other"; annotations such as the optimizer's step are not kernels), and the GPU busy fraction
    (None without kernels)."""
    from torch.autograd import DeviceType

    def top(events: list, microseconds: Callable) -> list:
        ranked = sorted(events, key=microseconds, reverse=True)[:TOP_OPS]
        return [[e.key[:KERNEL_NAME_CHARS], microseconds(e) / 1e3, e.count] for e in ranked]

    averages = profiler.key_averages()
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
    kernel_spans = [(e.time_range.start, e.time_range.end) for e in profiler.events()
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return {
        "top_gpu_ms": top(kernels, lambda e: e.device_time_total),
        "copy_kernel_ms": sum(e.device_time_total for e in kernels if COPY_KERNEL in e.key) / 1e3,
        "copy_kernel_calls": sum(e.count for e in kernels if COPY_KERNEL in e.key),
        "gpu_ms_by_class": gpu_ms_by_class((e.key, e.device_time_total) for e in kernels if not e.is_user_annotation),
        "top_cpu_ms": top([e for e in averages if e.device_type == DeviceType.CPU], lambda e: e.self_cpu_time_total),
        "gpu_busy_fraction": union_length(kernel_spans) / (wall_s * 1e6) if kernel_spans else None,
    }


def gpu_ms_by_class(kernels: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Milliseconds of GPU time per kernel class, from (kernel name, microseconds) pairs."""
    totals = dict.fromkeys([*(name for name, _ in KERNEL_CLASSES), "other"], 0.0)
    for key, microseconds in kernels:
        lowered = key.lower()
        kind = next((name for name, words in KERNEL_CLASSES if any(w in lowered for w in words)), "other")
        totals[kind] += microseconds / 1e3
    return totals


@contextlib.contextmanager
def recording_memory_history(path: str | None, device: torch.device) -> Iterator[None]:
    """Record the CUDA allocator's history and dump a snapshot to ``path`` (nothing without a path or GPU)."""
    if path is None or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def first_step_profiler(enabled: bool) -> Iterator[cProfile.Profile | None]:
    """cProfile over the block when ``enabled`` (this thread only: where dynamo, Thunder and inductor
    compile), else None."""
    if not enabled:
        yield None
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield profiler
    finally:
        profiler.disable()


def first_step_summary(profiler: cProfile.Profile) -> list[list]:
    """The functions with the most cumulative time: [``file:line(function)``, cumulative s, own s,
    calls], the file shortened to its last two path parts; also printed to the worker's log."""
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(PRINTED_FUNCTIONS)
    rows = []
    for (path, line, function), (_, calls, own, cumulative, _) in stats.stats.items():
        where = "/".join(path.split("/")[-2:])
        rows.append([f"{where}:{line}({function})", cumulative, own, calls])
    return sorted(rows, key=lambda r: r[1], reverse=True)[:TOP_FUNCTIONS]
