"""CPU smoke test of benchmarks/benchmark_fsdp2.py (the package benchmarks/fsdp2), end to end under
torchrun (gloo, 2 ranks).

A tiny narrowed model (2 layers, n_embd 256, T=128) goes through eager, thunder and thunder+memopt
under FSDP2, each backend in its own fresh torchrun as on the GPU host; the JSON rows must be
complete and the backends' losses must agree. The search and the outcome classification, which
need no model, are checked directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
BENCHMARKS = REPOSITORY / "benchmarks"
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import backends, driver, plots, profiling, search, tables, tables_cli, worker  # noqa: E402
from benchmarks.fsdp2.trial import (  # noqa: E402
    HOST_MEMORY_FIELDS, IN_GRAPH_LOSS_MODES, LOSS_MODES, MEMORY_FIELDS, Compilation, Measurement, Numerics, Sharding,
    Trial, Workload, load_rows)

SMOKE_BACKENDS = ("eager", "thunder", "thunder+memopt")
REQUIRED_KEYS = {
    "backend", "budget", "model", "n_layer", "n_embd", "block_size", "micro_batch_size", "distributed_mode",
    "shard_mode", "world_size", "gpu", "torch", "thunder", "litgpt", "memopt_tree", "date", "status", "loss", "step_ms",
    "tokens_per_s_per_gpu", "first_step_s", "saved_bytes_per_layer", "saved_h_bytes", *MEMORY_FIELDS,
    *HOST_MEMORY_FIELDS,
}
BF16_LOSS_RTOL = 0.02
SMOKE_TIMEOUT_S = 300
SMOKE_WARMUP, SMOKE_ITERS = 1, 2
SMOKE_STEPS = SMOKE_WARMUP + SMOKE_ITERS


def run_smoke_benchmark(work: Path) -> tuple[list[dict], str, Path]:
    """The rows, the printed output and the --out path of one small CPU run."""
    out = work / "results.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(BENCHMARKS / "benchmark_fsdp2.py"), "--compile", *SMOKE_BACKENDS, "--n-layer", "2",
               "--n-embd", "256", "--block-size", "128", "--warmup", str(SMOKE_WARMUP), "--iters", str(SMOKE_ITERS), "--profile",
               "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=work, timeout=SMOKE_TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    return load_rows([out]), finished.stdout, out


def check_a_row_per_backend_with_every_field(rows: list[dict]) -> None:
    assert [row["backend"] for row in rows] == list(SMOKE_BACKENDS)
    for row in rows:
        assert REQUIRED_KEYS <= row.keys(), REQUIRED_KEYS - row.keys()
        assert row["status"] == "ok", row.get("error")
        assert (row["distributed_mode"], row["shard_mode"], row["world_size"]) == ("fsdp2", "zero2", 2)
        assert (row["n_layer"], row["n_embd"], row["block_size"], row["gpu"]) == (2, 256, 128, "cpu")
        assert row["step_ms"] > 0 and row["tokens_per_s_per_gpu"] > 0 and row["saved_bytes_per_layer"] > 0
        # No CUDA allocator on CPU: the memory fields are null, not made up.
        assert all(row[field] is None for field in MEMORY_FIELDS)
        # The host's are measured: each rank's peak resident set (a process that imported torch and
        # trained holds well over 100 MiB), and no pinned allocator on CPU.
        assert row["host_rss_peak_max"] >= row["host_rss_peak_rank0"] > 100 * 2**20
        assert row["host_pinned_peak_max"] is None and row["host_pinned_peak_rank0"] is None
        assert row["profile"]["top_cpu_ms"] and row["profile"]["gpu_busy_fraction"] is None
    assert rows[-1]["budget"] == 1.0
    # The passes' compile-time cost is reported; on CPU the fusion executor (CUDA's) claims nothing,
    # and the transform still takes its (absent) regions apart and fuses again.
    assert set(rows[-1]["memopt_pass_s"]) == {"causal_mask", "masked_rows", "loss_head", "recompute", "fusion",
                                              "collectives", "schedule", "donate"}
    assert rows[-1]["executors"][:3] == ["memopt_linear_cross_entropy", "memopt_cudnn_attention", "memopt_fusion"]
    assert rows[-1]["fusion_functions"] == 0 and rows[-1]["memopt_donated_outputs"] == 0  # no regions on CPU
    assert all(seconds >= 0 for seconds in rows[-1]["memopt_pass_s"].values())


def check_backends_agree_on_the_loss(rows: list[dict], printed: str) -> None:
    eager = rows[0]["loss"]
    for row in rows[1:]:
        assert row["loss"] == pytest.approx(eager, rel=BF16_LOSS_RTOL), row["backend"]
        assert row["step_losses"] == pytest.approx(rows[0]["step_losses"], rel=BF16_LOSS_RTOL), row["backend"]
    assert "WARNING" not in printed
    # Every step's loss, the warm-ups' too; the last is the row's loss.
    assert all(len(row["step_losses"]) == SMOKE_STEPS and row["step_losses"][-1] == row["loss"] for row in rows)


def check_table_printed_and_plot_written(rows: list[dict], printed: str, out: Path, work: Path) -> None:
    assert tables.markdown(rows) in printed
    assert "| 128 | thunder+memopt @1 | ok |" in printed
    assert out.with_suffix(".png").stat().st_size > 0
    plot = work / "plot.png"
    table = subprocess.run([sys.executable, str(BENCHMARKS / "make_table.py"), str(out), "--plot", str(plot)],
                           capture_output=True, text=True, check=True).stdout
    assert table.strip() == tables.markdown(rows)
    assert plot.stat().st_size > 0


def test_benchmark_end_to_end_on_cpu(tmp_path):
    # One test for the one run (about a minute and a half), so that pytest-xdist never starts it twice.
    rows, printed, out = run_smoke_benchmark(tmp_path)
    check_a_row_per_backend_with_every_field(rows)
    check_backends_agree_on_the_loss(rows, printed)
    check_table_printed_and_plot_written(rows, printed, out, tmp_path)


def test_the_ratio_table_compares_step_3_losses_of_real_rows_only():
    base = {"step_losses": [10.0, 8.0, 4.0, 2.0]}
    assert tables.loss_against(base, {"step_losses": [10.0, 8.0, 4.04]}) == "+1.00% (4.0400 / 4.0000)"
    assert tables.loss_against(base, {"step_losses": [10.0, 8.0]}) == "–"  # no third step
    assert tables.loss_against(base, {"loss": 4.0}) == "–"  # a row from before step_losses
    assert tables.loss_against(base, {"step_losses": [10.0, 8.0, 4.0], "simulated": True}) == "–"


def test_a_loss_apart_gets_a_warning(capsys):
    row = {"row_type": "run", "block_size": 128, "budget": None, "model": "m", "n_layer": 2, "n_embd": 256}
    rows = [{**row, "backend": "eager", "loss": 6.25}, {**row, "backend": "thunder", "loss": 6.25 * 1.03}]
    driver.warn_on_loss_disagreement(rows, rtol=BF16_LOSS_RTOL)
    assert capsys.readouterr().out.startswith("WARNING: loss of thunder at T=128")


@pytest.mark.parametrize(
    ("largest_fitting", "start", "expected"),
    [
        (45_000, 8192, (44_032, 45_056)),  # doubles to 65536, then bisects
        (3_000, 8192, (2048, 3072)),  # halves to 2048, then bisects
        (500, 1024, (None, 1024)),  # nothing fits
        (10**9, 8192, (131_072, None)),  # everything up to the limit fits
    ],
)
def test_search_doubles_then_bisects(largest_fitting, start, expected):
    probed = []

    def fits(block_size: int) -> bool:
        assert block_size % 1024 == 0 and block_size not in probed
        probed.append(block_size)
        return block_size <= largest_fitting

    assert search.find_max_block_size(fits, start, granularity=1024, limit=131_072) == expected
    assert len(probed) <= 12


def _stablecode_trial(**fields) -> Trial:
    """A trial of the real stablecode width under FSDP2 on 2 ranks; ``fields`` (flat names) override."""
    trial = Trial(Workload(model="stablecode-completion-alpha-3b", n_layer=8, n_embd=2560, narrowed=False,
                           block_size=8192, micro_batch_size=1, seed=0),
                  Numerics(dtype="bfloat16"), Sharding(distributed_mode="fsdp2", shard_mode="zero2", world_size=2),
                  Compilation(backend="eager"), Measurement(warmup=2, iters=5))
    return trial.replace(**fields)


class _LinearMemoryDriver:
    """Stands in for the benchmark's driver: a probe's peak reserved memory is linear in T, and it
    runs out of memory ``fragmentation`` bytes before the allocator's capacity."""

    capacity, base, per_token = 140 * 2**30, 20 * 2**30, 2**30 // 1024  # 1 GiB per 1024 tokens

    def __init__(self, fragmentation: int, reports_memory: bool) -> None:
        self.fragmentation, self.reports_memory = fragmentation, reports_memory
        self.probed: list[int] = []
        self.summaries: list[dict] = []

    def run(self, trial) -> dict:
        self.probed.append(trial.workload.block_size)
        peak = self.base + self.per_token * trial.workload.block_size
        if peak + self.fragmentation > self.capacity:
            return {"status": "OOM"}
        if not self.reports_memory:  # as on CPU
            return {"status": "ok", "peak_reserved_max": None, "reservable_bytes": None}
        return {"status": "ok", "peak_reserved_max": peak, "reservable_bytes": self.capacity}

    def context(self) -> dict:
        return {}

    def record(self, key: dict, row: dict) -> None:
        self.summaries.append(row)


@pytest.mark.parametrize(("fragmentation", "most_probes"), [(0, 5), (3 * 2**30, 8), (20 * 2**30, 14)])
def test_search_aims_at_where_the_peak_reaches_capacity(fragmentation, most_probes):
    """The line through two fitting probes' peaks points at the answer, so the search needs fewer
    probes than bisection (10 here); the capacity is learnt from the probes themselves. If the
    device runs out a little earlier than the line says (fragmentation), stepping down from the
    failed guess still beats bisection; if far earlier, the answer is still exact, at 4 probes more."""
    settings = search.SearchSettings(start=16384, granularity=1024, limit=1 << 20)
    template = _stablecode_trial(n_layer=32, block_size=16384, backend="thunder+memopt", budget=1.0, warmup=1, iters=1)
    aimed, bisected = _LinearMemoryDriver(fragmentation, True), _LinearMemoryDriver(fragmentation, False)
    for fake in (aimed, bisected):
        search.search(fake, settings, [template])
    d = aimed
    largest = (d.capacity - fragmentation - d.base) // d.per_token // 1024 * 1024
    for fake in (aimed, bisected):
        (summary,) = fake.summaries
        assert (summary["max_block_size"], summary["first_failing_block_size"]) == (largest, largest + 1024)
        assert summary["probes"] == len(fake.probed) == len(set(fake.probed))
    assert len(bisected.probed) == 10
    assert len(aimed.probed) <= most_probes, aimed.probed


def test_outcome_is_oom_when_any_rank_ran_out_of_memory(tmp_path):
    log = tmp_path / "log"
    log.write_text("worker output\n")
    (tmp_path / "rank0.json").write_text(json.dumps({"status": "error", "error": "peer gone", "phase": "train"}))
    (tmp_path / "rank1.json").write_text(json.dumps({"status": "OOM", "error": "CUDA out of memory", "phase": "train"}))
    assert driver.trial_outcome(tmp_path, 1, 60, log) == {"status": "OOM", "error": "CUDA out of memory"}
    # A peer left hanging in a collective until the timeout does not hide the OOM.
    assert driver.trial_outcome(tmp_path, None, 60, log)["status"] == "OOM"


def test_outcome_without_any_report_is_a_timeout_or_an_error(tmp_path):
    log = tmp_path / "log"
    log.write_text("Segmentation fault\n")
    assert driver.trial_outcome(tmp_path, None, 60, log)["status"] == "timeout"
    outcome = driver.trial_outcome(tmp_path, -11, 60, log)
    assert outcome["status"] == "error" and "Segmentation fault" in outcome["error"]


def test_a_failed_saved_bytes_measurement_keeps_the_row(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps({"status": "ok", "loss": 6.25}))
    failure = {"status": "OOM", "error": "out of memory", "phase": "saved-activations"}
    (tmp_path / "rank0.json").write_text(json.dumps(failure))
    outcome = driver.trial_outcome(tmp_path, 1, 60, tmp_path / "log")
    assert outcome == {"status": "ok", "loss": 6.25, "saved_error": "OOM: out of memory"}


def test_tables_show_the_latest_row_of_a_measurement():
    row = {"row_type": "run", "block_size": 128, "budget": None, "model": "m", "n_layer": 2, "n_embd": 256}
    rows = [{**row, "backend": "thunder", "status": "error"}, {**row, "backend": "eager", "status": "ok"},
            {**row, "backend": "thunder", "status": "ok"}]
    assert tables.latest(rows) == [rows[2], rows[1]]


def test_search_results_make_a_table_and_a_plot(tmp_path, capsys):
    """The committed 32-layer search rows (probes and one summary per backend) give the search table
    and the plot of the probes' peaks against T."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "stablecode_32l_zero2_max_block_size.jsonl"
    plot_path = tmp_path / "search.png"
    tables_cli.main([str(results), "--plot", str(plot_path)])
    table = capsys.readouterr().out
    summaries = tables.search_results(load_rows([results]))
    assert table.startswith("#### Longest sequence that fits")
    assert table.count("\n| stablecode") == len(summaries) == 3
    assert plot_path.stat().st_size > 0


def test_resume_takes_rows_written_before_later_options():
    """--resume on the committed files must not measure again an eager row written before --autocast,
    --fusion and --optimizer existed, but must measure again a thunder+memopt row of that time, which ran on
    Thunder's executors alone."""
    trial = _stablecode_trial()
    memopt = trial.replace(backend="thunder+memopt", budget=1.0)
    before_options = {"row_type": "run", **trial.key()}
    for added_later in ("autocast", "fusion", "optimizer"):
        del before_options[added_later]
    assert driver.same_measurement(before_options, {"row_type": "run", **trial.key()})
    memopt_before = {**before_options, "backend": "thunder+memopt", "budget": 1.0, "fuse_replays": "auto"}
    assert not driver.same_measurement(memopt_before, {"row_type": "run", **memopt.key()})
    memopt_now = {"row_type": "run", **memopt.key()}
    assert driver.same_measurement(memopt_now, {"row_type": "run", **memopt.key()})
    for backend in ("thunder+fusion", "thunder+memopt"):  # the backends that run thunder_memopt's executors
        now = {"row_type": "run", **memopt.replace(backend=backend).key()}
        assert not driver.same_measurement(now, {"row_type": "run", **memopt.replace(backend=backend, fusion="off").key()})


@pytest.mark.parametrize("backend", ["eager", "thunder"])
def test_loss_modes_agree_and_a_loss_after_the_model_holds_the_logits(backend):
    """--loss-mode litgpt and outside-fp32 compute the cross-entropy after the compiled model and
    keep its logits alive with the loss, as a litgpt training loop's variable does; in-graph-fp32
    computes outside-fp32's loss inside the module."""
    import torch

    from thunder_memopt.models import build_model, narrow_config, random_batch

    config = narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=128, block_size=64)
    input_ids, targets = random_batch(config, batch_size=1, seq_len=64)
    trial = _stablecode_trial(n_layer=1, n_embd=128, narrowed=True, block_size=64, distributed_mode="none",
                              world_size=1, backend=backend, warmup=1, iters=1)
    losses = {}
    for loss_mode in LOSS_MODES:
        training = worker.prepare_training(build_model(config), trial.replace(loss_mode=loss_mode), torch.device("cpu"))
        loss = training.forward(input_ids, targets)
        loss.backward()
        losses[loss_mode] = loss.item()
        if loss_mode not in IN_GRAPH_LOSS_MODES:
            assert loss.logits.shape == (1, 64, config.padded_vocab_size)
    assert losses["litgpt"] == pytest.approx(losses["in-graph"], rel=BF16_LOSS_RTOL)
    assert losses["outside-fp32"] == pytest.approx(losses["in-graph"], rel=BF16_LOSS_RTOL)
    assert losses["in-graph-fp32"] == pytest.approx(losses["in-graph"], rel=BF16_LOSS_RTOL)
    if backend == "eager":  # the same ops, inside the module or after it
        assert losses["in-graph-fp32"] == losses["outside-fp32"]


def test_optimizer_flag_picks_adamws_implementation_and_both_take_the_same_step():
    """--optimizer foreach (the default) and fused build AdamW with that implementation, the same for
    every backend; one step of each moves the weights alike (fused keeps the bf16 moments at fp32
    between its operations: within two bf16 units of each weight, or a fifth of the learning rate
    where a weight is near zero), and the rows and headings say which ran."""
    import torch

    from benchmarks.fsdp2.cli import parse_args, resolve_defaults, trial_template
    from thunder_memopt.models import training_step

    def trial_of(argv: list[str]) -> Trial:
        args, parser = parse_args(argv)
        resolve_defaults(args, parser, cuda=False)
        return trial_template(args, world_size=1)

    assert trial_of(["--compile", "eager"]).numerics.optimizer == "foreach"
    fused_trial = trial_of(["--compile", "eager", "--optimizer", "fused"])
    assert fused_trial.numerics.optimizer == "fused" and "optimizer=fused" in backends.describe_trial(fused_trial)
    weights = {}
    for optimizer in ("foreach", "fused"):
        trial = _stablecode_trial(n_layer=1, n_embd=128, narrowed=True, block_size=32, distributed_mode="none",
                                  world_size=1, optimizer=optimizer)
        session = worker.TrainingSession(trial, torch.device("cpu"), rank=0)
        assert session.optimizer.defaults[optimizer] is True
        training_step(session.training.loss, session.optimizer, *session.batches[0])
        weights[optimizer] = [p.detach().float().clone() for p in session.training.parameters_owner.parameters()]
    for a, b in zip(weights["foreach"], weights["fused"]):
        torch.testing.assert_close(a, b, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=worker.LEARNING_RATE / 5)
    assert "AdamW fused" in tables.heading({**TABLE_ROW, "optimizer": "fused"})
    assert "AdamW" not in tables.heading(TABLE_ROW)  # rows written before the flag: foreach


def test_batches_flag_makes_the_steps_cycle_through_that_many_batches(monkeypatch):
    """--batches N: the steps train on N random batches in turn, the first one the batch a run with
    one batch trains on every step; rows name the count where it is not 1, and rows written before the
    flag read as one batch."""
    import torch

    from benchmarks.fsdp2.cli import parse_args, resolve_defaults, trial_template
    from thunder_memopt.models import narrow_config, random_batch, random_batches

    def trial_of(argv: list[str]) -> Trial:
        args, parser = parse_args(argv)
        resolve_defaults(args, parser, cuda=False)
        return trial_template(args, world_size=1)

    assert trial_of(["--compile", "eager"]).workload.batches == 1
    assert trial_of(["--compile", "eager", "--batches", "3"]).workload.batches == 3
    config = narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=128, block_size=32)
    first, second = random_batches(config, count=2, batch_size=1, seq_len=32, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(first, random_batch(config, batch_size=1, seq_len=32, seed=5)))
    assert not torch.equal(first[0], second[0])

    trained: list[torch.Tensor] = []
    training_step = worker.training_step

    def recorded_step(loss_of, optimizer, input_ids, targets):
        trained.append(input_ids)
        return training_step(loss_of, optimizer, input_ids, targets)

    monkeypatch.setattr(worker, "training_step", recorded_step)
    trial = _stablecode_trial(n_layer=1, n_embd=128, narrowed=True, block_size=32, distributed_mode="none",
                              world_size=1, batches=2, warmup=1, iters=2)
    session = worker.TrainingSession(trial, torch.device("cpu"), rank=0)
    assert len(session.run_steps()["step_losses"]) == 3
    assert [next(i for i, (ids, _) in enumerate(session.batches) if ids is step_ids) for step_ids in trained] == [0, 1, 0]
    assert ", 2 random batches in turn," in tables.heading({**TABLE_ROW, "batches": 2})
    assert "random batches" not in tables.heading(TABLE_ROW)  # rows written before the flag: one batch


# An ok run row with the configuration fields the tables group by; tests add the rest.
TABLE_ROW = {"row_type": "run", "model": "m", "n_layer": 2, "n_embd": 256, "budget": None, "status": "ok",
             "world_size": 2, "gpu": "g", "dtype": "bfloat16", "micro_batch_size": 1, "distributed_mode": "fsdp2",
             "shard_mode": "zero2"}


def test_summary_has_a_row_per_backend_and_a_column_per_block_size():
    row = TABLE_ROW
    rows = [{**row, "backend": "thunder", "block_size": 128, "peak_alloc_max": 3 * 2**30, "step_ms": 20.0},
            {**row, "backend": "eager", "block_size": 256, "status": "OOM"},
            {**row, "backend": "eager", "block_size": 128, "peak_alloc_max": 2**30, "step_ms": 10.0}]
    lines = tables.summary(rows).splitlines()
    assert lines[2:] == ["| backend | T=128: peak GiB / step ms | T=256: peak GiB / step ms |", "|---|---|---|",
                         "| eager | 1.00 / 10 | OOM |", "| thunder | 3.00 / 20 | – |"]


def test_ratios_pair_only_rows_of_one_invocation():
    run = {**TABLE_ROW, "block_size": 128, "command": "benchmark_fsdp2.py --compile inductor thunder",
           "first_step_s": 10.0}
    rows = [{**run, "backend": "inductor", "peak_alloc_max": 4 * 2**30, "step_ms": 50.0, "date": "2026-12-01T10:00:00"},
            {**run, "backend": "thunder", "peak_alloc_max": 3 * 2**30, "step_ms": 55.0, "date": "2026-12-01T10:05:00"},
            # Another invocation: another command line, or the same one hours later.
            {**run, "backend": "eager", "command": "other", "peak_alloc_max": 2**30, "step_ms": 60.0,
             "date": "2026-12-01T10:06:00"},
            {**run, "backend": "thunder+memopt", "budget": 1.0, "peak_alloc_max": 2**30, "step_ms": 60.0,
             "date": "2026-12-01T12:00:00"}]
    lines = tables.ratios(rows, "inductor").splitlines()[4:]
    assert lines == ["| 128 | thunder | 0.75x (3.00 / 4.00 GiB) | 1.100x (55.0 / 50.0 ms) | 10.0 / 10.0 | – | 2026-12-01 10:00 |"]


def test_an_invocation_resumed_in_chunks_is_one_invocation_whatever_its_time_limits():
    """--time-limit only says when a run stops starting trials: the chunks of one invocation, resumed
    with another limit, still pair; another --compile list does not."""
    row = {"date": "2026-12-02T01:15:00+00:00", "command": "benchmark_fsdp2.py --resume --time-limit 6 --compile a b"}
    later = {"date": "2026-12-02T01:25:00+00:00"}
    assert tables.same_invocation(row, {**later, "command": "benchmark_fsdp2.py --resume --time-limit 6.5 --compile a b"})
    assert tables.same_invocation(row, {**later, "command": "benchmark_fsdp2.py --resume --time-limit=9 --compile a b"})
    assert not tables.same_invocation(row, {**later, "command": "benchmark_fsdp2.py --resume --time-limit 6 --compile a"})


def _per_token_rows(peaks: dict[str, tuple[float | None, float | None]], **fields) -> list[dict]:
    """Rows of one invocation at T=8192 and 16384: ``peaks`` gives each backend label's (a backend,
    or ``thunder+memopt@BUDGET``) peak allocated bytes at the two; ``fields`` override every row."""
    run = {**TABLE_ROW, "world_size": 1, "command": "benchmark_fsdp2.py --block-size 8192 16384", "step_ms": 900.0,
           "first_step_s": 30.0, **fields}
    rows = []
    for index, block_size in enumerate((8192, 16384)):
        for minute, (name, peak) in enumerate(peaks.items()):
            backend, _, budget = name.partition("@")
            rows.append({**run, "backend": backend, "budget": float(budget) if budget else None, "fusion": "on",
                         "block_size": block_size, "peak_alloc_max": peak[index],
                         "date": f"2026-12-01T10:{10 * index + minute:02d}:00+00:00"})
    return rows


def test_memory_per_token_is_the_slope_of_the_peak_between_two_block_sizes(tmp_path, capsys):
    """Peaks 3 MB and 1.5 MB per token apart over 8192 tokens give those slopes (MB = 10^6 bytes),
    and with --against the second is 0.50x the first; a backend from another invocation gets no
    slope, and one that ran out of memory at the longer T none either."""
    gib = tables.GIB
    rows = _per_token_rows({"inductor": (40 * gib, 40 * gib + 8192 * 3e6),
                            "thunder+memopt@1.0": (30 * gib, 30 * gib + 8192 * 1.5e6), "eager-ac": (20 * gib, None)})
    rows[-1]["status"] = "OOM"  # eager-ac at 16384
    rows.append({**rows[0], "backend": "eager", "block_size": 16384, "command": "another invocation"})
    slopes = {slope.label: slope for slope in tables.token_slopes(rows)}
    assert set(slopes) == {"inductor", "thunder+memopt @1", "eager-ac"}
    assert slopes["inductor"].bytes_per_token() == pytest.approx(3e6)
    assert slopes["thunder+memopt @1"].bytes_per_token() == pytest.approx(1.5e6)
    assert slopes["eager-ac"].bytes_per_token() is None
    section = tables.per_token_section(rows, base="inductor").split("\n\n")[-1].splitlines()
    assert section[0] == ("| backend | T=8192: peak GiB | T=16384: peak GiB | memory per token, MB (10^6 bytes) | "
                          "per token / inductor's | step ms at T=16384 | UTC |")
    assert section[2:] == [
        "| eager-ac | 20.00 | OOM | – | – | – | 2026-12-01 10:02 |",
        "| inductor | 40.00 | 62.89 | 3.00 | 1.00x (3.00 / 3.00 MB) | 900 | 2026-12-01 10:00 |",
        "| thunder+memopt @1 | 30.00 | 41.44 | 1.50 | 0.50x (1.50 / 3.00 MB) | 900 | 2026-12-01 10:01 |"]
    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tables_cli.main([str(results), "--against", "inductor", "--plot", str(tmp_path / "plot.png")])
    assert "\n".join(section) in capsys.readouterr().out
    assert (tmp_path / "plot.png").stat().st_size > 0
    tables_cli.main([str(results)])  # without --against: the slopes, no ratios
    assert "| inductor | 40.00 | 62.89 | 3.00 | 900 | 2026-12-01 10:00 |" in capsys.readouterr().out


def test_memory_per_token_of_cpu_rows_is_not_measured(tmp_path, capsys):
    """Rows that ran on CPU have no allocator peak: their slope says so, and the plot's panel too."""
    rows = _per_token_rows({"eager": (None, None), "thunder+memopt@1.0": (None, None)})
    (slope, _) = tables.token_slopes(rows)
    assert slope.bytes_per_token() is None and slope.not_measured()
    lines = tables.per_token_section(rows, base="eager").splitlines()
    assert lines[-2:] == [f"| eager | – | – | {tables.NOT_MEASURED} | – | 900 | 2026-12-01 10:00 |",
                          f"| thunder+memopt @1 | – | – | {tables.NOT_MEASURED} | – | 900 | 2026-12-01 10:01 |"]
    plots.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_summary_puts_defaults_first_and_latest_code_leaves_out_rows_before_the_executors(tmp_path, capsys):
    """Within a backend the summary lists the default settings, then budgets falling, then other
    execution; --latest-code drops thunder+memopt rows from before thunder_memopt's executors, and
    the plot does not split rows written before a field existed from rows that hold its old value."""
    row = {**TABLE_ROW, "block_size": 128, "peak_alloc_max": 2**30, "step_ms": 10.0}
    memopt = {**row, "backend": "thunder+memopt", "fusion": "on", "autocast": False}
    rows = [{**row, "backend": "thunder+memopt", "budget": 1.0},  # as before 1eec907 (2026-11-30): no fuse_replays, no autocast
            {**row, "backend": "thunder+memopt", "budget": 1.0, "fuse_replays": "auto", "autocast": False},
            {**memopt, "budget": 0.0}, {**memopt, "budget": 1.0, "memopt_passes": ["recompute"]},
            {**memopt, "budget": 0.5}, {**memopt, "budget": 1.0}, {**memopt, "budget": 1.0, "fusion": "off"},
            {**row, "backend": "thunder", "budget": None}, {**row, "backend": "thunder+fusion", "fusion": "on"}]
    results = tmp_path / "rows.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = [line.split(" | ")[0] for line in tables.summary(rows).splitlines()[4:]]
    assert labels == ["| thunder", "| thunder+fusion", "| thunder+memopt @1", "| thunder+memopt @0.5",
                      "| thunder+memopt @0", "| thunder+memopt @1 [recompute]",
                      "| thunder+memopt @1 [unfused replays]", "| thunder+memopt @1 [fused replays]",
                      "| thunder+memopt @1 [fusion off]"]
    tables_cli.main([str(results), "--summary", "--latest-code", "--plot", str(tmp_path / "plot.png")])
    out = capsys.readouterr().out
    assert "replays" not in out and "fusion off" in out
    assert plots.varying_fields(rows) == []


def test_rows_name_the_package_tree_git_would_give(tmp_path):
    """memopt_tree is `git rev-parse HEAD:thunder_memopt` of a commit of the package's files, computed
    without git, so that a row says which code it ran wherever it ran."""
    package = tmp_path / "thunder_memopt"
    package.mkdir()
    for source in (Path(__file__).resolve().parents[1] / "thunder_memopt").glob("*.py"):
        (package / source.name).write_bytes(source.read_bytes())
    (package / "py.typed").write_bytes(b"")  # package data counts; bytecode caches, untracked, do not
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "models.cpython-312.pyc").write_bytes(b"cache")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "thunder_memopt"], ["commit", "-q", "-m", "package"]):
        subprocess.run(git + command, check=True)
    expected = subprocess.run(git + ["rev-parse", "HEAD:thunder_memopt"], check=True, capture_output=True, text=True)
    assert driver.git_tree_hash(package) == expected.stdout.strip()


def test_profile_rows_get_a_kernel_table_per_step():
    row = {**TABLE_ROW, "backend": "thunder", "block_size": 128, "iters": 5, "step_ms": 20.0,
           "date": "2026-11-30T06:55:06+00:00", "peak_alloc_max": 2**30, "peak_reserved_max": 2**30,
           "profile": {"gpu_busy_fraction": 0.97, "top_gpu_ms": [["copy_kernel" + "<T>" * 40, 150.0, 1320]],
                       "top_cpu_ms": []}}
    section = tables.markdown([row]).split("##### ")[1]
    assert section.startswith("Profile: thunder, T=128, 2026-11-30T06:55: 20 ms per step, GPU busy 97%")
    kernel_line = section.splitlines()[-1]
    assert kernel_line.endswith("| 30.0 | 264 |") and len(kernel_line) < 120


def test_copies_between_host_and_device_are_a_kernel_class_of_their_own():
    """Offload's copies, under the profiler's names for them, apart from ATen's copy kernels."""
    by_class = profiling.gpu_ms_by_class([("Memcpy DtoH (Device -> Pinned)", 2000.0),
                                          ("Memcpy HtoD (Pinned -> Device)", 1000.0),
                                          ("void at::native::direct_copy_kernel_cuda", 500.0)])
    assert by_class["host copies"] == 3.0 and by_class["copy"] == 0.5 and by_class["other"] == 0.0


def test_the_backends_come_from_the_registry():
    """--compile, the budget flags, the rows each backend makes and gpu_suite.sh's list all read
    backends.BACKENDS: a backend is one entry there."""
    from benchmarks.fsdp2 import backends, cli

    listed = subprocess.run([sys.executable, "-m", "benchmarks.fsdp2.backends"], cwd=REPOSITORY, check=True,
                            capture_output=True, text=True).stdout.split()
    assert listed == list(backends.BACKENDS)
    args, _ = cli.parse_args(["--n-embd", "128", "--inductor-budget", "0.5", "0.25"])
    assert args.compile == listed and args.memopt_budget == [1.0]
    args.resolved_n_embd = 128
    args.block_size = [64]
    trials = cli.backend_trials(args, cli.trial_template(args, world_size=2))
    assert [(t.compilation.backend, t.compilation.budget) for t in trials] == [
        ("eager", None), ("eager-ac", None), ("inductor", None), ("inductor-budget", 0.5), ("inductor-budget", 0.25),
        ("thunder", None), ("thunder+fusion", None), ("thunder+memopt", 1.0), ("thunder+memopt-offload", 0.0)]
    thunder_fsdp, _ = cli.parse_args(["--distributed-mode", "thunder-fsdp"])
    assert thunder_fsdp.compile == ["thunder", "thunder+fusion", "thunder+memopt", "thunder+memopt-offload"]
    # --offload-keep: a row each for the backend that owns it, labelled with it.
    args, _ = cli.parse_args(["--compile", "inductor", "thunder+memopt-offload", "--offload-budget", "1.0",
                              "--offload-keep", "0.5", "0.25"])
    args.resolved_n_embd, args.block_size = 128, [64]
    trials = cli.backend_trials(args, cli.trial_template(args, world_size=1))
    assert [(t.compilation.backend, t.compilation.offload_keep) for t in trials] == [
        ("inductor", None), ("thunder+memopt-offload", 0.5), ("thunder+memopt-offload", 0.25)]
    assert backends.label({**trials[1].key(), "backend": "thunder+memopt-offload"}) == "thunder+memopt-offload @1 [keep 0.5]"


@pytest.mark.parametrize("mode", ["none", "fsdp2"])
def test_every_registry_entry_builds_on_cpu(mode):
    """Each backend's entry builds its model on CPU, on one device and as under FSDP2 (torch.compile
    with Thunder behind dynamo); the eager ones also run a step. (What compiles compiles at its first
    call; the smoke run above takes eager, thunder and thunder+memopt through whole steps.)"""
    import torch

    from benchmarks.fsdp2.backends import BACKENDS, as_is
    from thunder_memopt.models import build_model, narrow_config, random_batch

    config = narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=64, block_size=16)
    for name, backend in BACKENDS.items():
        model = build_model(config, dtype=torch.float32)
        if backend.before_sharding is not None:
            backend.before_sharding(model)
        budget = backend.budgets.default[0] if backend.budgets else None
        trial = _stablecode_trial(backend=name, budget=budget, distributed_mode=mode, world_size=1)
        compiled = backend.compile(model, trial, torch.device("cpu"))
        assert compiled.parameters_owner is model and callable(compiled.forward), name
        assert (compiled.executors is not None) == backend.thunder, name
        assert (compiled.memopt is not None) == name.startswith("thunder+memopt"), name
        if compiled.memopt is not None:
            offload = {"thunder+memopt-offload": "budget", "thunder+memopt-fit": "auto"}.get(name, "off")
            assert compiled.memopt.offload.value == offload, name
        if backend.compile is as_is:
            x, _ = random_batch(config, batch_size=1, seq_len=16)
            compiled.forward(x).sum().backward()
            assert all(p.grad is not None for p in model.parameters()), name


def test_trials_round_trip_and_the_committed_rows_read_back():
    """A trial's fields go to the worker and come back equal; every committed row reads back as the
    trial it measured, fields added since it was written taking the values rows had before."""
    trial = _stablecode_trial(backend="thunder+memopt", budget=0.5, memopt_passes=("recompute",), fusion="off",
                              profile=True, memory_snapshot="/tmp/snapshot.pickle")
    assert Trial.from_fields(json.loads(json.dumps(trial.fields()))) == trial
    assert "profile" not in trial.key() and "memory_snapshot" not in trial.key()
    rows = load_rows(sorted((REPOSITORY / "benchmarks" / "results").glob("*.jsonl")))
    runs = [row for row in rows if row["row_type"] == "run"]
    assert len(runs) > 100
    for row in runs:
        key = Trial.from_row(row).key()
        assert all(key[field] == (tuple(value) if field == "memopt_passes" and value else value)
                   for field, value in row.items() if field in key), row["log"]
        assert driver.same_measurement(row, {"row_type": "run", **key}) == ("fusion" in row
                                                                            or row["backend"] != "thunder+memopt")
