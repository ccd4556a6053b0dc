"""CPU tests of the memory-against-step-time analysis (benchmarks/fsdp2/pareto.py) and its command
line (benchmarks/make_pareto.py), on hand-built rows whose front and verdict are worked out by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks import make_pareto  # noqa: E402
from benchmarks.fsdp2 import backends, pareto  # noqa: E402
from benchmarks.fsdp2.tables import GIB  # noqa: E402

COMMAND = ("benchmarks/benchmark_fsdp2.py --nproc-per-node 1 --n-layer 8 --block-size 8192 --shard-mode zero2 "
           "--compile eager eager-ac inductor thunder+memopt thunder+memopt-offload --resume --time-limit 9")
CONFIG = {"row_type": "run", "search": False, "model": "stablecode-completion-alpha-3b", "n_layer": 8, "n_embd": 2560,
          "vocab_size": 49152, "block_size": 8192, "micro_batch_size": 1, "dtype": "bfloat16",
          "distributed_mode": "fsdp2", "shard_mode": "zero2", "head_unit": "root", "world_size": 1,
          "gpu": "NVIDIA H200", "fusion": "on", "memopt_passes": None, "autocast": False, "loss_mode": "in-graph",
          "optimizer": "foreach", "simulated": False}


def row(backend: str, gib: float | None, step_ms: float | None, *, budget: float | None = None,
        keep: float | None = None, status: str = "ok", minute: int = 0, **fields) -> dict:
    """A run row of the one synthetic invocation (``minute`` minutes after its start)."""
    return {**CONFIG, "backend": backend, "budget": budget, "offload_keep": keep, "status": status,
            "peak_alloc_max": None if gib is None else int(gib * GIB),
            "peak_reserved_max": None if gib is None else int(gib * GIB) + GIB, "step_ms": step_ms,
            "date": f"2026-12-04T10:{minute:02d}:00+00:00", "command": COMMAND, **fields}


def point(label: str, gib: float, step_ms: float, ours: bool = False) -> pareto.Point:
    return pareto.Point(label, int(gib * GIB), step_ms, ours)


# Ours is fastest at every level: thunder+memopt @0 (9 GiB, 120 ms) beats eager-ac (10 GiB, 135 ms)
# from 9 GiB up, until thunder+memopt @1 (12 GiB, 105 ms) beats inductor (14 GiB, 108 ms).
WINNING = [row("eager", 16, 112, minute=1), row("eager-ac", 10, 135, minute=2), row("inductor", 14, 108, minute=3),
           row("thunder+memopt", 12, 105, budget=1.0, minute=4), row("thunder+memopt", 9, 120, budget=0.0, minute=5),
           row("thunder+memopt-offload", 8, 130, budget=0.0, keep=0.5, minute=6),
           row("thunder", 26, 213, minute=7), row("inductor-budget", None, None, budget=0.0, status="OOM", minute=8)]


def test_labels_are_the_tables_with_budget_and_keep() -> None:
    labels = {p.label for p in pareto.analyse(WINNING).points}
    assert labels == {"eager", "eager-ac", "inductor", "thunder", "thunder+memopt @1", "thunder+memopt @0",
                      "thunder+memopt-offload @0 [keep 0.5]"}
    assert set(pareto.OURS) <= set(backends.BACKENDS)
    ours = {p.label for p in pareto.analyse(WINNING).points if p.ours}
    assert ours == {"thunder+memopt @1", "thunder+memopt @0", "thunder+memopt-offload @0 [keep 0.5]"}


def test_dominated_points_are_off_the_front() -> None:
    low, fast, dominated, slow_and_big = (point("low", 8, 130), point("fast", 12, 105), point("dominated", 13, 110),
                                          point("slow and big", 20, 200))
    assert pareto.dominates(fast, dominated) and not pareto.dominates(dominated, fast)
    assert not pareto.dominates(low, fast) and not pareto.dominates(fast, low)
    assert pareto.pareto_front([slow_and_big, dominated, fast, low]) == (low, fast)


def test_ties_on_the_front() -> None:
    a, twin = point("a", 10, 100), point("twin", 10, 100)
    assert not pareto.dominates(a, twin) and not pareto.dominates(twin, a)  # neither is strictly better
    more_memory, slower = point("more memory", 11, 100), point("slower", 10, 101)
    assert pareto.dominates(a, more_memory) and pareto.dominates(a, slower)
    assert pareto.pareto_front([slower, twin, more_memory, a]) == (a, twin)
    # An equal step of ours is at or below the other's: no miss.
    (level,) = pareto.compare_levels([point("ours", 10, 100, ours=True), point("other", 10, 100)])
    assert level.ratio == 1.0 and not level.miss


def test_winning_rows_have_no_miss() -> None:
    result = pareto.analyse(WINNING)
    assert [p.label for p in result.front] == ["thunder+memopt-offload @0 [keep 0.5]", "thunder+memopt @0",
                                               "thunder+memopt @1"]
    assert [level.memory / GIB for level in result.levels] == [8, 9, 10, 12, 14, 16, 26]
    assert [level.other and level.other.label for level in result.levels] == [
        None, None, "eager-ac", "eager-ac", "inductor", "inductor", "inductor"]
    assert result.levels[2].ratio == pytest.approx(120 / 135)
    assert result.misses == ()
    assert [row["status"] for row in result.left_out] == ["OOM"]


def test_a_level_where_ours_is_slower_is_a_miss() -> None:
    # At 14 GiB inductor (108 ms) beats ours (thunder+memopt @1 at 110 ms); at 16 GiB eager (107 ms) does.
    points = [point("ours @1", 12, 110, ours=True), point("ours @0", 9, 120, ours=True), point("eager-ac", 10, 135),
              point("inductor", 14, 108), point("eager", 16, 107)]
    levels = pareto.compare_levels(points)
    misses = [level for level in levels if level.miss]
    assert [level.memory / GIB for level in misses] == [14, 16]
    assert misses[0].ours.label == "ours @1" and misses[0].other.label == "inductor"
    assert misses[0].ratio == pytest.approx(110 / 108)
    assert misses[1].other.label == "eager" and misses[1].ratio == pytest.approx(110 / 107)
    assert not any(level.miss for level in levels if level.memory < 14 * GIB)


def test_ours_absent_at_the_smallest_level_is_a_miss() -> None:
    levels = pareto.compare_levels([point("eager-ac", 7, 135), point("ours", 9, 120, ours=True)])
    assert levels[0].memory == 7 * GIB and levels[0].ours is None and levels[0].miss and levels[0].ratio is None
    assert not levels[1].miss and levels[1].ratio == pytest.approx(120 / 135)


def test_mixed_invocations_and_configurations_are_rejected() -> None:
    a_day_later = row("eager", 16, 112, date="2026-12-05T10:00:00+00:00")
    with pytest.raises(ValueError, match="more than one invocation.*minutes apart"):
        pareto.analyse(WINNING + [a_day_later])
    with pytest.raises(ValueError, match="more than one invocation.*other command lines"):
        pareto.analyse(WINNING + [row("eager", 16, 112, command=COMMAND + " --warmup 3")])
    with pytest.raises(ValueError, match="2 configurations.*block_size"):
        pareto.analyse(WINNING + [row("eager", 30, 230, block_size=16384)])
    # --time-limit differs between the chunks of one resumed invocation: still one.
    chunk = row("eager", 16, 112, minute=30, command=COMMAND.replace("--time-limit 9", "--time-limit 5"))
    assert len(pareto.analyse(WINNING[1:] + [chunk]).points) == 7


def test_bad_rows_are_rejected() -> None:
    with pytest.raises(ValueError, match="no row ran ok"):
        pareto.analyse([row("eager", None, None, status="OOM"), row("thunder", None, 50.0)])
    with pytest.raises(ValueError, match="no measured rows"):
        pareto.analyse([])
    with pytest.raises(ValueError, match="two rows of eager"):
        pareto.analyse([row("eager", 16, 112), row("eager", 16, 113, minute=1)])


def test_verdict_wording() -> None:
    assert "at every memory level (7 levels, 8.00 to 26.00 GiB)" in pareto.verdict(pareto.analyse(WINNING))
    # eager-ac at 7 GiB: below ours' least memory (8 GiB), slower than ours from 8 GiB up.
    losing = [r for r in WINNING if r["backend"] != "eager-ac"] + [row("eager-ac", 7, 140, minute=9)]
    text = pareto.verdict(pareto.analyse(losing))
    assert text.startswith("**Verdict:** not at every memory level: at 1 of the 7 levels")
    assert "at 7.00 GiB no thunder+memopt point fits while eager-ac does (140.0 ms)" in text
    only_ours = pareto.analyse([row("thunder+memopt", 12, 105, budget=1.0)])
    assert "nothing to compare" in pareto.verdict(only_ours)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_cli_prints_the_tables_and_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    results = write_rows(tmp_path / "pareto.jsonl", WINNING)
    assert make_pareto.main([str(results)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#### stablecode-completion-alpha-3b, 8 layers")
    assert "T=8192: peak memory against step time" in out
    assert "| thunder+memopt @0 | 9.00 | 120.0 | yes |" in out
    assert "| eager | 16.00 | 112.0 | no |" in out
    assert "| 10.00 | thunder+memopt @0 | 120.0 | eager-ac | 135.0 | 0.889x | at or below |" in out
    assert "inductor-budget @0 (OOM)" in out
    assert "at or below the fastest other backend that fits in that memory." in out


def test_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    results, png = write_rows(tmp_path / "pareto.jsonl", WINNING), tmp_path / "pareto.png"
    assert make_pareto.main([str(results), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err == ""


def test_cli_without_matplotlib_warns(tmp_path: Path, capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    results, png = write_rows(tmp_path / "pareto.jsonl", WINNING), tmp_path / "pareto.png"
    assert make_pareto.main([str(results), "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("WARNING: matplotlib is not installed") and captured.err.count("\n") == 1
    assert "**Verdict:**" in captured.out and not png.exists()


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("", "no measured rows"),
    ("{not json\n", "Expecting property name"),
    (json.dumps(row("eager", None, None, status="OOM")) + "\n", "no row ran ok"),
    ("".join(json.dumps(r) + "\n" for r in WINNING + [row("eager", 16, 1, date="2026-12-05T10:00:00+00:00")]),
     "more than one invocation"),
    ('{"row_type": "run"}\n', "not benchmark_fsdp2.py's"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, content: str | None,
                                              message: str) -> None:
    results = tmp_path / "rows.jsonl"
    if content is not None:
        results.write_text(content)
    assert make_pareto.main([str(results)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("make_pareto.py: error: ") and message in captured.err


def test_the_script_runs_as_a_file(tmp_path: Path) -> None:
    results = write_rows(tmp_path / "pareto.jsonl", WINNING)
    done = subprocess.run([sys.executable, str(REPOSITORY / "benchmarks" / "make_pareto.py"), str(results)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0 and "**Verdict:** at every memory level" in done.stdout
    missing = subprocess.run([sys.executable, str(REPOSITORY / "benchmarks" / "make_pareto.py"),
                              str(tmp_path / "missing.jsonl")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
