"""Bad options get an exception that names them, when the object is built; inference traces are
understood (no warning from MemoryOptimization)."""

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import thunder
import torch

from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.models import build_model, narrow_config, random_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.fsdp2


@pytest.mark.parametrize(
    "kwargs, error, named",
    [
        ({"activation_budget": 1.5}, ValueError, "activation_budget"),
        ({"activation_budget": -0.1}, ValueError, "activation_budget"),
        ({"activation_budget": "high"}, TypeError, "activation_budget"),
        ({"activation_budget": True}, TypeError, "activation_budget"),
        ({"activation_budget": None}, TypeError, "activation_budget"),
        ({"passes": None}, TypeError, "passes"),
        ({"passes": "recompute"}, TypeError, "passes"),
        ({"passes": ("recompute", "fuse_everything")}, ValueError, "pass names"),
        ({"prefetch": -1}, TypeError, "prefetch"),
        ({"prefetch": 1.5}, TypeError, "prefetch"),
        ({"prefetch": True}, TypeError, "prefetch"),
        ({"zero3": "no"}, TypeError, "zero3"),
        ({"zero3": 1}, TypeError, "zero3"),
        ({"fuse_replays": True}, TypeError, "fuse_replays"),
        ({"offload": "sometimes"}, ValueError, "offload"),
        ({"offload": True}, ValueError, "offload"),
        ({"offload_rates": 50e9}, TypeError, "offload_rates"),
        ({"offload": "budget", "offload_budget": 1.5}, ValueError, "offload_budget"),
        ({"offload": "budget", "offload_budget": "half"}, TypeError, "offload_budget"),
        ({"offload": "auto", "offload_budget": 0.5}, ValueError, "offload_budget applies to offload='budget'"),
        ({"offload_budget": 0.5}, ValueError, "offload_budget applies to offload='budget'"),
    ],
)
def test_memory_optimization_rejects_bad_options_naming_them(kwargs, error, named):
    with pytest.raises(error, match=named):
        MemoryOptimization(**kwargs)


@pytest.mark.parametrize("budget", [0.5, 1, np.float32(0.5), np.float64(0.25), np.int64(0)])
def test_any_real_budget_in_range_is_accepted(budget):
    assert MemoryOptimization(activation_budget=budget).activation_budget == float(budget)


@pytest.mark.parametrize(
    "args, kwargs, named",
    [
        ((0.5,), {}, "memory_optimization"),
        ((MemoryOptimization,), {}, "memory_optimization"),
        ((), {"fusion": "no"}, "fusion"),
        ((), {"cudnn_attention": 0}, "cudnn_attention"),
        ((), {"loss_head": "yes"}, "loss_head"),
    ],
)
def test_thunderfx_backend_rejects_bad_arguments_when_built(args, kwargs, named):
    with pytest.raises(TypeError, match=named):
        thunderfx_backend(*args, **kwargs)


@pytest.mark.parametrize("model_name", ["stablecode-completion-alpha-3b", "Llama-3-8B"])
@pytest.mark.parametrize("how", ["jit", "thunderfx"])
def test_inference_forward_gives_no_warning_and_no_higher_peak(model_name, how):
    """Under no_grad the forward is an inference trace: the schedule pass reads it (torch-level ops
    of a prim's name included) without falling back, and never raises its estimated peak."""
    cfg = narrow_config(model_name, n_layer=2, n_embd=256, block_size=64)
    model = build_model(cfg).eval()
    x, _ = random_batch(cfg, batch_size=1, seq_len=64)
    mo = MemoryOptimization()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="thunder_memopt")
        compiled = thunder.jit(model, transforms=[mo]) if how == "jit" else torch.compile(model, backend=thunderfx_backend(mo))
        with torch.no_grad():
            compiled(x)
    assert mo.schedule_results
    assert all(r.peak_after <= r.peak_before for r in mo.schedule_results)


def _one_line_usage_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert "error: argument" in message or "error:" in message
    return message


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--model-name", "NoSuchModel"], "--model-name"),
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "-5"], "--block-size"),
        (["--device", "foo"], "--device"),
        (["--n-embd", "100"], "--n-embd"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
        (["--train-steps", "-1"], "--train-steps"),
        (["--top", "-1"], "--top"),
        (["--budget", "1.5"], "--budget"),
        (["--n-layer", "1"], "--n-layer"),
    ],
)
def test_report_flags_with_bad_values_are_one_line_errors(argv, named, capsys):
    from thunder_memopt.report import parse_args

    assert named in _one_line_usage_error(parse_args, argv, capsys)


def test_an_unknown_model_name_suggests_close_names(capsys):
    from thunder_memopt.report import parse_args

    message = _one_line_usage_error(parse_args, ["--model-name", "stablecode-alpha-3b"], capsys)
    assert "did you mean" in message and "stablecode-instruct-alpha-3b" in message


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--memopt-budget", "1.5"], "--memopt-budget"),
        (["--inductor-budget", "-1"], "--inductor-budget"),
        (["--memopt-passes", "foo"], "--memopt-passes"),
        (["--block-size", "-5"], "--block-size"),
        (["--model-name", "NoSuchModel"], "--model-name"),
        (["--n-embd", "100"], "--n-embd"),
        (["--n-layer", "0"], "--n-layer"),
        (["--warmup", "0"], "--warmup"),
        (["--fusion", "maybe"], "--fusion"),
        (["--compile", "thunder+nothing"], "--compile"),
        (["--offload-keep", "2"], "--offload-keep"),
        (["--compile", "inductor", "--offload-keep", "0.5"], "--offload-keep applies to thunder+memopt-offload"),
    ],
)
def test_benchmark_flags_with_bad_values_fail_before_any_process_starts(argv, named, capsys):
    from benchmarks.fsdp2.cli import parse_args

    assert named in _one_line_usage_error(parse_args, argv, capsys)
