"""thunder_memopt's executors, and the list that puts them in front of Thunder's defaults.

    thunder.jit(model, executors=thunder_memopt.executors(), transforms=[MemoryOptimization()])

- ``fusion_ex`` (executors/fusion.py): inductor regions for everything but matmuls, attention,
  embeddings, random ops, collectives and in-place ops, on CUDA.
- ``linear_cross_entropy_ex`` (executors/chunked_cross_entropy.py): the fused loss head, which
  MemoryOptimization's ``loss_head`` pass puts in place of ``linear -> cross_entropy``.
- ``cudnn_attention_ex`` (executors/cudnn_attention.py): SDPA through torch's cuDNN kernels, where
  cuDNN serves the inputs; Thunder's sdpa executor takes the rest. With it, the sliding windows that
  the ``causal_mask`` pass proves run on flash's window kernels (executors/window_attention.py).

Where nvFuser is among the default executors, ``executors()`` leaves the fusion executor out:
nvFuser fuses the same ops, and Thunder's rematerialization and our recompute pass both know its
regions. Executors a user already lists (``torch_compile_ex``, ``torch_compile_cat_ex``) keep their
place in front when the user puts them there; the fusion executor then gets what they leave.

The package itself is callable: ``thunder_memopt.executors()`` is ``executors()``, and
``thunder_memopt.executors.linear_cross_entropy`` (and the rest of ``__all__``) its attributes, so
that the function does not hide the package it names.
"""

from __future__ import annotations

import sys
import types

import thunder
from thunder.extend import Executor

from thunder_memopt.executors import _head_accounting  # noqa: F401  registers the head ops' workspace
from thunder_memopt.executors.chunked_cross_entropy import linear_cross_entropy, linear_cross_entropy_ex
from thunder_memopt.executors.cudnn_attention import cudnn_attention_ex, cudnn_supports
from thunder_memopt.executors import window_attention  # noqa: F401  registers its ops on cudnn_attention_ex
from thunder_memopt.executors import unmade_gradients  # noqa: F401  the loss head's mark; Thunder's connection
from thunder_memopt.executors.fusion import (
    CompileStats,
    InductorFusionExecutor,
    compile_stats,
    reset_compile_stats,
    start_compile_workers,
)

__all__ = [
    "executors",
    "fusion_ex",
    "cudnn_attention_ex",
    "linear_cross_entropy",
    "linear_cross_entropy_ex",
    "cudnn_supports",
    "InductorFusionExecutor",
    "CompileStats",
    "compile_stats",
    "reset_compile_stats",
]

fusion_ex = InductorFusionExecutor("memopt_fusion", devices=("cuda",))
thunder.extend.register_executor(fusion_ex)

_NVFUSER = "nvfuser"


def executors(*, fusion: bool = True, cudnn_attention: bool | None = None,
              loss_head: bool | None = None) -> list[Executor]:
    """Thunder's default executors with thunder_memopt's in front.

    Args:
        fusion: the inductor fusion executor. False restores Thunder's own execution of every op, and
            with it bit-identity with plain Thunder.
        cudnn_attention: cuDNN attention where it serves the inputs (else Thunder's sdpa executor,
            flash). Another kernel than plain Thunder's, so None (the default) follows ``fusion``.
        loss_head: the fused linear + cross-entropy head (with MemoryOptimization). It sums in a
            different order than the unfused loss, so None (the default) follows ``fusion``.
    """
    loss_head = fusion if loss_head is None else loss_head
    cudnn_attention = fusion if cudnn_attention is None else cudnn_attention
    for name, value in (("fusion", fusion), ("cudnn_attention", cudnn_attention), ("loss_head", loss_head)):
        if not isinstance(value, bool):
            raise TypeError(f"thunder_memopt.executors: {name} must be True or False, got {value!r}")
    defaults = list(thunder.get_default_executors())
    ours: list[Executor] = []
    if loss_head:
        ours.append(linear_cross_entropy_ex)
    if cudnn_attention:
        ours.append(cudnn_attention_ex)
    if fusion and not any(ex.name == _NVFUSER for ex in defaults):
        ours.append(fusion_ex)
        # As early as it is known that regions will be compiled: the workers start while dynamo
        # and Thunder trace the model.
        start_compile_workers()
    return [*ours, *(ex for ex in defaults if ex not in ours)]


class _CallablePackage(types.ModuleType):
    """This package's module type: calling the package calls ``executors``."""

    def __call__(self, **options: bool | None) -> list[Executor]:
        """``executors(**options)``: thunder_memopt's executors in front of Thunder's defaults."""
        return executors(**options)


sys.modules[__name__].__class__ = _CallablePackage
