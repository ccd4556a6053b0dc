"""A ``torch.compile`` backend: Thunder's ThunderCompiler with MemoryOptimization enabled and
thunder_memopt's executors (``thunder_memopt.executors()``) in front of Thunder's.

ThunderCompiler appends its own transform to the list it is given and shares the transform
instances across every dynamo subgraph. This helper gives it a fresh list, so the caller's list is
never mutated.

With ``torch._dynamo.config.skip_fsdp_hooks=False`` FSDP2's functional collectives reach the
backend, and Thunder maps ``wait_tensor`` to identity: the results are wrong. The backend hides
those nodes from Thunder (``keep_collectives_out_of_thunder``), so its splitter hands them to
inductor, which implements them.
"""

from __future__ import annotations

from typing import Any

from thunder_memopt.executors import executors
from thunder_memopt.transform import MemoryOptimization

__all__ = ["keep_collectives_out_of_thunder", "thunderfx_backend"]


def thunderfx_backend(
    memory_optimization: MemoryOptimization | None = None,
    *,
    fusion: bool = True,
    cudnn_attention: bool | None = None,
    loss_head: bool | None = None,
    **thunder_options: Any,
):
    """A ThunderCompiler with ``memory_optimization`` (default ``MemoryOptimization()``) first.

    ``fusion``, ``cudnn_attention`` and ``loss_head`` choose thunder_memopt's executors (``executors()``), unless
    ``executors=`` is given among the ThunderCompiler options; ``fusion=False`` keeps every op as
    plain Thunder runs it, bit for bit.
    """
    from thunder.dynamo import ThunderCompiler

    if memory_optimization is not None and not isinstance(memory_optimization, MemoryOptimization):
        raise TypeError(
            "thunderfx_backend: memory_optimization must be a MemoryOptimization instance or None, "
            f"got {memory_optimization!r}"
        )
    chosen = executors(fusion=fusion, cudnn_attention=cudnn_attention, loss_head=loss_head)
    thunder_options.setdefault("executors", chosen)
    transform = memory_optimization if memory_optimization is not None else MemoryOptimization()
    transforms = [transform, *thunder_options.pop("transforms", [])]
    compiler = ThunderCompiler(transforms=transforms, **thunder_options)

    def backend(gm, example_inputs):
        keep_collectives_out_of_thunder(gm)
        return compiler(gm, example_inputs)

    backend.compiler = compiler  # subgraph_infos and traces stay reachable
    return backend


# Namespaces of FSDP2's traced communication: functional collectives and its copy-in/out ops.
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "fsdp"}


def _is_collective_target(target) -> bool:
    namespace = getattr(target, "namespace", None)  # OpOverload and OpOverloadPacket
    if namespace is None:
        namespace = str(getattr(target, "_qualified_op_name", "")).split("::")[0] or None
    if namespace in _COLLECTIVE_NAMESPACES:
        return True
    return getattr(target, "__module__", "") == "torch.distributed._functional_collectives"


def _run_outside_thunder(target):
    """A callable Thunder has no mapping for, so its splitter sends the node to inductor."""

    def collective(*args, **kwargs):
        return target(*args, **kwargs)

    collective.__name__ = f"thunder_memopt_outside_thunder_{getattr(target, '__name__', 'op')}"
    return collective


def keep_collectives_out_of_thunder(gm) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so no collective lands in a Thunder region; the count."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and _is_collective_target(n.target)]
    for n in nodes:
        n.target = _run_outside_thunder(n.target)
    if nodes:
        gm.recompile()
    return len(nodes)
