"""A ``torch.compile`` backend: Thunder's ThunderCompiler with MemoryOptimization enabled.

ThunderCompiler appends its own transform to the list it is given and shares the transform
instances across every dynamo subgraph. This helper gives it a fresh list, so the caller's list is
never mutated.
"""

from __future__ import annotations

from typing import Any

from thunder_memopt.transform import MemoryOptimization

__all__ = ["thunderfx_backend"]


def thunderfx_backend(memory_optimization: MemoryOptimization | None = None, **thunder_options: Any):
    """A ThunderCompiler with ``memory_optimization`` (default ``MemoryOptimization()``) first."""
    from thunder.dynamo import ThunderCompiler

    transform = memory_optimization if memory_optimization is not None else MemoryOptimization()
    transforms = [transform, *thunder_options.pop("transforms", [])]
    return ThunderCompiler(transforms=transforms, **thunder_options)
