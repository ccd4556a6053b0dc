"""Started by the tests (tests/conftest.py puts this folder on PYTHONPATH), a Python process applies
tests/_faster_tracing.py once it has imported thunder: the benchmarks' and examples' processes, and
torchrun's workers, compile as the tests' own processes do. A process that never imports thunder
runs as it would."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

FASTER_TRACING = Path(__file__).resolve().parents[1] / "_faster_tracing.py"


class _ApplyOnceThunderIsImported:
    """Finds thunder as the path finder does, and runs _faster_tracing.apply() after thunder's import."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "thunder":
            return None
        sys.meta_path.remove(cls)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_thunder = spec.loader.exec_module

        def exec_module(module) -> None:
            exec_thunder(module)
            _faster_tracing().apply()

        spec.loader.exec_module = exec_module
        return spec


def _faster_tracing():
    """tests/_faster_tracing.py, as the module that `import _faster_tracing` finds in tests/dist's workers."""
    if "_faster_tracing" not in sys.modules:
        spec = importlib.util.spec_from_file_location("_faster_tracing", FASTER_TRACING)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_faster_tracing"] = module
        spec.loader.exec_module(module)
    return sys.modules["_faster_tracing"]


sys.meta_path.insert(0, _ApplyOnceThunderIsImported)
