"""thunder_memopt: trace passes that make Thunder training take less GPU memory, and the executors
that make it as fast as torch.compile without nvFuser.

Enable with ``thunder.jit(model, executors=thunder_memopt.executors(), transforms=[MemoryOptimization()])``
or, under ``torch.compile``/FSDP2, with ``torch.compile(model, backend=thunderfx_backend())``.
"""

from thunder_memopt.backend import thunderfx_backend
from thunder_memopt import executors  # the package, callable: executors() is the executor list
from thunder_memopt.transform import PASSES, MemoryOptimization

__all__ = ["MemoryOptimization", "PASSES", "executors", "thunderfx_backend"]
__version__ = "0.1.0"
