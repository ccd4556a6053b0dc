"""CPU tests of the benchmark's --memory-cap (benchmarks/fsdp2): each rank's CUDA caching allocator
capped by ``torch.cuda.set_per_process_memory_fraction`` in the row's fresh process, so that a
setting that needs more is an OOM row, as on a card of that size.

With them, --allocator-settings (PYTORCH_CUDA_ALLOC_CONF's form, set in the worker before anything
is allocated), so that the reserved memory is measured with and without expandable segments.

What needs no GPU: the flags' parsing and one-line errors, that the cap travels in the trial file
to the worker and is set there before anything is allocated (torch.cuda stubbed), that an
out-of-memory failure becomes an OOM row with its error on one line, that the cap tells rows and
tables apart, and gpu_suite.sh's fit-cap group (a stub interpreter records its commands, which
the benchmark's own parser reads back).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import backends, cli, driver, tables, worker  # noqa: E402
from benchmarks.fsdp2.trial import Trial  # noqa: E402

GIB = 2**30
H100_BYTES = 85_030_879_232  # torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3


def _trials(argv: list[str], device_bytes: int | None = H100_BYTES) -> list[Trial]:
    """The trials of a command line, as the driver on a GPU of ``device_bytes`` would run them."""
    args, parser = cli.parse_args(argv)
    cli.resolve_defaults(args, parser, cuda=True, device_bytes=device_bytes)
    return cli.sweep_trials(args, cli.trial_template(args, world_size=1))


def _usage_error(argv: list[str], capsys, cuda: bool = True) -> str:
    with pytest.raises(SystemExit) as exited:
        args, parser = cli.parse_args(argv)
        cli.resolve_defaults(args, parser, cuda=cuda, device_bytes=H100_BYTES if cuda else None)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    return line


def test_the_cap_is_in_every_row_of_the_invocation_and_tells_rows_apart():
    trials = _trials(["--compile", "thunder+memopt", "thunder+memopt-fit", "--memopt-budget", "1.0", "0.0",
                      "--memory-limit", "40", "--memory-cap", "40"])
    assert [t.measurement.memory_cap_gib for t in trials] == [40.0] * 3
    # The worker's trial file carries it, and reads it back.
    fields = json.loads(json.dumps(trials[0].fields()))
    assert fields["memory_cap_gib"] == 40.0 and Trial.from_fields(fields) == trials[0]
    assert "memory cap 40 GiB" in backends.describe_trial(trials[0])
    # --resume: a row without a cap (or one written before the flag) is another measurement.
    key = {"row_type": "run", **trials[0].key()}
    uncapped = {key_: value for key_, value in key.items() if key_ != "memory_cap_gib"}
    assert driver.same_measurement({**key, "status": "ok"}, key)
    assert not driver.same_measurement({**uncapped, "status": "ok"}, key)
    assert not driver.same_measurement({**key, "memory_cap_gib": 45.0, "status": "ok"}, key)
    assert _trials(["--compile", "inductor"])[0].measurement.memory_cap_gib is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--memory-cap", "0"], "argument --memory-cap: a memory cap in GiB must be a finite number above 0, got 0"),
    (["--memory-cap", "-1"], "argument --memory-cap: a memory cap in GiB must be a finite number above 0, got -1"),
    (["--memory-cap", "inf"], "argument --memory-cap: a memory cap in GiB must be a finite number above 0, got inf"),
    (["--memory-cap", "nan"], "argument --memory-cap: a memory cap in GiB must be a finite number above 0, got nan"),
    (["--memory-cap", "40GiB"], "argument --memory-cap: '40GiB' is not a memory cap: GiB (a number above 0)"),
    (["--memory-cap", "80"], "--memory-cap 80 GiB is more than the device's 79.19 GiB"),
])
def test_bad_caps_are_one_line_usage_errors(argv, message, capsys):
    assert _usage_error(argv, capsys) == f"benchmark_fsdp2.py: error: {message}"


def test_a_cap_without_a_gpu_is_a_usage_error(capsys):
    line = _usage_error(["--memory-cap", "40"], capsys, cuda=False)
    assert line == "benchmark_fsdp2.py: error: --memory-cap 40 caps a CUDA device's memory, and there is none"


class _FakeCuda:
    """torch.cuda as the worker's start calls it on a GPU of ``total`` bytes, recording the calls."""

    def __init__(self, monkeypatch, total: int) -> None:
        import torch

        self.calls: list[tuple] = []
        properties = type("Properties", (), {"total_memory": total})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: self.calls.append(("set_device", device)))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, device: self.calls.append(("fraction", fraction, device)))
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings",
                            lambda settings: self.calls.append(("settings", settings)))


def test_the_worker_sets_the_fraction_of_the_device_before_anything_else(monkeypatch):
    import torch

    cuda = _FakeCuda(monkeypatch, H100_BYTES)
    trial = _trials(["--compile", "inductor", "--distributed-mode", "none", "--memory-cap", "40"])[0]
    monkeypatch.setenv("LOCAL_RANK", "0")
    rank, device = worker.init_distributed(Trial.from_fields(trial.fields()))
    assert (rank, device) == (0, torch.device("cuda", 0))
    assert cuda.calls == [("set_device", device), ("fraction", 40 * GIB / H100_BYTES, device)]
    assert int(cuda.calls[1][1] * H100_BYTES) == 40 * GIB  # the allocator's allowed_memory_maximum
    # Without a cap, nothing is set; a cap over the device is a one-line error.
    cuda.calls.clear()
    worker.init_distributed(trial.replace(memory_cap_gib=None))
    assert cuda.calls == [("set_device", device)]
    with pytest.raises(ValueError, match=r"^--memory-cap 80 GiB is more than the device's 79.19 GiB$"):
        worker.cap_device_memory(80.0, device)


def test_the_allocator_settings_are_set_before_the_cap_and_tell_rows_apart(monkeypatch, capsys):
    import torch

    cuda = _FakeCuda(monkeypatch, H100_BYTES)
    argv = ["--compile", "thunder+memopt-fit", "--distributed-mode", "none", "--memory-limit", "40",
            "--memory-cap", "40", "--allocator-settings", "expandable_segments:True"]
    (trial,) = _trials(argv)
    assert trial.measurement.allocator_settings == "expandable_segments:True"
    assert "allocator expandable_segments:True" in backends.describe_trial(trial)
    monkeypatch.setenv("LOCAL_RANK", "0")
    _, device = worker.init_distributed(Trial.from_fields(trial.fields()))
    assert cuda.calls == [("set_device", device), ("settings", "expandable_segments:True"),
                          ("fraction", 40 * GIB / H100_BYTES, device)]
    key = {"row_type": "run", **trial.key()}
    default = {name: value for name, value in key.items() if name != "allocator_settings"}
    assert not driver.same_measurement({**default, "status": "ok"}, key)
    row = {**key, "status": "ok", "gpu": "NVIDIA H100 80GB HBM3", "world_size": 1}
    assert tables.ranks_of(row) == "1 × NVIDIA H100 80GB HBM3 capped at 40 GiB, allocator expandable_segments:True"
    for bad in ("expandable_segments", "expandable_segments:True,", "expandable segments:True"):
        line = _usage_error(["--allocator-settings", bad], capsys)
        assert line.startswith("benchmark_fsdp2.py: error: argument --allocator-settings: ")
    line = _usage_error(["--allocator-settings", "expandable_segments:True"], capsys, cuda=False)
    assert line.endswith("sets a CUDA allocator, and there is none")


def test_an_out_of_memory_step_is_an_oom_row_with_its_error_on_one_line(tmp_path, monkeypatch):
    """The worker's failure report (``reporting_failure``) of an allocator failure at the cap, as
    torch words it, read back by the driver into the row, and the row in the progress line and table."""
    import torch

    message = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "37.50 GiB is free. 40.00 GiB allowed; Of the allocated memory 38.10 GiB is allocated by PyTorch, "
               "and 1.20 GiB is reserved by PyTorch but unallocated.")
    monkeypatch.setattr(worker, "leave", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    with pytest.raises(SystemExit), worker.reporting_failure(tmp_path, 0, phase="train"):
        raise torch.OutOfMemoryError(message + "\nwhile running the compiled backward\n")
    log = tmp_path / "log"
    log.write_text("")
    outcome = driver.trial_outcome(tmp_path, 1, 60, log)
    assert outcome == {"status": "OOM",
                       "error": f"OutOfMemoryError: {message} | while running the compiled backward"}
    trial = _trials(["--compile", "thunder+memopt", "--memopt-budget", "1.0", "--memory-cap", "40"])[0]
    row = {"row_type": "run", **trial.key(), "gpu": "NVIDIA H100 80GB HBM3", "vocab_size": 49152,
           **outcome}
    assert tables.describe_row(row) == f"OOM: {outcome['error'][:tables.ERROR_CHARS]}"
    text = tables.markdown([row])
    assert "1 × NVIDIA H100 80GB HBM3 capped at 40 GiB" in text
    assert "| thunder+memopt @1 | OOM |" in text


def _suite_commands(group: str, tmp_path: Path) -> list[list[str]]:
    """The benchmark commands gpu_suite.sh's ``group`` runs, recorded by a stub interpreter."""
    record = tmp_path / "commands"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo eager && exit 0\n'
                    f'printf "%q " "$@" >> {record}\necho >> {record}\n')
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "GPU_TAG": "1xH100"}
    subprocess.run(["bash", str(REPOSITORY / "benchmarks/gpu_suite.sh"), group, str(tmp_path / "out")],
                   env=env, check=True, capture_output=True, text=True)
    return [shlex.split(line) for line in record.read_text().splitlines()]


def test_gpu_suite_fit_cap_runs_the_acceptance_rows(tmp_path):
    """Each command of the fit-cap group, read by the benchmark's parser: the settings, the cap and
    the limit of issue 51's acceptance, one invocation per T and per model."""
    commands = _suite_commands("fit-cap", tmp_path)
    assert [c[0] for c in commands] == ["benchmarks/benchmark_fsdp2.py"] * 3
    manual = [("thunder+memopt", 1.0), ("thunder+memopt", 0.5), ("thunder+memopt", 0.0),
              ("thunder+memopt-offload", 1.0), ("thunder+memopt-offload", 0.0)]
    expected = [(16384, 40.0, None, manual + [("thunder+memopt-fit", 40.0)]),
                (32768, 40.0, None, manual + [("thunder+memopt-fit", 40.0)]),
                (8192, 45.0, 8, [("inductor", None), *manual, ("thunder+memopt-fit", 45.0)])]
    for command, (block_size, cap, simulated, settings) in zip(commands, expected):
        args, parser = cli.parse_args(command[1:])
        assert (args.n_layer, args.shard_mode, args.simulate_world_size, args.memory_cap) == (
            32, "zero2", simulated, cap)
        trials = _trials(command[1:])
        assert [(t.compilation.backend, t.compilation.budget) for t in trials] == settings
        assert {(t.workload.block_size, t.workload.model) for t in trials} == {
            (block_size, "Llama-3-8B" if simulated else "stablecode-completion-alpha-3b")}
        assert all(t.sharding.world_size == (simulated or 1) for t in trials)
    assert commands[0][commands[0].index("--out") + 1].endswith("stablecode_32l_zero2_1xH100_T16384_cap40.jsonl")


def test_gpu_suite_fit_cap_expandable_runs_the_fit_rows_with_expandable_segments(tmp_path):
    commands = _suite_commands("fit-cap-expandable", tmp_path)
    assert len(commands) == 3
    for command, (block_size, cap) in zip(commands, [(16384, 40.0), (32768, 40.0), (8192, 45.0)]):
        (trial,) = _trials(command[1:])
        assert (trial.compilation.backend, trial.compilation.budget) == ("thunder+memopt-fit", cap)
        assert (trial.workload.block_size, trial.measurement.memory_cap_gib) == (block_size, cap)
        assert trial.measurement.allocator_settings == "expandable_segments:True"
        assert command[command.index("--out") + 1].endswith("_expandable.jsonl")
