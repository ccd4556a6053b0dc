"""Bad options get an exception that names them, when the object is built; inference traces are
understood (no warning from MemoryOptimization). The fused loss function takes what
``torch.nn.functional.cross_entropy`` takes, with its values, and rejects what it rejects, with its
exception types. The package's public names, version and command line are what they say."""

import importlib.metadata
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import thunder
import torch
import torch.nn.functional as F

import thunder_memopt
from thunder_memopt import DeviceRates, MemoryOptimization, thunderfx_backend
from thunder_memopt.executors import linear_cross_entropy
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
        ({"prefetch": -1}, ValueError, "prefetch"),
        ({"prefetch": np.int64(-1)}, ValueError, "prefetch"),
        ({"prefetch": "2"}, TypeError, "prefetch"),
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
        ({"head_gradients": "sideways"}, ValueError, "head_gradients must be None or one of"),
        ({"head_gradients": True}, ValueError, "head_gradients must be None or one of"),
    ],
)
def test_memory_optimization_rejects_bad_options_naming_them(kwargs, error, named):
    with pytest.raises(error, match=named):
        MemoryOptimization(**kwargs)


@pytest.mark.parametrize("budget", [0.5, 1, np.float32(0.5), np.float64(0.25), np.int64(0)])
def test_any_real_budget_in_range_is_accepted(budget):
    assert MemoryOptimization(activation_budget=budget).activation_budget == float(budget)


@pytest.mark.parametrize("prefetch", [0, 3, np.int64(3), np.int32(1)])
def test_any_integral_prefetch_is_accepted(prefetch):
    from thunder_memopt.passes.collectives import CollectivesPass

    MemoryOptimization(prefetch=prefetch)
    checked = CollectivesPass(prefetch=prefetch).prefetch
    assert checked == int(prefetch) and type(checked) is int


@pytest.mark.parametrize(
    "rates, error, named",
    [
        ((0, 0, 0, 0), ValueError, "to_host"),
        ((50e9, -1.0, 1e12, 1e12), ValueError, "to_device"),
        ((50e9, 50e9, 0.0, 1e12), ValueError, "flops"),
        ((50e9, 50e9, 1e12, float("nan")), ValueError, "memory"),
        ((50e9, "fast", 1e12, 1e12), TypeError, "to_device"),
        ((True, 50e9, 1e12, 1e12), TypeError, "to_host"),
    ],
)
def test_device_rates_reject_rates_that_are_not_positive_numbers(rates, error, named):
    with pytest.raises(error, match=named) as raised:
        DeviceRates(*rates)
    assert "\n" not in str(raised.value)


def test_device_rates_take_numpy_scalars_as_floats():
    rates = DeviceRates(np.float64(50e9), np.float32(50e9), np.int64(10**12), 4e12)
    assert all(type(r) is float for r in (rates.to_host, rates.to_device, rates.flops, rates.memory))
    assert rates.flops == 1e12


@pytest.mark.parametrize(
    "args, kwargs, named",
    [
        ((0.5,), {}, "memory_optimization"),
        ((MemoryOptimization,), {}, "memory_optimization"),
        ((), {"fusion": "no"}, "fusion"),
        ((), {"cudnn_attention": 0}, "cudnn_attention"),
        ((), {"loss_head": "yes"}, "loss_head"),
        ((), {"transforms": [1]}, "transforms"),
        ((), {"transforms": MemoryOptimization()}, "transforms"),
        ((), {"executors": "foo"}, "executors"),
        ((), {"executors": ["no_such_executor"]}, "executors"),
        ((), {"bogus_option": 1}, "bogus_option"),
    ],
)
def test_thunderfx_backend_rejects_bad_arguments_when_built(args, kwargs, named):
    with pytest.raises(TypeError, match=named):
        thunderfx_backend(*args, **kwargs)


def test_thunderfx_backend_passes_thunder_options_on():
    """thunder.jit's options and Thunder's compile options reach ThunderCompiler as given."""
    from thunder.extend import get_executor

    options = {"fusion_type": "dataflow", "sharp_edges": "allow", "skip_inplace_alias_updates": True,
               "executors": ["sdpa", get_executor("torch")]}
    passed = thunderfx_backend(**options).compiler.thunder_options
    assert {name: passed[name] for name in options} == options


@pytest.mark.parametrize("model_name", ["stablecode-completion-alpha-3b", "Llama-3-8B"])
@pytest.mark.parametrize("how", ["jit", "thunderfx"])
def test_inference_forward_gives_no_warning_and_no_higher_peak(model_name, how):
    """Under no_grad the forward is an inference trace: the schedule pass reads it (torch-level ops
    of a prim's name included) without falling back, and never raises its estimated peak."""
    cfg = narrow_config(model_name, n_layer=1, n_embd=256, block_size=64)  # checked alike at any depth
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
        (["--n-layer", "0"], "--n-layer"),
        # Mixture of experts: thunder.jit (the report's) cannot trace it; ThunderCompiler can.
        (["--model-name", "Mixtral-8x7B-v0.1"], "--model-name Mixtral-8x7B-v0.1 is a mixture-of-experts model"),
        (["--model-name", "Qwen3-30B-A3B"], "ThunderCompiler"),
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
        (["--memopt-head-gradients", "sideways"], "--memopt-head-gradients"),
        (["--compile", "thunder+nothing"], "--compile"),
        (["--offload-keep", "2"], "--offload-keep"),
        (["--compile", "inductor", "--offload-keep", "0.5"], "--offload-keep applies to thunder+memopt-offload"),
        (["--simulate-world-size", "1"], "--simulate-world-size must be at least 2"),
        (["--simulate-world-size", "0"], "--simulate-world-size"),
        (["--bus-bandwidth", "100"], "--bus-bandwidth sets the modelled step of --simulate-world-size"),
        (["--bus-bandwidth", "0", "--simulate-world-size", "8"], "--bus-bandwidth"),
        (["--head-unit", "own", "--distributed-mode", "none"], "--head-unit own places FSDP2's units"),
        (["--head-unit", "loss", "--loss-mode", "litgpt"], "--head-unit loss makes the head and the in-graph loss"),
        (["--trial-timeout", "-5"], "--trial-timeout"),
        (["--loss-rtol", "-1"], "--loss-rtol"),
        (["--time-limit", "0"], "--time-limit"),
        (["--simulate-world-size", "8", "--nproc-per-node", "2"], "--simulate-world-size runs one process"),
        (["--simulate-world-size", "8", "--distributed-mode", "none"], "use it with --distributed-mode fsdp2"),
    ],
)
def test_benchmark_flags_with_bad_values_fail_before_any_process_starts(argv, named, capsys):
    from benchmarks.fsdp2.cli import parse_args

    assert named in _one_line_usage_error(parse_args, argv, capsys)


# The fused loss function against torch.nn.functional.cross_entropy of the linear's fp32 logits.
VOCAB, WIDTH, TOKENS = 50, 8, 16


def _head(tokens: int = TOKENS):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, WIDTH, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, WIDTH, generator=g, requires_grad=True)
    return hidden, weight, torch.randint(0, VOCAB, (tokens,), generator=g)


def _cross_entropy(hidden, weight, targets, *, softcap=None, ignore_index=-100, reduction="mean", **_):
    logits = F.linear(hidden, weight).float()
    if softcap is not None and math.isfinite(softcap):
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)


def _all_ignored(hidden, targets):
    return hidden, torch.full_like(targets, -100)


def _empty(hidden, targets):
    return hidden[:0], targets[:0]


def _unchanged(hidden, targets):
    return hidden, targets


@pytest.mark.parametrize("gradients_in_forward", [False, True])
@pytest.mark.parametrize(
    "inputs, options",
    [
        (_all_ignored, {}),  # mean: NaN loss, zero gradients
        (_all_ignored, {"reduction": "sum"}),
        (_empty, {}),  # NaN
        (_empty, {"reduction": "sum"}),  # 0
        (_unchanged, {"softcap": float("inf")}),  # no cap
        (_unchanged, {"softcap": np.float32(30)}),
        (_unchanged, {"chunk_size": np.int64(4)}),
        (_unchanged, {"ignore_index": np.int64(3)}),
    ],
)
def test_loss_function_gives_cross_entropys_values(inputs, options, gradients_in_forward):
    hidden, weight, targets = _head()
    used, targets = inputs(hidden, targets)
    expected = _cross_entropy(used, weight, targets, **options)
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    got = linear_cross_entropy(used, weight, targets, gradients_in_forward=gradients_in_forward, **options)
    got_grads = torch.autograd.grad(got, [hidden, weight])
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, expected_grads):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "targets",
    [
        torch.full((TOKENS,), VOCAB),  # IndexError: Target 50 is out of bounds.
        torch.full((TOKENS,), -3),
        torch.ones(TOKENS, dtype=torch.bool),  # RuntimeError
        torch.ones(TOKENS),
    ],
    ids=["above", "negative", "bool", "float"],
)
def test_loss_function_rejects_cross_entropys_bad_targets_with_its_exception(targets):
    hidden, weight, _ = _head()
    with pytest.raises(Exception) as expected:
        _cross_entropy(hidden, weight, targets)
    for gradients_in_forward in (False, True):
        with pytest.raises(type(expected.value)) as got:
            linear_cross_entropy(hidden, weight, targets, gradients_in_forward=gradients_in_forward)
        assert "\n" not in str(got.value)
        if isinstance(expected.value, IndexError):
            assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "options, error, named",
    [
        ({"softcap": float("nan")}, ValueError, "softcap"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"softcap": "30"}, TypeError, "softcap"),
        ({"softcap": True}, TypeError, "softcap"),
        ({"chunk_size": 1.5}, TypeError, "chunk_size"),
        ({"chunk_size": True}, TypeError, "chunk_size"),
        ({"chunk_size": np.int64(-4)}, ValueError, "chunk_size"),
        ({"ignore_index": np.float32(1)}, TypeError, "ignore_index"),
    ],
)
def test_loss_function_rejects_bad_options_naming_them(options, error, named):
    hidden, weight, targets = _head()
    with pytest.raises(error, match=named) as raised:
        linear_cross_entropy(hidden, weight, targets, **options)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("gradients_in_forward", [False, True])
def test_loss_function_accumulates_over_a_retained_graph_like_cross_entropy(gradients_in_forward):
    def twice(loss_of):
        hidden, weight, targets = _head()
        loss = loss_of(hidden, weight, targets)
        loss.backward(retain_graph=True)
        loss.backward()
        return hidden.grad, weight.grad

    expected = twice(_cross_entropy)
    got = twice(lambda h, w, t: linear_cross_entropy(h, w, t, gradients_in_forward=gradients_in_forward))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gradients_in_forward", [False, True])
def test_loss_function_double_backward_is_a_one_line_error(gradients_in_forward):
    hidden, weight, targets = _head()
    loss = linear_cross_entropy(hidden, weight, targets, gradients_in_forward=gradients_in_forward)
    message = r"^linear_cross_entropy: double backward \(create_graph=True\) is not supported$"
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(loss, hidden, create_graph=True)


# The package: its public names, its version and its command line.
def test_executors_is_callable_and_keeps_the_packages_attributes():
    from thunder_memopt.executors import chunked_cross_entropy, executors, fusion

    package = thunder_memopt.executors
    assert package.linear_cross_entropy is chunked_cross_entropy.linear_cross_entropy
    assert package.compile_stats is fusion.compile_stats
    assert package.fusion_ex.name == "memopt_fusion"
    assert package() == executors() and package(fusion=False) == executors(fusion=False)


@pytest.mark.parametrize("module", ["thunder_memopt", "thunder_memopt.executors", "thunder_memopt.core", "thunder_memopt.passes"])
def test_every_public_name_is_defined(module):
    public = sys.modules[module].__all__
    assert public and all(hasattr(sys.modules[module], name) for name in public)


def test_the_version_is_pyprojects():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert thunder_memopt.__version__ == pyproject["project"]["version"] == importlib.metadata.version("thunder-memopt")
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["thunder_memopt"]
    assert (Path(thunder_memopt.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("argv", [["reprot"], [], ["--bogus", "report"]])
def test_command_line_mistakes_are_usage_errors(argv, capsys):
    from thunder_memopt.__main__ import main

    _one_line_usage_error(main, argv, capsys)


def test_command_line_prints_its_version(capsys):
    from thunder_memopt.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"thunder_memopt {thunder_memopt.__version__}"


def test_report_measures_memory_optimization_on_the_recommended_executors(monkeypatch, capsys):
    """Plain Thunder on Thunder's executors; MemoryOptimization on thunder_memopt.executors()."""
    from thunder_memopt import report

    measured = {}

    def measure_column(name, args, transforms_factory, executor_list=None):
        measured[name] = executor_list
        return name

    monkeypatch.setattr(report, "measure_column", measure_column)
    monkeypatch.setattr(report, "format_report", lambda args, columns: "")
    report.main(["--train-steps", "0"])
    plain, optimized = measured.values()
    assert plain is None and optimized == thunder_memopt.executors()
