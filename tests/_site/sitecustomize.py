"""Started by the tests (tests/conftest.py puts this folder on PYTHONPATH), a Python process applies
tests/_faster_tracing.py once it has imported thunder: the benchmarks' and examples' processes, and
torchrun's workers, compile as the tests' own processes do. A process that never imports thunder
runs as it would.

It also starts faster: litgpt imports lightning, which imports all of torchmetrics to read its
version, and torchmetrics imports transformers' auto models (for BERTScore) and matplotlib's pyplot
(for its plots) wherever they are installed: 2.2 s of each process's 7.2 s import of thunder_memopt
and litgpt here. Neither the package, the benchmarks nor the tests use torchmetrics, so in these
processes torchmetrics takes both as not installed; a process that uses transformers or matplotlib
imports them itself, as it does where torchmetrics is not imported at all."""

import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

FASTER_TRACING = Path(__file__).resolve().parents[1] / "_faster_tracing.py"


class _AfterImport:
    """Finds a module as the path finder does, and calls ``then(module)`` once it has been executed."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            self.then(module)

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


def _without_transformers_and_matplotlib(imports) -> None:
    """torchmetrics.utilities.imports, read by the modules that import transformers and matplotlib."""
    imports._TRANSFORMERS_GREATER_EQUAL_4_4 = False
    imports._MATPLOTLIB_AVAILABLE = False


sys.meta_path[:0] = [_AfterImport("thunder", lambda thunder: _faster_tracing().apply()),
                     _AfterImport("torchmetrics.utilities.imports", _without_transformers_and_matplotlib)]
