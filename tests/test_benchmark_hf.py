"""CPU tests of benchmarks/benchmark_fsdp2.py on transformers models (``--model-source transformers``,
benchmarks/fsdp2/hf_models.py).

A narrowed transformers Llama (1 layer, hidden 64, T=32) goes end to end through the benchmark,
each row in its own torchrun as on the GPU host: eager and thunder+memopt under FSDP2 on one gloo
rank, thunder+memopt with the whole model compiled (``--distributed-mode none``). The rows must say
which model code ran, the backends' losses agree, and thunder+memopt's ``thunderfx`` field shows
what ThunderFX made of the step: the loss head fused, and attention without a mask where the
causal_mask pass can see how the mask was made (on CPU cuDNN claims nothing, so no row shows its
kernel). The registry's families build and train eagerly, every backend wires up, and flags a
transformers model does not take are one-line errors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from benchmarks.fsdp2 import backends, cli, hf_models, worker  # noqa: E402
from benchmarks.fsdp2.trial import (Compilation, Measurement, Numerics, Sharding, Trial,  # noqa: E402
                                    Workload, load_rows)

pytest.importorskip("transformers")

TINY = ["--model-source", "transformers", "--model-name", "Llama-3-8B", "--n-layer", "1", "--n-embd", "64",
        "--block-size", "32", "--warmup", "1", "--iters", "1", "--plot", "none"]
BF16_LOSS_RTOL = 0.02
RUN_TIMEOUT_S = 300
# The fused loss head of a transformers model, which returns its logits too, at budget 1.0 (tests/test_loss_head.py).
FUSED_HEAD = "memopt_linear_cross_entropy_forward_and_logits_with_gradients"


def run_benchmark(work: Path, *options: str) -> tuple[list[dict], str]:
    """The rows and the printed output of one CPU run of the tiny transformers Llama."""
    out = work / "rows.jsonl"
    command = [sys.executable, str(REPOSITORY / "benchmarks" / "benchmark_fsdp2.py"), *TINY, *options,
               "--out", str(out)]
    finished = subprocess.run(command, capture_output=True, text=True, cwd=work, timeout=RUN_TIMEOUT_S)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    return load_rows([out]), finished.stdout


def check_rows_of_the_tiny_llama(rows: list[dict], mode: str, backend_names: list[str]) -> None:
    assert [row["backend"] for row in rows] == backend_names
    for row in rows:
        assert row["status"] == "ok", row.get("error")
        assert (row["model_source"], row["model"], row["n_layer"], row["n_embd"], row["vocab_size"]) == (
            "transformers", "Llama-3-8B", 1, 64, hf_models.NARROW_VOCAB_SIZE)
        assert (row["distributed_mode"], row["world_size"], row["block_size"]) == (mode, 1, 32)
        assert row["transformers"] and row["saved_bytes_per_layer"] > 0


def test_fsdp2_rows_agree_and_the_mask_reaches_each_decoder_layer_as_an_input(tmp_path):
    """Under FSDP2 each decoder layer is a dynamo graph of its own (FSDP2's hooks break the graph at
    every unit), and transformers makes the causal mask once, before the layers: each layer's graph
    gets it as an input, marked causal where it was made, so its attention is_causal. The head and the
    loss, in the root's unit, are one graph, and the head fuses."""
    rows, printed = run_benchmark(tmp_path, "--compile", "eager", "thunder+memopt")
    check_rows_of_the_tiny_llama(rows, "fsdp2", ["eager", "thunder+memopt"])
    eager, memopt = rows
    assert memopt["loss"] == pytest.approx(eager["loss"], rel=BF16_LOSS_RTOL)
    assert "WARNING" not in printed
    assert "#### transformers Llama-3-8B, 1 layers, n_embd 64" in printed
    thunderfx = memopt["thunderfx"]
    assert thunderfx["graphs"] > 2 and not thunderfx["split_reasons"]
    assert thunderfx["attentions"] == {"is_causal": 1, "window": 0, "mask": 0, "neither": 0}
    assert FUSED_HEAD in thunderfx["symbols"]


def test_whole_model_rows_prove_the_mask_causal_and_fuse_the_head(tmp_path):
    """With the whole model compiled (one device) the step is one dynamo graph and one Thunder
    region, the mask made in it: the causal_mask pass proves it causal (``is_causal``, no mask), and
    the head fuses. The loss is eager's, the same trial's steps in this process, within bf16 rounding."""
    import torch

    rows, _ = run_benchmark(tmp_path, "--distributed-mode", "none", "--compile", "thunder+memopt")
    check_rows_of_the_tiny_llama(rows, "none", ["thunder+memopt"])
    eager = Trial.from_row(rows[0]).replace(backend="eager", budget=None)
    reference = worker.TrainingSession(eager, torch.device("cpu"), rank=0).run_steps()
    assert rows[0]["loss"] == pytest.approx(reference["loss"], rel=BF16_LOSS_RTOL)
    thunderfx = rows[0]["thunderfx"]
    assert (thunderfx["graphs"], thunderfx["regions"], thunderfx["split_reasons"]) == (1, 1, [])
    assert thunderfx["attentions"] == {"is_causal": 1, "window": 0, "mask": 0, "neither": 0}
    assert FUSED_HEAD in thunderfx["symbols"]
    assert rows[0]["executors"][:2] == ["memopt_linear_cross_entropy", "memopt_cudnn_attention"]


def _tiny_trial(model: str = "Llama-3-8B", **fields) -> Trial:
    trial = Trial(Workload(model=model, n_layer=2, n_embd=64, narrowed=True, block_size=16, micro_batch_size=1,
                           seed=0, model_source="transformers"),
                  Numerics(dtype="float32"), Sharding(distributed_mode="none", shard_mode="zero2", world_size=1),
                  Compilation(backend="eager"), Measurement(warmup=1, iters=1))
    return trial.replace(**fields)


@pytest.mark.parametrize("model", list(hf_models.MODELS))
def test_each_family_builds_narrowed_and_trains_from_its_labels(model):
    """Each registry entry's config class and model class, narrowed: the layers FSDP2 shards, the
    model's own loss from labels, and gradients for every parameter."""
    import torch

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config, built = worker.build_trial_model(_tiny_trial(model), torch.device("cpu"))
    assert type(built).__name__ == MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_models.MODELS[model].model_type]
    assert (config.hidden_size, config.num_attention_heads, config.vocab_size) == (64, 1, hf_models.NARROW_VOCAB_SIZE)
    assert getattr(config, "head_dim", 64) == 64
    assert (config.num_hidden_layers, len(hf_models.decoder_layers(built))) == (2, 2)
    assert config.use_cache is False and config._attn_implementation == "sdpa"
    x = torch.randint(0, config.vocab_size, (1, 16))
    loss = hf_models.loss_from_labels(built)(x, None)
    loss.backward()
    assert 0 < loss.item() < 10 and all(p.grad is not None for p in built.parameters())


def test_the_registry_states_the_released_widths():
    """Llama-3-8B's and Qwen2.5-7B's widths as their configs state them, and the narrowing keeps
    the ratio of query to key/value heads and the MLP's expansion."""
    llama = hf_models.config("Llama-3-8B", n_layer=4, n_embd=None, block_size=8192)
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.vocab_size, llama.rope_parameters["rope_theta"]) == (4096, 14336, 32, 8, 128256, 500000.0)
    qwen = hf_models.width("Qwen2.5-7B", None)
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.vocab_size) == (3584, 18944, 28, 4, 152064)
    assert hf_models.width("Llama-3-8B", 512) == hf_models.Width(512, 1792, 8, 2, hf_models.NARROW_VOCAB_SIZE)


def test_the_new_registry_entries_state_their_released_configs():
    """Qwen3-8B, Gemma-2-2B and Granite-3-8B as their hub configs state them: the fields that make
    their heads and attention differ from Llama's."""
    qwen3 = hf_models.config("Qwen3-8B", n_layer=4, n_embd=None, block_size=8192)
    assert (type(qwen3).__name__, qwen3.hidden_size, qwen3.head_dim, qwen3.num_key_value_heads, qwen3.vocab_size,
            qwen3.tie_word_embeddings) == ("Qwen3Config", 4096, 128, 8, 151936, False)
    gemma = hf_models.config("Gemma-2-2B", n_layer=4, n_embd=None, block_size=8192)
    assert (gemma.hidden_size, gemma.head_dim, gemma.vocab_size, gemma.sliding_window, gemma.final_logit_softcapping,
            gemma.tie_word_embeddings, gemma.layer_types) == (
        2304, 256, 256000, 4096, 30.0, True, ["sliding_attention", "full_attention"] * 2)
    granite = hf_models.config("Granite-3-8B", n_layer=4, n_embd=None, block_size=8192)
    assert (granite.vocab_size, granite.logits_scaling, granite.tie_word_embeddings) == (49155, 16.0, True)


@pytest.mark.parametrize("name", ["gemma2", "Gemma2Config", "gpt2"])
def test_a_model_type_or_config_class_trains_at_its_default_width_narrowed(name, capsys):
    """Any causal-LM model type of transformers, or its config class, is a model name: its config
    class's defaults, narrowed as the registry's models are (an explicit head size follows)."""
    import torch

    args, _ = cli.parse_args(["--model-source", "transformers", "--model-name", name])
    assert args.model_name == name
    assert hf_models.width(name, None).hidden_size == {"gemma2": 2304, "Gemma2Config": 2304, "gpt2": 768}[name]
    config, built = worker.build_trial_model(_tiny_trial(name), torch.device("cpu"))
    assert (config.hidden_size, config.num_attention_heads, getattr(config, "head_dim", 64)) == (64, 1, 64)
    assert len(hf_models.decoder_layers(built)) == 2
    hf_models.loss_from_labels(built)(torch.randint(0, config.vocab_size, (1, 16)), None).backward()


@pytest.mark.parametrize("mode", ["none", "fsdp2"])
def test_every_backend_wires_a_transformers_model(mode):
    """Every backend of the registry takes a transformers model (what compiles compiles at its first
    call; the runs above take eager and thunder+memopt through whole steps): the thunder backends
    under ThunderFX in both modes, and eager-ac checkpoints each decoder layer."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for name, backend in backends.BACKENDS.items():
        budget = backend.budgets.default[0] if backend.budgets else None
        trial = _tiny_trial(backend=name, budget=budget, distributed_mode=mode)
        _, model = worker.build_trial_model(trial, torch.device("cpu"))
        if backend.before_sharding is not None:
            backend.before_sharding(model)
        compiled = backend.compile(model, trial, torch.device("cpu"))
        assert compiled.parameters_owner is model, name
        assert (compiled.thunderfx is not None) == backend.thunder, name
        wrapped = [isinstance(layer, CheckpointWrapper) for layer in hf_models.decoder_layers(model)]
        assert wrapped == [name == "eager-ac"] * 2, name


@pytest.mark.parametrize(("options", "message"), [
    (["--distributed-mode", "thunder-fsdp"], "thunder-fsdp shards inside thunder.jit: transformers models run"),
    (["--loss-mode", "litgpt"], "--loss-mode litgpt: a transformers model computes its loss itself"),
    (["--head-unit", "own"], "--head-unit own: a transformers model's head and loss stay in the root's unit"),
    (["--simulate-world-size", "2"], "--simulate-world-size materializes litgpt models only"),
    (["--model-name", "Llama-3-8"], "argument --model-name: 'Llama-3-8' is not a transformers model of the "
                                    "benchmark (a released model's name, or a causal-LM model type or config class); "
                                    "did you mean Llama-3-8B?"),
    (["--model-name", "stablecode-completion-alpha-3b"], "argument --model-name: 'stablecode-completion-alpha-3b' "
                                                         "is not a transformers model of the benchmark (a released model's name, or "
                                                         "a causal-LM model type or config class); one of "
                                                         "Llama-3-8B, Qwen2.5-7B, Qwen3-8B"),
])
def test_flags_a_transformers_model_does_not_take_are_one_line_errors(options, message, capsys):
    assert _usage_error(["--model-source", "transformers", *options], capsys).startswith(
        f"benchmark_fsdp2.py: error: {message}")


def _usage_error(argv: list[str], capsys) -> str:
    """The line argparse ends with when the command line is refused (exit 2, before any work)."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(argv)
    assert exited.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    return line


def test_the_model_name_defaults_to_each_sources_own(capsys):
    litgpt, _ = cli.parse_args([])
    transformers, _ = cli.parse_args(["--model-source", "transformers"])
    assert (litgpt.model_name, transformers.model_name) == ("stablecode-completion-alpha-3b", "Llama-3-8B")
    assert "'Qwen2.5-7B-x' is not a litgpt config name" in _usage_error(["--model-name", "Qwen2.5-7B-x"], capsys)
