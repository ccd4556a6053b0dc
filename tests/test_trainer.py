"""The README's Trainer snippet: transformers' Trainer with
``TrainingArguments(torch_compile_backend="thunder_memopt")`` trains a one-layer, width-64 Llama on
CPU with the losses of the same snippet without the backend (eager), within fp32 rounding
(``RTOL``: Thunder decomposes RMSNorm, SDPA and the cross-entropy into other kernels than eager's;
2026-12-06, the first loss equal, the second and third one ulp apart, 4.8e-7). The weights are not
compared: AdamW's first steps move a weight by about the learning rate whatever the size of its
gradient, so that rounding differences of the gradients grow (up to 4.6e-5 here).

The Trainer compiles through accelerate, whose backend names are a closed list; the snippet's
``import thunder_memopt`` adds this one (thunder_memopt.named_backend).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from test_readme import SNIPPETS
from thunder_memopt import named_backend

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

RTOL = 1e-5  # fp32: Thunder's decompositions round otherwise than eager's kernels
BACKEND = ', torch_compile_backend="thunder_memopt"'
TRAINING_STEP = transformers.Trainer.training_step


def _losses(code: str, monkeypatch) -> list[torch.Tensor]:
    """Each step's loss, unrounded (the Trainer's log rounds to 4 digits), of ``code`` run."""
    losses: list[torch.Tensor] = []

    def recorded(self, *args, **kwargs):
        loss = TRAINING_STEP(self, *args, **kwargs)
        losses.append(loss.detach())
        return loss

    torch._dynamo.reset()
    monkeypatch.setattr(transformers.Trainer, "training_step", recorded)
    exec(compile(code, "README.md:trainer", "exec"), {"__name__": "readme_trainer"})
    return losses


def test_trainer_with_the_backend_name_trains_as_eager(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet's output_dir
    assert SNIPPETS["trainer"].count(BACKEND) == 1
    eager = _losses(SNIPPETS["trainer"].replace(BACKEND, ""), monkeypatch)
    compiled = _losses(SNIPPETS["trainer"], monkeypatch)
    # The Trainer compiled the model with the backend (without options), whose Thunder ran.
    _, backend = named_backend._backends[id(None)]
    assert any(info.thunder_compiled_fns for info in backend.compiler.subgraph_infos)
    assert len(compiled) == len(eager) == 3
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager), rtol=RTOL, atol=0.0)
