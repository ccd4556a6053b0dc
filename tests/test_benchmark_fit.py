"""CPU tests of the benchmark's thunder+memopt-fit backend (benchmarks/fsdp2): MemoryOptimization(
memory_limit=--memory-limit GiB) as a row per limit.

The command line reads limits in GiB (or ``auto``, which needs a CUDA device) into a row each,
with one-line errors for bad values; labels, progress lines, file names and --resume tell the
limits apart; the row's ``fit_*`` fields come from the plan and its checks (``fit_rows.fit_fields``).
One tiny row trains on CPU in this process, its limit in bytes (GiB x 2**30), and a check over the
limit after its warm-up plans again and compiles the second plan, as the worker does on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import backends, cli, driver, fit_rows, tables  # noqa: E402
from benchmarks.fsdp2.trial import Compilation, Measurement, Numerics, Sharding, Trial, Workload  # noqa: E402
from thunder_memopt.passes.fit import FitCheck, FitChoice, FitReport, RungCost, StepTerms  # noqa: E402

FIT = "thunder+memopt-fit"
GIB = 2**30


def _trials(argv: list[str]) -> list[Trial]:
    """The trials of a command line, on CPU, as the driver would run them."""
    args, parser = cli.parse_args(argv)
    cli.resolve_defaults(args, parser, cuda=False)
    return cli.sweep_trials(args, cli.trial_template(args, world_size=1))


def _usage_error(argv: list[str], capsys, cuda: bool = False) -> str:
    """The one line argparse ends with when the command line is refused (exit 2, before any work)."""
    with pytest.raises(SystemExit) as exited:
        args, parser = cli.parse_args(argv)
        cli.resolve_defaults(args, parser, cuda=cuda)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    return line


def test_each_memory_limit_is_a_row_labelled_with_it():
    trials = _trials(["--compile", "thunder+memopt", FIT, "--memopt-budget", "0.5", "--memory-limit", "45", "44.5"])
    assert [(t.compilation.backend, t.compilation.budget) for t in trials] == [
        ("thunder+memopt", 0.5), (FIT, 45.0), (FIT, 44.5)]
    rows = [{"row_type": "run", **t.key()} for t in trials]
    assert [backends.label(row) for row in rows] == ["thunder+memopt @0.5", f"{FIT} 45 GiB", f"{FIT} 44.5 GiB"]
    assert f"{FIT} memory_limit=44.5 GiB T=" in backends.describe_trial(trials[2])
    assert " budget=0.5 " in backends.describe_trial(trials[0])
    # The memory snapshot of each row gets a file of its own.
    args, parser = cli.parse_args(["--compile", FIT, "--memory-limit", "45", "--memory-snapshot", "/tmp/s.pickle"])
    cli.resolve_defaults(args, parser, cuda=True)
    (trial,) = cli.sweep_trials(args, cli.trial_template(args, world_size=1))
    assert trial.measurement.memory_snapshot == f"/tmp/s.{FIT}-45GiB.T8192.pickle"
    # auto is a limit of its own, before any stated one in a backend's rows.
    assert backends.label({**rows[1], "budget": "auto"}) == f"{FIT} auto"
    ordered = sorted(rows[1:] + [{**rows[1], "budget": "auto"}], key=tables.summary_order)
    assert [row["budget"] for row in ordered] == ["auto", 45.0, 44.5]


def test_the_limits_default_only_where_compile_names_the_backend():
    """A memory limit is one machine's: every backend (--compile unset) runs the fit at the limits
    given alone; named, it runs at the registry's default."""
    (default,) = backends.BACKENDS[FIT].budgets.default
    everything, _ = cli.parse_args([])
    assert FIT in everything.compile and everything.memory_limit == []
    named, _ = cli.parse_args(["--compile", FIT])
    assert named.memory_limit == [default]
    given, _ = cli.parse_args(["--memory-limit", "30"])
    assert [t.compilation.budget for t in _trials(["--memory-limit", "30"]) if t.compilation.backend == FIT] == [30.0]
    assert given.memory_limit == [30.0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--memory-limit", "0"], "argument --memory-limit: a memory limit in GiB must be a finite number above 0, got 0"),
    (["--memory-limit", "-3"], "argument --memory-limit: a memory limit in GiB must be a finite number above 0"),
    (["--memory-limit", "inf"], "argument --memory-limit: a memory limit in GiB must be a finite number above 0"),
    (["--memory-limit", "nan"], "argument --memory-limit: a memory limit in GiB must be a finite number above 0"),
    (["--memory-limit", "40GiB"], "argument --memory-limit: '40GiB' is not a memory limit: GiB (a number above 0) "
                                  "or auto"),
    (["--compile", FIT, "--memory-limit", "auto"], "--memory-limit auto is what a CUDA device allows, and there "
                                                  "is none: give the limit in GiB"),
    (["--distributed-mode", "thunder-fsdp", "--compile", FIT], "thunder-fsdp shards inside thunder.jit: only "
                                                              "thunder, thunder+fusion, thunder+memopt, "
                                                              "thunder+memopt-offload run under it"),
])
def test_bad_limits_are_one_line_usage_errors(argv, message, capsys):
    assert _usage_error(argv, capsys).startswith(f"benchmark_fsdp2.py: error: {message}")


def test_auto_is_taken_on_a_gpu_and_passed_as_is():
    args, parser = cli.parse_args(["--compile", FIT, "--memory-limit", "auto", "40"])
    cli.resolve_defaults(args, parser, cuda=True)
    assert args.memory_limit == ["auto", 40.0]
    assert [backends.memory_limit(value) for value in args.memory_limit] == ["auto", 40 * GIB]


def test_resume_tells_the_limits_apart():
    trial = _trials(["--compile", FIT, "--memory-limit", "45"])[0]
    row = {"row_type": "run", **trial.key(), "status": "ok"}
    key = {"row_type": "run", **trial.key()}
    assert driver.same_measurement(row, key)
    for other in (45.5, "auto"):
        assert not driver.same_measurement(row, {**key, "budget": other})
    # The options it owns count; another backend's do not.
    assert not driver.same_measurement(row, {**key, "fusion": "off"})
    assert driver.same_measurement(row, {**key, "offload_keep": 0.5})
    assert len(tables.latest([row, {**row, "budget": 45.5}, {**row}])) == 2


def _report(margin: int = 0) -> FitReport:
    """Two programs, a Block called 4 times a step and a head, with stated sizes."""
    block = FitChoice(rung=1, limit_bytes=1000, terms=StepTerms(100, 4, margin),
                      rungs=(RungCost(80, 120, 0.0), RungCost(50, 100, 1.0), RungCost(10, 90, 3.0)))
    head = FitChoice(rung=0, limit_bytes=1000, terms=StepTerms(600, 1, margin), rungs=(RungCost(30, 200, 0.0),))
    return FitReport((block, head), None)


def test_the_fit_fields_of_a_plan_and_its_checks():
    report = _report()
    block, head = report.choices
    fields = fit_rows.fit_fields(report, [])
    assert fields == {
        "fit_limit_bytes": 1000, "fit_predicted_peak_bytes": max(block.predicted_peak_bytes, head.predicted_peak_bytes),
        "fit_measured_peak_bytes": None, "fit_replanned": False, "fit_margin_bytes": 0, "fit_fits": True,
        "fit_checks": [], "fit_programs": 2, "fit_rungs": [1, 0], "fit_ladder_rungs": [3, 1],
        "fit_saved_bytes": [50, 30], "fit_saved_bytes_total": 80,
        # The Block's own peak: 100 static + 3 other calls x 50 saved + its pair's 100; the head's: 600 + 200.
        "fit_terms": [
            {"static_bytes": 100, "first_step_bytes": 0, "calls": 4, "call_gathered_bytes": 0,
             "call_gradient_bytes": 0, "saved_bytes": 50, "pair_peak_bytes": 100, "offloaded_bytes": 0,
             "margin_bytes": 0, "peak_bytes": 350, "predicted_peak_bytes": 350},
            {"static_bytes": 600, "first_step_bytes": 0, "calls": 1, "call_gathered_bytes": 0,
             "call_gradient_bytes": 0, "saved_bytes": 30, "pair_peak_bytes": 200, "offloaded_bytes": 0,
             "margin_bytes": 0, "peak_bytes": 800, "predicted_peak_bytes": 800}],
        "fit_allocator_fraction": None}
    assert fit_rows.fit_fields(dataclasses.replace(report, allocator_fraction=0.5), [])["fit_allocator_fraction"] == 0.5
    over = FitCheck(limit_bytes=1000, predicted_bytes=800, measured_bytes=1100, replan=True, margin_bytes=300)
    under = FitCheck(limit_bytes=1000, predicted_bytes=990, measured_bytes=995, replan=False, margin_bytes=300)
    fields = fit_rows.fit_fields(_report(margin=300), [over, under])
    assert (fields["fit_predicted_peak_bytes"], fields["fit_measured_peak_bytes"]) == (990, 995)
    assert (fields["fit_replanned"], fields["fit_margin_bytes"]) == (True, 300)
    assert fields["fit_checks"] == [
        {"predicted_bytes": 800, "measured_bytes": 1100, "replan": True, "margin_bytes": 300},
        {"predicted_bytes": 990, "measured_bytes": 995, "replan": False, "margin_bytes": 300}]
    # The progress line gives the limit, the predicted and the measured peak (GiB), and the rungs.
    row = {"status": "ok", "peak_alloc_max": None, "step_ms": 1.0, "tokens_per_s_per_gpu": 1.0, "loss": 1.0,
           "first_step_s": 1.0, **fields, "fit_limit_bytes": 40 * GIB, "fit_predicted_peak_bytes": 39 * GIB,
           "fit_measured_peak_bytes": 41 * GIB}
    assert ("fit: limit 40.00 GiB, predicted peak 39.00 GiB, measured 41.00 GiB, rungs [1, 0], planned again"
            in tables.describe_row(row))
    assert "39.00 GiB, no measured peak (CPU), rungs" in tables.describe_row({**row, "fit_measured_peak_bytes": None})


def test_a_tiny_fit_row_on_cpu_and_a_check_over_its_limit_plans_again():
    """On CPU the worker has no allocator peak to check: the row holds the plan alone. A peak
    measured over the limit (as the worker's check reads it on a GPU) plans again, with the error
    as the margin; the one more step compiles the second plan, which fits and saves less."""
    import thunder
    import torch

    from benchmarks.fsdp2 import worker
    from thunder_memopt.models import training_step

    limit_gib = 40.0
    trial = Trial(Workload(model="stablecode-completion-alpha-3b", n_layer=1, n_embd=64, narrowed=True,
                           block_size=32, micro_batch_size=1, seed=0),
                  Numerics(dtype="float32"), Sharding(distributed_mode="none", shard_mode="zero2", world_size=1),
                  Compilation(backend=FIT, budget=limit_gib), Measurement(warmup=2, iters=1))
    session = worker.TrainingSession(trial, torch.device("cpu"), rank=0)
    row = session.run_steps()
    memopt = session.training.memopt
    assert memopt.memory_limit == int(limit_gib * GIB)
    (choice,) = memopt.fit_report.choices
    assert (row["fit_limit_bytes"], row["fit_rungs"], row["fit_programs"]) == (int(limit_gib * GIB), [0], 1)
    assert row["fit_predicted_peak_bytes"] == choice.predicted_peak_bytes < row["fit_limit_bytes"]
    assert row["fit_measured_peak_bytes"] is None and row["fit_checks"] == [] and not row["fit_replanned"]
    assert row["fit_saved_bytes"] == [choice.rungs[0].saved_bytes] and row["fit_fits"]
    assert thunder.cache_misses(session.training.forward) == 1

    # Over the limit by half of what the ladder can take off: a second plan that fits exists.
    limit, peaks = row["fit_limit_bytes"], choice.predicted_peaks
    measured = iter([limit + (peaks[0] - min(peaks)) // 2, limit])
    step = functools.partial(training_step, session.training.loss, session.optimizer, *session.batches[0])
    checks = session.check_fit(step, lambda: next(measured))
    assert [check.replan for check in checks] == [True, False]
    assert thunder.cache_misses(session.training.forward) == 2
    fields = fit_rows.fit_fields(memopt.fit_report, checks)
    assert fields["fit_replanned"] and fields["fit_margin_bytes"] == checks[0].error_bytes > 0
    assert fields["fit_rungs"][0] > 0 and fields["fit_fits"]
    assert fields["fit_saved_bytes"][0] < choice.rungs[0].saved_bytes
    assert fields["fit_predicted_peak_bytes"] == checks[1].predicted_bytes <= limit
    assert fields["fit_measured_peak_bytes"] == limit
