"""The driver: trials one after another, each in a fresh torchrun of the worker, a row each to --out.

A backend's compiled code, allocator cache and peak statistics must not leak into the next
backend's numbers, so every trial runs in new processes: ``python -m torch.distributed.run
--standalone`` of ``benchmarks.fsdp2.worker`` (one rank: the worker alone, with torchrun's
variables; a free port every time), with cold compile caches
(search probes excepted) and NVLink multicast off. The driver waits for it, reads what its ranks
wrote, and appends one JSON line: out-of-memory, errors and hangs end that row (``OOM``, ``error``,
``timeout``), never the run. ``--resume`` takes ok/OOM rows of identical trials from ``--out``
instead of running them again, and ``--time-limit`` starts no trial that may not end in time, so
that one command repeated runs any set of trials in chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch

from benchmarks.fsdp2 import backends, plots, step_model, tables, worker
from benchmarks.fsdp2.trial import (FINAL_STATUSES, HOST_MEMORY_FIELDS, MEMORY_FIELDS, RUN_ROW, Trial, field_value,
                                    load_rows)

STOP_GRACE_S = 30  # after SIGTERM, before SIGKILL
POLL_S = 1.0  # how often run_process calls its poll while a trial runs
LOG_TAIL_LINES = 5  # of a worker's log, in the error of a row whose ranks reported nothing
# Variables that torchrun sets for the driver's own ranks; the nested torchrun sets its own.
TORCHRUN_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT")
# NVLink multicast stays off on the GPU host (NCCL's NVLS and symmetric memory's multicast), unless
# the environment says otherwise.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Querying the GPU creates a CUDA context; done in a child so the long-lived driver holds no GPU memory.
# torch.cuda.device_count() counts through NVML, without CUDA (one H100, 2026-12-07: no process on the
# GPU, 0 MiB used): where it finds none, the driver starts no probe (a process that imports torch,
# 2.6 s of CPU) and takes CPU_ENVIRONMENT.
ENVIRONMENT_PROBE = (
    "import json, torch; cuda = torch.cuda.is_available(); "
    "print(json.dumps({'cuda': cuda, 'gpu': torch.cuda.get_device_name(0) if cuda else 'cpu', "
    "'gpu_memory_bytes': torch.cuda.get_device_properties(0).total_memory if cuda else None}))"
)
CPU_ENVIRONMENT = {"cuda": False, "gpu": "cpu", "gpu_memory_bytes": None}
REPOSITORY = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class DriverSettings:
    """Where rows and logs go, and how long trials may take."""

    out: Path  # JSON lines, appended to
    log_dir: Path  # a log file per trial
    resume: bool = False
    time_limit_min: float | None = None  # start no trial that may not end within this
    trial_timeout_s: float = 1800
    bus_gbps: float | None = None  # simulated rows: the bus bandwidth of their modelled step


def git_tree_hash(directory: Path) -> str:
    """The git tree object id of a package directory (subpackages included; bytecode caches left
    out), computed from the files themselves: ``git rev-parse COMMIT:thunder_memopt`` names the
    commit whose package a row ran, even where the copy that ran it has stale or no git metadata."""
    entries = []
    for path in directory.iterdir():
        if path.name == "__pycache__" or path.suffix == ".pyc":
            continue
        if path.is_file():
            content = path.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).digest()
            entries.append((path.name.encode(), b"100644 " + path.name.encode() + b"\0" + blob))
        elif path.is_dir() and any(p.is_file() for p in path.rglob("*") if "__pycache__" not in p.parts):
            tree = bytes.fromhex(git_tree_hash(path))
            # git orders a tree's entries by name, a directory's name as if it ended in "/".
            entries.append((path.name.encode() + b"/", b"40000 " + path.name.encode() + b"\0" + tree))
    body = b"".join(entry for _, entry in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def describe_environment() -> dict[str, Any]:
    """The device, the versions, and which thunder_memopt the workers import (this repository's)."""
    found = CPU_ENVIRONMENT
    if torch.cuda.device_count() > 0:
        probe = subprocess.run([sys.executable, "-c", ENVIRONMENT_PROBE], capture_output=True, text=True, check=True)
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "-C", str(REPOSITORY), "describe", "--always", "--dirty"],
                            capture_output=True, text=True)
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # an optional extra: litgpt models need none
        transformers = None
    return {
        "cuda": found["cuda"],
        "gpu": found["gpu"],
        "gpu_memory_bytes": found["gpu_memory_bytes"],  # GPU 0's total: what --memory-cap is a fraction of
        "torch": importlib.metadata.version("torch"),
        "thunder": importlib.metadata.version("lightning-thunder"),
        "litgpt": importlib.metadata.version("litgpt"),
        "transformers": transformers,
        "memopt_commit": commit.stdout.strip() or None,
        "memopt_tree": git_tree_hash(REPOSITORY / "thunder_memopt"),
    }


def worker_environment(compile_cache: Path | None) -> dict[str, str]:
    """The driver's environment without its own torchrun's variables, with this repository first on
    the path (the worker is ``-m benchmarks.fsdp2.worker``, and imports this thunder_memopt)."""
    env = {name: value for name, value in os.environ.items()
           if name not in TORCHRUN_RANK_VARIABLES and not name.startswith("TORCHELASTIC_")}
    env = {**MULTICAST_OFF, **env}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if compile_cache is not None:
        # Cold compile caches, so that first-step times compare across rows and runs.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(compile_cache / "triton")
    return env


def one_rank_variables() -> dict[str, str]:
    """What torchrun tells its one rank, for a rank started without it (a torchrun is one more
    process that imports torch: 2 s of CPU a row): rank 0 of 1, rendezvous on a free local port
    (torchrun's own ``get_free_port``)."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "localhost", "MASTER_PORT": str(get_free_port())}


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this driver started for one trial."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_GRACE_S)
            return


def run_process(command: list[str], env: dict[str, str], log: IO[str], timeout_s: float,
                poll: Callable[[], None] | None = None) -> int | None:
    """Run ``command`` in its own process group; its exit code, or None if it ran out of time.
    ``poll``, if given, is called about every POLL_S seconds while it runs."""
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                return process.wait(timeout=max(0.0, left if poll is None else min(left, POLL_S)))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return None
                poll()
    finally:
        if process.poll() is None:
            stop_process_group(process)


def log_tail(log_path: Path) -> str:
    return " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-LOG_TAIL_LINES:])


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def trial_outcome(work_dir: Path, exit_code: int | None, timeout_s: float, log_path: Path) -> dict:
    """The worker's result, or a status that says why there is none."""
    result = read_json(work_dir / worker.RESULT_FILE)
    failures = [read_json(path) for path in sorted(work_dir.glob(worker.FAILURE_FILES))]
    training_failures = [failure for failure in failures if failure["phase"] == "train"]
    if result is not None and not training_failures:
        for failure in failures:  # the saved-activation measurement, after the steps
            result["saved_error"] = f"{failure['status']}: {failure['error']}"
        return result
    if training_failures:
        first = next((f for f in training_failures if f["status"] == "OOM"), training_failures[0])
        return {"status": first["status"], "error": first["error"]}
    if exit_code is None:
        return {"status": "timeout", "error": f"stopped after {timeout_s:.0f} s"}
    return {"status": "error", "error": f"exit code {exit_code}: {log_tail(log_path)}"}


def launch_trial(trial: Trial, log_path: Path, timeout_s: float) -> dict:
    """Run ``trial`` under a fresh ``torch.distributed.run`` and return its outcome."""
    # Search probes share the compile caches: there, only whether a size fits matters.
    return launch_worker(worker.__name__, trial.fields(), trial.sharding.processes, log_path, timeout_s,
                         cold_caches=not trial.measurement.search)


def launch_worker(module: str, payload: dict, processes: int, log_path: Path, timeout_s: float, *,
                  cold_caches: bool = True, watch: Callable[[Path], None] | None = None) -> dict:
    """Run ``python -m module PAYLOAD_JSON`` on ``processes`` ranks of a fresh ``torch.distributed.run``
    (one rank: a fresh process with torchrun's variables, ``one_rank_variables``) in a temporary
    directory, which holds PAYLOAD_JSON and what the ranks write; return its outcome.
    ``watch``, if given, is called with that directory while the ranks run, and once after."""
    with tempfile.TemporaryDirectory(prefix="benchmark_fsdp2_") as work:
        work_dir = Path(work)
        payload_file = work_dir / "trial.json"
        worker.write_json(payload_file, payload)
        env = worker_environment(work_dir if cold_caches else None)
        if processes == 1:
            command = [sys.executable, "-m", module, str(payload_file)]
            env.update(one_rank_variables())
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={processes}", "-m", module, str(payload_file)]
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            exit_code = run_process(command, env, log, timeout_s, None if watch is None else lambda: watch(work_dir))
        if watch is not None:
            watch(work_dir)
        return trial_outcome(work_dir, exit_code, timeout_s, log_path)


def same_measurement(row: dict, key: dict) -> bool:
    """Whether ``row`` measured what ``key`` describes. A field added after the row was written takes
    the value that rows had before (trial.FIELD_DEFAULTS); a backend's options count only for the
    backends that own them, so --resume keeps, say, an eager row written before they existed."""
    own = backends.BACKENDS[key["backend"]].own_fields
    ignored = [field for field in backends.OPTION_FIELDS if field not in own]
    return all(field_value(row, field) == value for field, value in key.items() if field not in ignored)


class TimeLimitReached(Exception):
    """Not enough of --time-limit is left for another trial."""


class Driver:
    """Runs trials in fresh processes, appends their rows to --out and keeps this run's rows."""

    def __init__(self, settings: DriverSettings, environment: dict[str, Any]) -> None:
        self.settings = settings
        self.environment = environment  # in every row
        self.out = settings.out
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_dir = settings.log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.earlier_rows = load_rows([self.out]) if settings.resume and self.out.exists() else []
        self.deadline = time.monotonic() + settings.time_limit_min * 60 if settings.time_limit_min else None
        self.longest_trial_s = 0.0
        self.trials = 0
        self.rows: list[dict] = []

    def earlier_row(self, key: dict) -> dict | None:
        """With --resume, the last row of --out that measured ``key`` (a run row only if ok or OOM)."""
        matches = [row for row in self.earlier_rows
                   if row.get("status", "ok") in FINAL_STATUSES and same_measurement(row, key)]
        return matches[-1] if matches else None

    def trial_timeout(self) -> tuple[float, bool]:
        """Seconds the next trial may take, and whether --time-limit (not --trial-timeout) sets them."""
        trial_timeout_s = self.settings.trial_timeout_s
        if self.deadline is None:
            return trial_timeout_s, False
        left = self.deadline - time.monotonic()
        if left < max(self.longest_trial_s, 1.0):
            raise TimeLimitReached
        return min(left, trial_timeout_s), left < trial_timeout_s

    def context(self) -> dict:
        """What every row says about where, when and how it was measured."""
        return {**self.environment,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": shlex.join(sys.argv)}

    def record(self, key: dict, row: dict) -> None:
        """Append ``row`` to --out, unless --resume found one with the same key there already."""
        earlier = self.earlier_row(key)
        if earlier is not None:
            self.rows.append(earlier)
            return
        with open(self.out, "a") as out:
            out.write(json.dumps(row) + "\n")
        self.rows.append(row)

    def run(self, trial: Trial) -> dict:
        """The row of ``trial``: from --out with --resume, else measured now and appended."""
        self.trials += 1
        key = {"row_type": RUN_ROW, **trial.key()}
        earlier = self.earlier_row(key)
        if earlier is not None:
            print(f"[{self.trials}] {backends.describe_trial(trial)}: {earlier['status']} in {self.out} (--resume)",
                  flush=True)
            self.rows.append(earlier)
            return earlier
        timeout_s, limited_by_deadline = self.trial_timeout()
        print(f"[{self.trials}] {backends.describe_trial(trial)} ...", flush=True)
        budget = backends.budget_in_name(trial.compilation.backend, trial.compilation.budget)
        budget = budget and f"@{budget}"
        log_path = self.log_dir / (f"{time.strftime('%Y%m%d-%H%M%S')}_{trial.compilation.backend}{budget}"
                                   f"_T{trial.workload.block_size}.log")
        started = time.monotonic()
        outcome = launch_trial(trial, log_path, timeout_s)
        elapsed = time.monotonic() - started
        if outcome["status"] == "timeout" and limited_by_deadline:
            raise TimeLimitReached
        self.longest_trial_s = max(self.longest_trial_s, elapsed)
        row = {**key, **self.context(), "log": str(log_path), "wall_s": elapsed,
               **dict.fromkeys(MEMORY_FIELDS + HOST_MEMORY_FIELDS), **outcome}
        if "sim_timeline" in outcome:
            timeline = step_model.Timeline.from_json(outcome["sim_timeline"])
            row.update(step_model.model_step(timeline, world_size=trial.sharding.world_size,
                                             bus_gbps=self.settings.bus_gbps or step_model.NVLINK_BUS_GBPS).fields())
        self.record(key, row)
        print(f"    -> {tables.describe_row(row)} [{elapsed:.0f} s, log {log_path}]", flush=True)
        return row


def sweep(driver: Driver, trials: Iterable[Trial]) -> None:
    """A row for each trial, in order."""
    for trial in trials:
        driver.run(trial)


def warn_on_loss_disagreement(rows: list[dict], rtol: float) -> None:
    """A WARNING line for each row whose loss differs from its group's (eager's, else first) loss."""
    groups: dict[tuple, list[dict]] = {}
    measured = tables.measured_rows(rows)
    if any(field_value(row, "simulated") for row in measured):
        print("Losses of simulated rows are not compared: the fake process group's collectives move no data.",
              flush=True)
    for row in measured:
        if row.get("loss") is not None and not field_value(row, "simulated"):
            groups.setdefault(tables.config_of(row, with_block_size=True), []).append(row)
    for group in groups.values():
        reference = next((row for row in group if row["backend"] == "eager"), group[0])
        for row in group:
            difference = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            if difference > rtol:
                print(f"WARNING: loss of {backends.label(row)} at T={row['block_size']} "
                      f"is {row['loss']:.5f}, "
                      f"{backends.label(reference)}'s is {reference['loss']:.5f} "
                      f"(relative difference {difference:.2e} > {rtol:g})", flush=True)


def report(rows: list[dict], plot_path: Path | None, loss_rtol: float) -> None:
    """The end of a run: the table of its rows, loss warnings, and the plot (unless ``plot_path`` is None)."""
    if rows:
        print(tables.markdown(rows), flush=True)
    warn_on_loss_disagreement(rows, loss_rtol)
    if plot_path is not None and tables.measured_rows(rows):
        plots.plot(rows, plot_path)
        print(f"plot: {plot_path}", flush=True)
