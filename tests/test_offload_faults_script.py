"""CPU test of benchmarks/diagnostics/offload_faults.py, the GPU check that an out-of-memory error
inside a step with offload leaves nothing behind: its --cpu-dry-run (a tiny model, the error raised
at a copy in the backward) reports every check passed, and bad flags are argparse's one-line errors."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.diagnostics

from benchmarks.diagnostics import offload_faults  # noqa: E402
from thunder_memopt.executors import offload as offload_executor  # noqa: E402


def test_the_dry_run_passes_every_check_and_leaves_offload_as_it_found_it(tmp_path, capsys):
    out = tmp_path / "faults.md"
    minimum = offload_faults.offload_pass.MIN_BYTES
    assert offload_faults.main(["--cpu-dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == 11 and not any(row.endswith("| FAIL |") for row in rows), text
    assert sum(row.endswith("| pass |") for row in rows) == 7 and "Verdict: every check passed." in text
    assert "OutOfMemoryError in the backward" in text and "lightning-thunder" in text
    assert "compiling at T=32" in capsys.readouterr().err
    # Its patches undone: the executor's copies and the pass's smallest offloaded tensor.
    assert offload_faults.offload_pass.MIN_BYTES == minimum
    assert not isinstance(offload_executor._copied, offload_faults.CopyCounter)
    assert offload_executor.offload_state() == offload_faults.EMPTY


@pytest.mark.parametrize(("argv", "says"), [
    (["--cpu-dry-run"], "the following arguments are required: --out"),
    (["--cpu-dry-run", "--out", "x.md", "--seq-len", "64"], "--fail-seq-len (64) must be larger than --seq-len (64)"),
    (["--cpu-dry-run", "--out", "x.md", "--cap-at", "1"], "--cap-at must be strictly between 0 and 1, got 1"),
    (["--cpu-dry-run", "--out", "x.md", "--n-embd", "100"], "must be a multiple of the head size 64"),
    (["--cpu-dry-run", "--out", "x.md", "--n-layer", "0"], "must be at least 1, got 0"),
    (["--out", "x.md"], "needs CUDA (no GPU here); --cpu-dry-run runs the steps on CPU"),
])
def test_a_bad_flag_is_a_one_line_error(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(offload_faults.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        offload_faults.parse_args(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("offload_faults.py: error: ") and says in error, error
