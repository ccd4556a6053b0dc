"""Runtime measurement of what autograd saves for backward, to check the memory model against.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor a ``torch.autograd.Function`` (and so
Thunder's ``ThunderFunction``) saves. Tensors are de-duplicated by storage and the module's
parameters excluded, which is the quantity the memory model predicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["SavedMeasurement", "measure_saved"]


@dataclass(frozen=True)
class SavedMeasurement:
    """Storages saved for backward during one forward."""

    activation_bytes: int  # de-duplicated by storage, parameters excluded
    n_storages: int
    output: object


def measure_saved(fn: Callable, *args, parameters: Iterable[torch.Tensor] = (), **kwargs) -> SavedMeasurement:
    """Run ``fn(*args, **kwargs)`` and sum the bytes of the storages saved for backward."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in excluded and s.nbytes() > 0:
            storages[ptr] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return SavedMeasurement(sum(storages.values()), len(storages), out)
