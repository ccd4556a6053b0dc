"""CPU test of the long-run check (benchmarks/long_run.py, benchmarks/fsdp2/long_run*.py), end to end:
a few steps of the narrowed stablecode (n_embd 128, one layer, T=128) on the standard library's
bytes, each setting in its own process (FSDP2, one rank, gloo), as on the GPU. (What is checked holds
for any depth; one layer halves the compilation of the two thunder settings.)

The settings: eager and thunder+memopt at budget 0, eager started one rounding step of one weight
away (the control whose distance from eager is the noise floor of the tail loss), and two pairs for
the bit-identity check.

- thunder+memopt-offload @0 against thunder+memopt @0 must be identical here. On CPU offload is off
  (``stages.OffloadStage``: no pinned host memory to copy to, so it warns and leaves the traces
  as they are unless ``offload_rates`` is given, which the benchmark's registry does not do), and
  at budget 0 both loss heads recompute their logits in the backward (the transform's rule). So
  the two run the same traces, and the check must say so, bit for bit at every step, and find
  that they save the same tensors for backward. (On a GPU the same pair runs offload for real.)
- eager against eager with seed 1 (other weights, another order of batches) must differ, from the
  first step on.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
LONG_RUN = REPOSITORY / "benchmarks" / "long_run.py"
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import long_run, long_run_driver  # noqa: E402
from benchmarks.fsdp2.trial import load_rows  # noqa: E402

STEPS = 4
N_LAYER = 1
OFFLOAD, TWIN = "thunder+memopt-offload@0", "thunder+memopt@0"
SETTINGS = ("eager", "eager:perturb=1", "eager:seed=1", TWIN, OFFLOAD)
LABELS = ("eager", "eager [perturb=1]", "eager [seed=1]", "thunder+memopt @0", "thunder+memopt-offload @0")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict], Path]:
    work = tmp_path_factory.mktemp("long_run")
    out = work / "long_run.jsonl"
    command = [sys.executable, str(LONG_RUN), "--n-layer", str(N_LAYER), "--steps", str(STEPS), "--warmup-steps", "1",
               "--lr", "3e-3", "--progress-every", "2", "--settings", *SETTINGS, "--identical", OFFLOAD, TWIN,
               "--identical", "eager", "eager:seed=1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=work, timeout=TIMEOUT_S)
    return done, load_rows([out]), out


def rows_of(rows: list[dict], row_type: str) -> list[dict]:
    return [row for row in rows if row["row_type"] == row_type]


def test_every_setting_trains_every_step_to_finite_losses(finished):
    done, rows, _ = finished
    runs = rows_of(rows, long_run_driver.RUN_ROW)
    assert [run["setting"] for run in runs] == list(LABELS), done.stdout[-3000:] + done.stderr[-3000:]
    assert all(run["status"] == "ok" for run in runs), [run.get("error") for run in runs]
    for run in runs:
        steps = [row for row in rows_of(rows, long_run_driver.STEP_ROW) if row["run_id"] == run["run_id"]]
        assert [row["step"] for row in steps] == list(range(STEPS)), run["setting"]
        assert all(math.isfinite(row["loss"]) and math.isfinite(row["params_norm"]) for row in steps)
        # Clipped to norm 1 by default: each step records its gradients' norm before the clipping.
        assert run["max_grad_norm"] == 1.0 and all(row["grad_norm"] > 0 for row in steps), run["setting"]
        # The byte vocabulary, padded by litgpt's rule (a multiple of padding_multiple, 512).
        assert (run["vocab_size"], run["padded_vocab_size"]) == (256, 512)
        assert run["corpus_files"] > 100 and run["plan_saved_bytes"] > 0 and run["n_layer"] == N_LAYER
    # One warm-up step at half the rate, the peak, then the cosine's decay.
    rates = [row["lr"] for row in rows_of(rows, long_run_driver.STEP_ROW) if row["setting"] == "eager"]
    assert rates[:2] == [pytest.approx(1.5e-3), pytest.approx(3e-3)] and rates[1] > rates[2] > rates[3]


def test_the_offload_twin_is_reported_bit_identical(finished):
    done, rows, _ = finished
    (summary,) = rows_of(rows, long_run_driver.SUMMARY_ROW)
    pair = next(pair for pair in summary["pairs"] if pair["first"] == "thunder+memopt-offload @0")
    assert pair["second"] == "thunder+memopt @0"
    assert pair["same_plan"] is True and pair["identical"] is True and pair["compared_steps"] == STEPS
    assert pair["differences"] == {"loss": None, "params_norm": None}
    # Why they are equal here: the offload setting ran without offload, and said so.
    (offload_run,) = [run for run in rows_of(rows, long_run_driver.RUN_ROW) if run["backend"] == "thunder+memopt-offload"]
    assert any("offload is off on CPU" in warning for warning in offload_run["memopt_warnings"])
    assert "thunder+memopt-offload @0 against thunder+memopt @0: identical at all 4 steps" in done.stdout


def test_a_different_seed_is_reported_as_differing_from_the_first_step(finished):
    done, rows, out = finished
    (summary,) = rows_of(rows, long_run_driver.SUMMARY_ROW)
    pair = next(pair for pair in summary["pairs"] if pair["first"] == "eager")
    assert pair["identical"] is False and pair["passed"] is False
    assert pair["differences"]["loss"][0] == 0
    assert summary["passed"] is False and done.returncode == 5  # a check failed: this pair
    assert "eager against eager [seed=1]: DIFFER; loss first differs at step 0" in done.stdout
    assert "Verdict: FAILED" in out.with_suffix(".md").read_text()


def test_the_curves_are_compared_with_eager_and_plotted(finished):
    done, rows, out = finished
    (summary,) = rows_of(rows, long_run_driver.SUMMARY_ROW)
    by_label = {check["label"]: check for check in summary["settings"]}
    assert summary["reference"] == "eager" and summary["tail_steps"] == STEPS
    assert by_label["eager"]["relative_difference"] is None
    assert by_label["thunder+memopt @0"]["relative_difference"] is not None
    assert all(not check["nonfinite_steps"] for check in summary["settings"])
    assert "thunder+memopt @0: step 2/4, loss " in done.stdout  # the progress lines
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_perturbed_control_starts_one_rounding_step_away_and_sets_the_noise_floor(finished):
    import torch

    done, rows, out = finished
    runs = {run["setting"]: run for run in rows_of(rows, long_run_driver.RUN_ROW)}
    control = runs["eager [perturb=1]"]
    assert control["perturbed_parameter"] == long_run.PERTURBED_PARAMETER and "perturbed_index" not in runs["eager"]
    before, after = (torch.tensor(control[f"perturbed_{name}"], dtype=torch.bfloat16) for name in ("before", "after"))
    assert after.item() == torch.nextafter(before, before.sign() * torch.inf).item() != before.item()
    # The noise floor is the control's distance from eager; the tolerance max(1%, 1.5 x it).
    (summary,) = rows_of(rows, long_run_driver.SUMMARY_ROW)
    by_label = {check["label"]: check for check in summary["settings"]}
    tails = {label: math.fsum(row["loss"] for row in rows_of(rows, long_run_driver.STEP_ROW)
                              if row["setting"] == label) / STEPS for label in ("eager", "eager [perturb=1]")}
    noise = abs(tails["eager [perturb=1]"] - tails["eager"]) / tails["eager"]
    assert summary["control"] == "eager [perturb=1]" and summary["noise_floor"] == pytest.approx(noise, rel=1e-9)
    assert by_label["eager [perturb=1]"]["relative_difference"] == summary["noise_floor"]
    assert summary["loss_tolerance"] == max(0.01, 1.5 * summary["noise_floor"])
    assert f"ends {noise:.3%} from eager" in out.with_suffix(".md").read_text()


def test_perturb_one_weight_moves_exactly_one_weight_by_one_rounding_step():
    import torch

    from thunder_memopt.models import build_model, narrow_config

    config = long_run.with_byte_vocabulary(narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=64,
                                                         block_size=32))
    built, perturbed = (build_model(config, dtype=torch.bfloat16, seed=0) for _ in range(2))
    moved = long_run.perturb_one_weight(perturbed, seed=1)
    changed = {name: (parameter != built.get_parameter(name)).nonzero().tolist()
               for name, parameter in perturbed.named_parameters()}
    assert {name: where for name, where in changed.items() if where} == {
        long_run.PERTURBED_PARAMETER: [list(divmod(moved.index, config.n_embd))]}
    old = built.get_parameter(moved.parameter).view(-1)[moved.index]
    new = perturbed.get_parameter(moved.parameter).view(-1)[moved.index]
    assert (old.item(), new.item()) == (moved.before, moved.after)
    # Adjacent bf16 values (their bit patterns one apart), the larger in magnitude the new one.
    assert abs(int(new.view(torch.int16)) - int(old.view(torch.int16))) == 1 and abs(moved.after) > abs(moved.before)


def _run_and_steps(label: str, tail_losses: list[float], status: str = "ok") -> tuple[dict, list[dict]]:
    return {"setting": label, "status": status}, [
        {"step": step, "loss": loss, "params_norm": 1.0} for step, loss in enumerate(tail_losses)]


@pytest.mark.parametrize("control_loss, tolerance, passing", [
    (2.02, 0.015, {"eager", "control", "close", "near"}),  # noise 1%: within 1.5%
    (2.002, 0.01, {"eager", "control", "close"}),  # noise 0.1%: 1% is the least tolerance
    (None, 0.01, {"eager", "close"}),  # the control did not finish: 1%, and it fails
])
def test_the_tail_loss_passes_within_the_larger_of_one_percent_and_1_5_times_the_noise_floor(
        control_loss, tolerance, passing):
    from benchmarks.fsdp2 import long_run_report

    settings = {"eager": [9.0, 2.0, 2.0], "close": [9.0, 2.018, 2.018], "near": [9.0, 2.028, 2.028],
                "far": [9.0, 2.04, 2.04], "nan": [9.0, math.nan, 2.0]}
    if control_loss is not None:
        settings["control"] = [9.0, control_loss, control_loss]
    rows = [_run_and_steps(label, losses) for label, losses in settings.items()]
    if control_loss is None:
        rows.append(_run_and_steps("control", [9.0, 2.0], status="timeout"))
    runs, steps = [run for run, _ in rows], {run["setting"]: rows for run, rows in rows}
    verdict = long_run_report.analyse(runs, steps, [], reference="eager", expected_steps=3, tail=2, rtol=0.01,
                                      control="control", noise_factor=1.5)
    assert verdict.tolerance == pytest.approx(tolerance)
    assert verdict.noise_floor == (None if control_loss is None else pytest.approx(abs(control_loss / 2.0 - 1)))
    assert {check.label for check in verdict.settings if check.passed} == passing and not verdict.passed
    text = long_run_report.markdown(verdict)
    assert f"within {tolerance:.3%}" in text and ("Noise floor: control" in text) == (control_loss is not None)
    assert "- NaN or inf: in nan (steps 1)" in text and "- Bit-identical pairs: 0 of 0" in text
    assert long_run_report.loss_tolerance(0.01, 1.5, None) == 0.01


def test_make_table_over_a_glob_with_the_long_runs_file_tables_only_the_benchmarks_rows(finished, capsys):
    from benchmarks.fsdp2 import tables_cli

    benchmark_rows = REPOSITORY / "benchmarks" / "results" / "hf_qwen2_5_7b_4l_zero2_1xH200_T8192.jsonl"
    tables_cli.main([str(finished[2]), str(benchmark_rows)])
    table = capsys.readouterr().out
    assert "Qwen2.5-7B" in table and "| 8192 | thunder+memopt @1 | ok |" in table
    assert "long_run" not in table and "eager [seed=1]" not in table


def test_the_gradients_are_clipped_before_each_step_and_their_norms_recorded():
    import torch

    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    norms = long_run.clip_gradients_before_each_step(optimizer, [weight], max_norm=1.0)
    for grad in ([3.0, 4.0, 0.0], [0.3, 0.4, 0.0]):
        before = weight.detach().clone()
        weight.grad = torch.tensor(grad)
        optimizer.step()
        step = (before - weight.detach()).norm().item()
        assert step == pytest.approx(min(1.0, norms[-1]), rel=1e-5)
    assert norms == [pytest.approx(5.0), pytest.approx(0.5)]


def test_batches_are_the_same_for_one_seed_and_differ_for_another():
    corpus = long_run.Corpus.read()
    assert corpus.files == len(long_run.stdlib_sources()) and len(corpus.data) > 10**6
    batches = {seed: long_run.ByteBatches(corpus.data, seq_len=64, micro_batch=2, world_size=2, rank=1, seed=seed)
               for seed in (0, 1)}
    again = long_run.ByteBatches(corpus.data, seq_len=64, micro_batch=2, world_size=2, rank=1, seed=0)
    input_ids, targets = batches[0].batch(3, "cpu")
    assert input_ids.shape == targets.shape == (2, 64) and int(input_ids.max()) < 256
    assert input_ids[:, 1:].equal(targets[:, :-1])  # next-byte targets
    assert input_ids.equal(again.batch(3, "cpu")[0])
    assert not input_ids.equal(batches[1].batch(3, "cpu")[0])
    rank0 = long_run.ByteBatches(corpus.data, seq_len=64, micro_batch=2, world_size=2, rank=0, seed=0)
    assert not input_ids.equal(rank0.batch(3, "cpu")[0])  # each rank its own windows


def _cli():
    spec = importlib.util.spec_from_file_location("long_run_cli", LONG_RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--settings", "nope"], "unknown backend 'nope'"),
    (["--settings", "eager@0.5"], "eager has no budget"),
    (["--settings", "thunder+memopt@2"], "the budget must be in [0, 1]"),
    (["--settings", "eager:fusion=off"], "fusion is not an option of eager"),
    (["--settings", "eager:colour=red"], "'colour=red' is not FIELD=VALUE"),
    (["--settings", "eager:seed=x"], "seed"),
    (["--settings", "eager:perturb=x"], "perturb=x (a seed: a non-negative integer)"),
    (["--settings", "eager", "eager"], "lists a setting twice"),
    (["--settings", "eager", "--identical", "eager", "inductor"], "--identical names inductor"),
    (["--steps", "0"], "must be at least 1"),
    (["--max-grad-norm", "-1"], "must be at least 0"),
    (["--steps", "10", "--warmup-steps", "10"], "leaves none of --steps 10"),
    (["--steps", "10", "--tail-steps", "11"], "--tail-steps 11 exceeds --steps 10"),
])
def test_bad_flags_are_one_line_usage_errors(argv, message, capsys):
    cli = _cli()
    with pytest.raises(SystemExit) as exit_info:
        args, parser = cli.parse_args(argv)
        cli.resolve_defaults(args, parser, cuda=False)
    assert exit_info.value.code == 2
    printed = capsys.readouterr().err
    error = printed.strip().splitlines()[-1]
    assert error.startswith("long_run.py: error: ") and message in error, error
    assert "Traceback" not in printed
