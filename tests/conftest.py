"""Test order for pytest-xdist: the longest files first.

pytest-xdist runs each file's tests in one worker (--dist loadfile, pyproject.toml), so that a
file's module fixtures and shared steps (_train.shared_train_step), among them the torchrun jobs
of test_collectives.py, run once. (--dist loadgroup would group across files, but with pytest 9.2
it silently does not group: pytest-xdist issue 1386.) Files are handed out in collection order
(--no-loadscope-reorder); a long file handed out last would run alone at the end while the other
worker idles, so the longest go first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Longest first (seconds of one worker on 2 busy cores, the whole file). Other files follow.
LONGEST_FIRST = (
    "test_recompute.py",  # about 300
    "test_collectives.py",  # 150, two torchrun jobs
    "test_loss_head.py",
    "test_benchmark_smoke.py",  # 130, a torchrun benchmark
    "test_memory.py",
    "test_fusion.py",
    "test_long_run.py",  # 75, four torchrun jobs
    "test_causal_inputs.py",  # 70, an FSDP2 job on gloo
    "test_benchmark_hf.py",  # 60
    "test_checkpoint.py",  # 60
    "test_transformers.py",  # 55
    "test_fit.py",  # 50
    "test_offload_faults.py",  # 45
    "test_offload.py",
    "test_schedule.py",
    "test_readme.py",
    "test_simulation.py",
    "test_examples.py",
    "test_bad_input.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).name, len(rank)))  # stable


@pytest.fixture(autouse=True)
def _forget_dynamos_module_tags() -> Iterator[None]:
    """Once dynamo has run in a process (the ThunderCompiler tests), it tags every nn.Module built
    afterwards in a weak dictionary (``GenerationTracker``). litgpt's forward builds an
    ``nn.Identity``, so Thunder's interpreter, tracing a later test's model, iterates that dictionary,
    which then holds every module of the earlier tests; a garbage collection during the iteration
    removes entries from it, and the iteration fails ('dictionary changed size during iteration',
    in one test of a full run before commit dd50fce, 2026-12-02). Each test starts with it empty,
    as ``torch._dynamo.reset()`` leaves it."""
    yield
    from torch._dynamo.mutation_guard import GenerationTracker

    GenerationTracker.clear()
