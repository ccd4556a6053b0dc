"""Test order for pytest-xdist: the longest work units first.

pytest-xdist runs each file's tests in one worker (--dist loadfile, pyproject.toml), so that a
file's module fixtures and shared steps (_train.shared_train_step), among them the torchrun job
of test_collectives.py, run once. Files that read another file's shared steps go with it
(SHARES_STEPS_WITH: the scheduler below). (--dist loadgroup would group across files, but with
pytest 9.2 it silently does not group: pytest-xdist issue 1386.) Work units are handed out in
collection order (--no-loadscope-reorder), each to the worker that runs out of work first; a long
unit handed out last would run alone at the end while the other worker idles, so the collection
is sorted by SECONDS, longest first, a file not listed there taking DEFAULT_SECONDS.

Also here: the torchrun job that test_collectives.py and test_checkpoint.py read (torchrun_job), and
what keeps the tests' processes fast and their compilations independent (_faster_tracing.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import _faster_tracing

# Seconds of each work unit (with the files grouped with it) in a worker of `make test`: the
# setup, call and teardown times of its tests (--durations=0), summed, in a run with an empty
# inductor cache, as on a clean CI machine (2-core machine, 2026-12-07: 680 s in all).
# A file not listed (each took under 15 s) takes DEFAULT_SECONDS.
SECONDS = {
    "test_recompute.py": 185.5,
    "test_loss_head.py": 125.2,
    "test_collectives.py": 96.3,
    "test_benchmark_smoke.py": 81.5,
    "test_fusion.py": 74.3,
    "test_fit.py": 61.8,
    "test_long_run.py": 57.0,
    "test_donate.py": 52.6,
    "test_hf_conformance.py": 48.9,
    "test_recompute_backends.py": 47.9,
    "test_transformers.py": 47.6,
    "test_benchmark_hf.py": 45.9,
    "test_examples.py": 34.4,
    "test_schedule.py": 24.0,
    "test_fit_first_step.py": 22.9,
    "test_unmade_gradients.py": 18.5,
    "test_node_checks.py": 18.2,
    "test_loss_head_scaled.py": 18.0,
    "test_readme.py": 17.9,
    "test_causal_inputs.py": 17.9,
}
DEFAULT_SECONDS = 10.0


# A file whose tests read steps that another file's tests compute (stablecode's and Llama's plain
# and default steps at two layers), or the torchrun job another file's tests read (torchrun_job):
# its tests run in that file's worker, after that file's.
SHARES_STEPS_WITH = {"test_memory.py": "test_recompute.py", "test_offload.py": "test_recompute.py",
                     "test_checkpoint.py": "test_collectives.py"}


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


def _started_processes_trace_faster() -> None:
    """The Python processes that tests start (torchrun jobs, the benchmarks, the examples) apply
    _faster_tracing.py too, through tests/_site/sitecustomize.py: test_benchmark_smoke's run took
    36 s instead of 49 alone on this machine."""
    site = str(Path(__file__).with_name("_site"))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, *paths) if p)


_started_processes_trace_faster()


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


def pytest_configure(config: pytest.Config) -> None:
    """The processes that run tests apply _faster_tracing.py, before their collection imports the
    test modules (and torch's inductor config). pytest-xdist's controller runs none (it hands them to
    its workers, which apply it themselves): without Thunder's import there, 4.4 s here, the workers
    start that much sooner."""
    if hasattr(config, "workerinput") or config.getvalue("dist") == "no":
        _faster_tracing.apply()


def pytest_collection_modifyitems(items) -> None:
    """Longest unit first; within a unit, its own file's tests before those of the files it takes."""

    def order(item: pytest.Item) -> tuple[float, str, bool]:
        unit = work_unit(item.nodeid)
        return -SECONDS.get(Path(unit).name, DEFAULT_SECONDS), unit, item.nodeid.split("::", 1)[0] != unit

    items.sort(key=order)  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _forget_dynamos_module_tags() -> Iterator[None]:
    """Once dynamo has run in a process (the ThunderCompiler tests), it tags every nn.Module built
    afterwards in a weak dictionary (``GenerationTracker``). litgpt's forward builds an
    ``nn.Identity``, so Thunder's interpreter, tracing a later test's model, iterates that dictionary;
    a garbage collection during the iteration that frees an earlier test's modules removes their
    entries, and the iteration fails ('dictionary changed size during iteration', in one test of a
    full run before commit dd50fce, 2026-12-02, and again 2026-12-06). Each test starts and ends with
    it empty, as ``torch._dynamo.reset()`` leaves it, so no earlier test's module is in it. (A
    ``gc.collect()`` before each test instead cost 3-6 s a test in a worker that had run a hundred
    tests, most of the suite's time.)"""
    from torch._dynamo.mutation_guard import GenerationTracker

    GenerationTracker.clear()
    yield
    GenerationTracker.clear()


# Modules of the package whose code runs in a model's forward. A test's patch of any other module of
# the package (a pass, a stage, an executor, the fit planner) leaves what interpreting a model gives
# as it was; no executor of the package adds a lookaside to Thunder's interpreter.
_FORWARD_MODULES = ("thunder_memopt.models", "thunder_memopt.hf_models", "thunder_memopt.launch")


def _beside_forwards(target: object) -> bool:
    """Whether a monkeypatch of an attribute of ``target`` (an object, or a dotted name) leaves every
    model's forward as it was: ``target`` belongs to thunder_memopt, outside _FORWARD_MODULES."""
    if isinstance(target, str):
        module = target
    elif isinstance(target, types.ModuleType):
        module = target.__name__
    else:
        module = getattr(target, "__module__", None) or ""
    return module.startswith("thunder_memopt.") and not module.startswith(_FORWARD_MODULES)


def _other_patches_stop_shared_interpretations() -> None:
    """A test's monkeypatch may patch a function that a model's forward calls, which changes what
    interpreting the model gives without changing the model. From a patch of anything but
    thunder_memopt's own passes, stages and executors (``_beside_forwards``) to the end of the test,
    its compilations neither take nor keep shared interpretations
    (_faster_tracing._interpretations_shared_across_modules). The fixture below turns sharing on
    again at each test's start: no fixture wider than a test monkeypatches."""

    def stopping(method: str):
        original = getattr(pytest.MonkeyPatch, method)

        @functools.wraps(original)
        def patch(self, *args, **kwargs):
            if not (method in ("setattr", "delattr") and args and _beside_forwards(args[0])):
                _faster_tracing.share_interpretations = False
            return original(self, *args, **kwargs)

        return patch

    for method in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv", "syspath_prepend", "chdir"):
        setattr(pytest.MonkeyPatch, method, stopping(method))


_other_patches_stop_shared_interpretations()


@pytest.fixture(scope="session")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of one torchrun job of tests/dist/all_workers.py on two gloo ranks, for the
    files that read it (test_collectives.py, test_checkpoint.py: one work unit): every worker's
    report in reports.json, the checkpoint worker's files under checkpoint/. One job, since each
    rank's start and imports cost seconds."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    out = tmp_path_factory.mktemp("torchrun_job")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(get_free_port()), str(Path(__file__).with_name("dist") / "all_workers.py"),
               str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


@pytest.fixture(autouse=True)
def _interpretations_shared_until_patched() -> Iterator[None]:
    _faster_tracing.share_interpretations = True
    yield
    _faster_tracing.share_interpretations = True
