"""transformers' Trainer with ``TrainingArguments(torch_compile_backend="thunder_memopt")``: a narrowed
Llama (tests/_hf.py, one layer) trains on CPU with the losses of the same Trainer in eager, within
fp32 rounding (``RTOL``: Thunder decomposes RMSNorm, SDPA and the cross-entropy into other kernels
than eager's; 2026-12-06, the second and third losses differ by one ulp, 4.8e-7). The weights are
not compared: AdamW's first steps move a weight by about the learning rate whatever the size of its
gradient, so that rounding differences of the gradients grow (up to 4.6e-5 here).

The Trainer compiles through accelerate, whose backend names are a closed list;
``import thunder_memopt`` adds this one (thunder_memopt.named_backend).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import thunder_memopt  # noqa: F401  (adds "thunder_memopt" to accelerate's backend names)
from _hf import build, tokens
from thunder_memopt import named_backend

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

STEPS = 3
RTOL = 1e-5  # fp32: Thunder's decompositions round otherwise than eager's kernels


class LossRecordingTrainer(transformers.Trainer):
    """A Trainer that keeps each step's loss unrounded (its log rounds to 4 digits)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[torch.Tensor] = []

    def training_step(self, *args, **kwargs) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.losses.append(loss)
        return loss


def _train(output_dir: str, **compile_args) -> list[torch.Tensor]:
    """The losses of STEPS steps of the Trainer on the one-layer Llama."""
    torch._dynamo.reset()
    model = build("llama", num_hidden_layers=1)
    x = tokens(model, 8, 32)
    data = [{"input_ids": row, "labels": row} for row in x]
    args = transformers.TrainingArguments(
        output_dir=output_dir, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        seed=0, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True, **compile_args)
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [loss.detach() for loss in trainer.losses]


def test_trainer_with_the_backend_name_trains_as_eager(tmp_path):
    eager = _train(str(tmp_path / "eager"))
    compiled = _train(str(tmp_path / "compiled"), torch_compile=True, torch_compile_backend="thunder_memopt")
    assert len(compiled) == len(eager) == STEPS
    # The Trainer compiled the model with the backend: one options-less backend, whose Thunder ran.
    ((_, backend),) = named_backend._backends.values()
    assert any(info.thunder_compiled_fns for info in backend.compiler.subgraph_infos)
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager), rtol=RTOL, atol=0.0)
