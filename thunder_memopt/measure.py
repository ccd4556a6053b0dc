"""Runtime measurements to check the memory model against.

``measure_saved``: ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a
``torch.autograd.Function`` (and so Thunder's ``ThunderFunction``) saves. Tensors are de-duplicated
by storage and the module's parameters excluded, which is the quantity the memory model predicts.

``peak_live_bytes``: the peak of live tensor bytes of a step from torch.profiler's memory timeline,
which also works on CPU, where there is no CUDA allocator to ask.

``cross_entropy_compiled_as_on_gpu``: on CPU, Thunder leaves the cross-entropy to its decomposition;
on a GPU its torchcompile_xentropy executor claims it. Within this context it claims it on CPU too,
so that CPU runs see the GPU's trace around the loss.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["SavedMeasurement", "cross_entropy_compiled_as_on_gpu", "measure_saved", "peak_live_bytes"]


@dataclass(frozen=True)
class SavedMeasurement:
    """Storages saved for backward during one forward."""

    activation_bytes: int  # de-duplicated by storage, parameters excluded
    n_storages: int
    output: object


def measure_saved(fn: Callable, *args, parameters: Iterable[torch.Tensor] = (), device: torch.device | None = None,
                  **kwargs) -> SavedMeasurement:
    """Run ``fn(*args, **kwargs)`` and sum the bytes of the storages saved for backward; with a
    ``device``, only those on it (a GPU: saved tensors offloaded to the host are not counted)."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in excluded and s.nbytes() > 0 and (device is None or s.device.type == device.type):
            storages[ptr] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return SavedMeasurement(sum(storages.values()), len(storages), out)


def peak_live_bytes(step: Callable[[], object]) -> int:
    """The most tensor bytes alive at once while ``step()`` runs, above those alive before it.

    Read from the profiler's record of tensor creations and destructions, so it leaves out the
    allocator's rounding and caching: on a GPU, ``torch.cuda.max_memory_allocated`` is the figure.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    if not torch.cuda.is_available():
        # Else the profiler's first use logs an ERROR that it found no GPU, which is expected here.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's notes on missing CUDA and event cycles
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:
            step()
    live = peak = before = 0
    for _, action, _, nbytes in prof._memory_profile().timeline:
        if action == Action.PREEXISTING:
            before += nbytes
            live += nbytes
        elif action == Action.CREATE:
            live += nbytes
        elif action == Action.DESTROY:
            live -= nbytes
        peak = max(peak, live)
    return peak - before


@contextlib.contextmanager
def cross_entropy_compiled_as_on_gpu() -> Iterator[None]:
    """Let Thunder's torchcompile_xentropy executor claim the cross-entropy whatever the device, as
    it does on a GPU: one torch.compile region whose outputs alias (the logits' gradient and a
    reshape of it). Its checkers are restored on exit."""
    from thunder.executors.torch_compile import torch_compile_xentropy_ex
    from thunder.extend import ImplInfo

    implmap = torch_compile_xentropy_ex._implmap
    saved = dict(implmap)
    try:
        for op in saved:
            implmap[op] = ImplInfo(checker=lambda *args, **kwargs: True)
        yield
    finally:
        implmap.clear()
        implmap.update(saved)
