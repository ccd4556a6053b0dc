"""What a new user reads: the example's hint to use torchrun, whole help texts, the options that the
docs must state, the offload warning's sizes, and ``--version`` alone on the terminal."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import thunder_memopt

ROOT = Path(__file__).resolve().parents[1]


def test_the_fsdp2_example_without_torchrun_says_to_use_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["examples/fsdp2_thunderfx.py"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "examples" / "fsdp2_thunderfx.py"), run_name="__main__")
    message = str(exited.value.code)
    assert "\n" not in message and "torchrun --nproc-per-node 2 examples/fsdp2_thunderfx.py" in message


def test_the_benchmarks_help_gives_each_default_once(capsys):
    from benchmarks.fsdp2.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert "(default 350, H100/H200 NVLink" in text and "(default), or in-graph-fp32" not in text


def test_the_benchmark_docs_name_every_loss_mode():
    from benchmarks.fsdp2.trial import LOSS_MODES

    docs = (ROOT / "docs" / "benchmark.md").read_text()
    line = next(item for item in docs.split("\n- ") if item.startswith("`--loss-mode`"))
    assert all(f"`{mode}`" in line for mode in LOSS_MODES), line


def test_the_options_docs_state_the_offload_floor():
    from thunder_memopt.passes.offload import MIN_BYTES

    row = next(line for line in (ROOT / "docs" / "options.md").read_text().splitlines()
               if line.startswith("| `offload_budget` |"))
    assert f"at least {MIN_BYTES >> 20} MiB (`thunder_memopt.passes.offload.MIN_BYTES`)" in row


def test_the_cpu_tables_speak_of_ranks():
    from benchmarks.fsdp2 import tables

    assert [name for name, _ in tables.RUN_COLUMNS if name.startswith("tokens/s")] == ["tokens/s/rank"]


def test_the_host_limit_warning_gives_bytes_under_a_tenth_of_a_mib(monkeypatch):
    from thunder_memopt.executors import offload as offload_executor

    monkeypatch.setattr(offload_executor, "_host", offload_executor._HostLimit())
    monkeypatch.setattr(offload_executor, "_kept", {0: (None, 3000)})
    offload_executor.set_host_memory_limit(4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offload_executor._warn_of_kept_once()
    (message,) = [str(w.message) for w in caught]
    assert "kept 3000 bytes of saved tensors" in message and "past host_memory_limit (4096 bytes)" in message


def test_version_prints_the_version_alone():
    finished = subprocess.run([sys.executable, "-m", "thunder_memopt", "--version"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
    assert finished.returncode == 0 and finished.stdout == f"thunder_memopt {thunder_memopt.__version__}\n"
    assert not re.sub(r".*No CUDA runtime is found.*\n", "", finished.stderr), finished.stderr
