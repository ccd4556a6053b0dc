"""What every pass shares: the one op taxonomy (``ops``), the trace utilities and rewrites
(``trace``), the memory model (``views``: which tensors are views, and their strides; ``storages``:
each tensor's bytes and storage; ``memory``: liveness, estimated peaks and what a forward saves, and
the one import path of all three) and the time model (``cost``: FLOPs, bytes moved and a device's
rates). Nothing here changes a trace's order or its saved set by itself; the passes do."""

# The submodules, imported where they are used (``from thunder_memopt.core import ...``) rather than here,
# so that importing one of them does not import the rest.
__all__ = [
    "cost",
    "memory",
    "ops",
    "storages",
    "trace",
    "views",
]
