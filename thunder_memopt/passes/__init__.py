"""The trace passes, one module each, which ``MemoryOptimization`` (thunder_memopt.transform) runs in
order: ``loss_head`` before Thunder's autodiff, then, each through its stages
(thunder_memopt.stages), ``recompute``, ``collectives`` and ``schedule`` on each forward and
backward trace, and ``offload`` on a pair's final forward and backward together. Each reads traces
through thunder_memopt.core and returns new traces with their provenance stamped; none holds state
across traces."""
