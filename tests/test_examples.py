"""The examples run as a user runs them (on CPU here: narrowed model, gloo for FSDP2)."""

from __future__ import annotations

import ast
import math
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
COMMANDS = {
    "jit_single_device": [sys.executable, "examples/jit_single_device.py"],
    "fsdp2_thunderfx": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "examples/fsdp2_thunderfx.py"],
}


@pytest.mark.parametrize("example", sorted(COMMANDS))
def test_example_trains_and_reports_each_step(example):
    finished = subprocess.run(COMMANDS[example], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    losses = [float(loss) for loss in re.findall(r"^step \d+: loss (\S+),", finished.stdout, re.MULTILINE)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), finished.stdout


def test_single_device_flags_are_memory_optimizations_option_names(monkeypatch, capsys):
    # argparse prints the help and exits before the example builds anything: run in this process.
    monkeypatch.setattr(sys, "argv", ["examples/jit_single_device.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / "examples" / "jit_single_device.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert exited.value.code == 0
    flags = set(re.findall(r"--[\w-]+", printed))
    assert {"--activation-budget", "--offload", "--offload-budget"} <= flags, flags
    assert "--budget" not in flags
    assert "on CPU (where the fusion executor, CUDA's, claims nothing)." in " ".join(printed.split())


@pytest.mark.parametrize("example", sorted(COMMANDS))
def test_example_imports_nothing_private_from_thunder_memopt(example):
    tree = ast.parse((ROOT / "examples" / f"{example}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("thunder_memopt"):
            names = [node.module, *(alias.name for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("thunder_memopt")]
        else:
            continue
        private = [n for n in names for part in n.split(".") if part.startswith("_")]
        assert not private, (example, private)
