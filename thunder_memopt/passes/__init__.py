"""The trace passes, one module each, which ``MemoryOptimization`` (thunder_memopt.transform) runs in
order: ``loss_head`` before Thunder's autodiff, then ``recompute``, ``collectives`` and
``schedule`` on each forward and backward trace. Each reads traces through thunder_memopt.core and
returns a new trace with its provenance stamped; none holds state across traces."""
