"""thunder_memopt: trace passes that make Thunder training take less GPU memory.

Enable with ``thunder.jit(model, transforms=[MemoryOptimization()])`` or, under
``torch.compile``/FSDP2, with ``torch.compile(model, backend=thunderfx_backend())``.
"""

from thunder_memopt.backend import thunderfx_backend
from thunder_memopt.transform import PASSES, MemoryOptimization

__all__ = ["MemoryOptimization", "PASSES", "thunderfx_backend"]
__version__ = "0.1.0"
