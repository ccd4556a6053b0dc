"""The trace passes, one module each, which ``MemoryOptimization`` (thunder_memopt.transform) runs in
order: ``loss_head`` before Thunder's autodiff, then, each through its stages
(thunder_memopt.stages), ``recompute``, ``collectives`` and ``schedule`` on each forward and
backward trace, and ``offload`` on a pair's final forward and backward together. Each reads traces
through thunder_memopt.core and returns new traces with their provenance stamped; none holds state
across traces."""

# The submodules, imported where they are used (``from thunder_memopt.passes import ...``) rather than here,
# so that importing one of them does not import the rest.
__all__ = [
    "collectives",
    "donate",
    "loss_head",
    "offload",
    "recompute",
    "schedule",
]
