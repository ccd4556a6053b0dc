"""Checkpoints of training with MemoryOptimization: the saved state dict loads into a plain model
with the same values, and resuming from it continues the loss curve bit for bit.

With ``executors(fusion=False)`` every op runs as plain Thunder runs it, so a resumed run must repeat
an uninterrupted one exactly: the loss of every step after the checkpoint, and the weights and
optimizer state at the end. Two ways in: ``thunder.jit`` on one device (``torch.save`` of the
state dicts), and FSDP2 under ``torch.compile(backend=thunderfx_backend(...))`` on two gloo
processes (``torch.distributed.checkpoint`` of the sharded state dicts; tests/dist/checkpoint_worker.py
in conftest.torchrun_job), whose checkpoint a plain, unsharded model reads after ``dcp_to_torch_save``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import thunder
import torch

from thunder_memopt import MemoryOptimization, executors
from thunder_memopt.models import GPTWithLoss, HeadWithLoss, build_model, narrow_config, random_batch, training_step

# One Block: saving, loading and resuming are checked the same at any depth.
CONFIG = narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=128, block_size=64)
SEQ_LEN = 64
STEPS, SAVED_AFTER = 4, 2
LR = 1e-3
# Eager against Thunder's kernels in fp32: the same math, summed in another order.
EAGER_RTOL = 1e-5


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CONFIG, batch_size=1, seq_len=SEQ_LEN, seed=100 * step)


def jitted_training() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model (the same initial weights every time), jitted with MemoryOptimization, and its AdamW."""
    model = GPTWithLoss(build_model(CONFIG, dtype=torch.float32, seed=0))
    jitted = thunder.jit(model, executors=executors(fusion=False), transforms=[MemoryOptimization()])
    return model, jitted, torch.optim.AdamW(model.parameters(), lr=LR)


def train(step_fn, optimizer: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    return [training_step(step_fn, optimizer, *batch(step)) for step in steps]


@pytest.fixture(scope="module")
def jit_runs(tmp_path_factory) -> dict:
    """An uninterrupted run of STEPS, its checkpoint after SAVED_AFTER, and a run resumed from it."""
    checkpoint = tmp_path_factory.mktemp("jit") / "checkpoint.pt"
    model, jitted, optimizer = jitted_training()
    losses = train(jitted, optimizer, range(SAVED_AFTER))
    # What a user saves: the jitted module's state dict, and the optimizer's.
    torch.save({"model": jitted.state_dict(), "optim": optimizer.state_dict()}, checkpoint)
    losses += train(jitted, optimizer, range(SAVED_AFTER, STEPS))

    resumed_model, resumed_jitted, resumed_optimizer = jitted_training()
    saved = torch.load(checkpoint, weights_only=True)
    resumed_jitted.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optim"])
    resumed = train(resumed_jitted, resumed_optimizer, range(SAVED_AFTER, STEPS))
    return {"losses": losses, "resumed": resumed, "saved": saved, "model": model, "optimizer": optimizer,
            "resumed_model": resumed_model, "resumed_optimizer": resumed_optimizer}


def test_jit_checkpoint_loads_into_a_plain_model(jit_runs):
    plain = GPTWithLoss(build_model(CONFIG, dtype=torch.float32, seed=1))  # other weights, then the checkpoint's
    plain.load_state_dict(jit_runs["saved"]["model"])
    for name, value in plain.state_dict().items():
        assert torch.equal(value, jit_runs["saved"]["model"][name]), name
    # The plain model is the trained one: eager's loss of the next batch is the jitted run's.
    with torch.no_grad():
        eager = plain(*batch(SAVED_AFTER))
    assert eager.item() == pytest.approx(jit_runs["losses"][SAVED_AFTER].item(), rel=EAGER_RTOL)


def test_jit_resume_continues_the_loss_curve_bit_for_bit(jit_runs):
    after = jit_runs["losses"][SAVED_AFTER:]
    assert all(torch.equal(a, b) for a, b in zip(after, jit_runs["resumed"], strict=True)), (after, jit_runs["resumed"])
    for (name, p), q in zip(jit_runs["model"].named_parameters(), jit_runs["resumed_model"].parameters(), strict=True):
        assert torch.equal(p, q), name
        state, resumed_state = jit_runs["optimizer"].state[p], jit_runs["resumed_optimizer"].state[q]
        assert all(torch.equal(state[key], resumed_state[key]) for key in state), name
    assert not torch.equal(jit_runs["losses"][0], jit_runs["losses"][-1])  # it trained


@pytest.fixture(scope="module")
def fsdp2_run(torchrun_job) -> Path:
    """The checkpoint worker's directory in the torchrun job (conftest.torchrun_job)."""
    return torchrun_job / "checkpoint"


@pytest.fixture(scope="module")
def result(torchrun_job) -> dict:
    return json.loads((torchrun_job / "reports.json").read_text())["checkpoint"]


def test_fsdp2_resume_continues_the_loss_curve_bit_for_bit(result):
    assert result["world_size"] == 2
    assert result["resumed"] == result["losses"][SAVED_AFTER:]  # floats from .item(): equal bits
    assert result["same_final_state"]  # every rank's parameter shards and AdamW state
    assert result["losses"][0] != result["losses"][-1]


def test_fsdp2_checkpoint_loads_into_a_plain_unsharded_model(fsdp2_run, result, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(fsdp2_run / "dcp", tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    full = torch.load(fsdp2_run / "full.pt", weights_only=True)
    plain = HeadWithLoss(build_model(CONFIG, dtype=torch.float32, seed=1))
    plain.load_state_dict(saved)
    assert plain.state_dict().keys() == full.keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(value, full[name]), name
    # Rank 0's loss of the step after the checkpoint, from the weights of the checkpoint.
    with torch.no_grad():
        eager = plain(*random_batch(CONFIG, batch_size=1, seq_len=SEQ_LEN, seed=100 * SAVED_AFTER))
    assert eager.item() == pytest.approx(result["losses"][SAVED_AFTER], rel=EAGER_RTOL)
