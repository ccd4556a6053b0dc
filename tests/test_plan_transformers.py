"""``python -m thunder_memopt plan --model-source transformers``: a transformers causal LM's per-rank
peak predicted on meta, for a narrow Llama (``LlamaForCausalLM``, 2 decoder layers, width 128,
T=256, fp32) sharded as the benchmark shards it (FSDP2 units of each decoder layer and the root,
zero2, under torch's fake process group at 8 ranks, AdamW, the model's own loss from labels),
against the peak of a CPU step; and its model names, each argparse's one-line error."""

from __future__ import annotations

import pytest
import torch

from _fsdp2 import WORLD_SIZE, fake_group, first_step  # noqa: F401 (fake_group: a fixture)
from thunder_memopt import MemoryOptimization, hf_models, plan
from thunder_memopt.__main__ import main as cli
from thunder_memopt.measure import peak_live_bytes

NAME, N_LAYER, N_EMBD, T = "Llama-3-8B", 2, 128, 256
# As tests/test_plan.py's: the plan composes the step from one decoder layer's and the head's
# programs on meta; the CPU step has FSDP2's allocator-free copy-in and copy-out.
TOLERANCE = 0.10


class _LossFromLabels(torch.nn.Module):
    """The step's forward as the benchmark's: the model's own loss, ``labels=input_ids``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def _measured() -> int:
    config = hf_models.config(NAME, n_layer=N_LAYER, n_embd=N_EMBD, block_size=T)
    model = hf_models.build(NAME, config, dtype=torch.float32, device="cpu", seed=0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (1, T), generator=generator)
    step, resident = first_step(_LossFromLabels(model), [*hf_models.decoder_layers(model), model],
                                MemoryOptimization(), (x, x.clone()))
    peak = resident + peak_live_bytes(step)
    torch._dynamo.reset()
    return peak


def test_the_plan_predicts_a_transformers_cpu_steps_peak(fake_group):
    layout, block, head = plan.trace_programs(NAME, n_embd=N_EMBD, block_size=T, micro_batch_size=1,
                                              dtype=torch.float32, gpu=False, source="transformers")
    assert layout.others == () and layout.n_embd == N_EMBD  # the decoder layers and the root
    predicted = plan.plan_step(layout, block, head, n_layer=N_LAYER, world_size=WORLD_SIZE, shard_mode="zero2",
                               micro_batch_size=1, block_size=T, dtype=torch.float32, optimizer_states=2,
                               limit_bytes=1 << 40)
    measured = _measured()
    print(f"\npredicted {predicted.settings} measured {measured}")
    assert predicted.settings["thunder+memopt @1"] == pytest.approx(measured, rel=TOLERANCE)
    peaks = list(predicted.settings.values())
    assert peaks == sorted(peaks, reverse=True) and predicted.fits


@pytest.mark.parametrize("argv, message", [
    (["--model-source", "transformers", "--model-name", "Llama-9"], "argument --model-name: 'Llama-9' is not a "
                                                                      "transformers model"),
    (["--model-name", "Qwen3Config"], "argument --model-name: 'Qwen3Config' is not a litgpt config name"),
    (["--model-source", "jax"], "argument --model-source: invalid choice: 'jax'"),
])
def test_bad_model_names_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["plan", *argv])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"python -m thunder_memopt plan: error: {message}"), error
