"""Test order for pytest-xdist: the longest files first.

pytest-xdist runs each file's tests in one worker (--dist loadfile, pyproject.toml), so that a
file's module fixtures and shared steps (_train.shared_train_step), among them the torchrun job
of test_collectives.py, run once. Files that read another file's shared steps go with it
(SHARES_STEPS_WITH: the scheduler below). (--dist loadgroup would group across files, but with
pytest 9.2 it silently does not group: pytest-xdist issue 1386.) Files are handed out in
collection order (--no-loadscope-reorder); a long file handed out last would run alone at the end
while the other worker idles, so the longest go first.
"""

from __future__ import annotations

import os
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


# A file whose tests read steps that another file's tests compute (stablecode's and Llama's plain
# and default steps at two layers): its tests run in that file's worker, after that file's.
SHARES_STEPS_WITH = {"test_memory.py": "test_recompute.py", "test_offload.py": "test_recompute.py"}


def work_unit(nodeid: str) -> str:
    """The file a test runs with: its own, or the one in SHARES_STEPS_WITH."""
    path = Path(nodeid.split("::", 1)[0])
    return str(path.with_name(SHARES_STEPS_WITH.get(path.name, path.name)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> object | None:
    """--dist loadfile with the files of SHARES_STEPS_WITH in one work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedStepsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SharedStepsScheduling(config, log)


def _one_share_of_the_cores_per_worker() -> None:
    """Under pytest-xdist (make test: two workers on two cores) each worker's ops run on its share of
    the cores. With each worker's OpenMP pool as wide as the machine, one worker's threads take the
    cores that the other's Python (most of the suite: Thunder tracing) runs on. The processes a test
    starts (torchrun jobs, the benchmarks) inherit the share. An OMP_NUM_THREADS already set stays."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


_one_share_of_the_cores_per_worker()


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
