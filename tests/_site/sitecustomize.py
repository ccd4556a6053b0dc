"""Started by the tests (tests/conftest.py puts this folder on PYTHONPATH), a Python process applies
tests/_faster_tracing.py once it has imported thunder: the benchmarks' and examples' processes, and
torchrun's workers, compile as the tests' own processes do. A process that never imports thunder
runs as it would (it loads that module, whose imports are the standard library's, and calls nothing).

It also starts faster: litgpt imports lightning, which imports all of torchmetrics to read its
version, and torchmetrics imports transformers' auto models (for BERTScore) and matplotlib's pyplot
(for its plots) wherever they are installed: 2.2 s of each process's 7.2 s import of thunder_memopt
and litgpt here. Neither the package, the benchmarks nor the tests use torchmetrics, so in these
processes torchmetrics takes both as not installed; a process that uses transformers or matplotlib
imports them itself, as it does where torchmetrics is not imported at all."""

import importlib.util
import sys
from pathlib import Path

FASTER_TRACING = Path(__file__).resolve().parents[1] / "_faster_tracing.py"


def _load_faster_tracing():
    """tests/_faster_tracing.py, as the module that `import _faster_tracing` finds in tests/dist's workers."""
    spec = importlib.util.spec_from_file_location("_faster_tracing", FASTER_TRACING)
    module = sys.modules["_faster_tracing"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_transformers_and_matplotlib(imports) -> None:
    """torchmetrics.utilities.imports, read by the modules that import transformers and matplotlib."""
    imports._TRANSFORMERS_GREATER_EQUAL_4_4 = False
    imports._MATPLOTLIB_AVAILABLE = False


_faster_tracing = _load_faster_tracing()
AfterImport = _faster_tracing.AfterImport
sys.meta_path[:0] = [AfterImport("thunder", lambda thunder: _faster_tracing.apply()),
                     AfterImport("torchmetrics.utilities.imports", _without_transformers_and_matplotlib)]
