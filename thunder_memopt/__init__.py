"""thunder_memopt: trace passes that make Thunder training take less GPU memory, and the executors
that make it as fast as torch.compile without nvFuser.

Enable with ``thunder.jit(model, executors=thunder_memopt.executors(), transforms=[MemoryOptimization()])``
or, under ``torch.compile``/FSDP2, with ``torch.compile(model, backend=thunderfx_backend())`` or, once
installed, ``backend="thunder_memopt"`` (thunder_memopt.named_backend, which this import also adds to
accelerate's backend names, for transformers' Trainer; where transformers is imported, its default loss
is then traced without the warning that broke the graph, ``backend.loss_type_warning_skipped_when_compiling``).

``__version__`` is the installed distribution's, whose one source is pyproject.toml.
"""

import importlib.metadata
import warnings

with warnings.catch_warnings():
    # Thunder 0.2.6 warns at import where transformer_engine is missing; thunder_memopt does not use it.
    warnings.filterwarnings("ignore", message="transformer_engine module not found", category=UserWarning)
    import thunder  # noqa: F401

from thunder_memopt import executors  # the package, callable: executors() is the executor list
from thunder_memopt.backend import loss_type_warning_skipped_when_compiling, thunderfx_backend
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.named_backend import add_name_to_accelerate
from thunder_memopt.transform import PASSES, MemoryOptimization

__all__ = [
    "DeviceRates",
    "MemoryOptimization",
    "PASSES",
    "executors",
    "thunderfx_backend",
]

add_name_to_accelerate()
loss_type_warning_skipped_when_compiling()  # backend="thunder_memopt" imports this package at torch.compile

try:
    __version__ = importlib.metadata.version("thunder-memopt")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"
