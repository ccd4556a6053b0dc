"""The report's per-layer figure comes from one plan: the Blocks' saved bytes in the one forward
trace of the whole model (``report.saved_bytes_by_layer``), never a difference between two models
that the recompute pass may plan apart (at budget 0 it did: 1 layer saving 17 KiB, 2 layers 161 KiB,
so a marginal of 144 KiB per layer, more than the whole 1-layer model; narrowed stablecode, width
64, T=64, fp32, 2026-12-06)."""

from __future__ import annotations

import thunder
import torch

from thunder_memopt import MemoryOptimization, executors, report
from thunder_memopt.core.memory import saved_for_backward
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch


def test_each_block_of_one_plan_saves_alike_and_the_rest_is_outside_them():
    cfg = narrow_config("stablecode-completion-alpha-3b", n_layer=2, n_embd=64, block_size=64)
    model = GPTWithLoss(build_model(cfg, dtype=torch.float32, device=torch.device("cpu")), upcast_logits=True)
    jitted = thunder.jit(model, executors=executors(), transforms=[MemoryOptimization(activation_budget=0.0)])
    jitted(*random_batch(cfg, batch_size=1, seq_len=64, device=torch.device("cpu"))).backward()
    forward = thunder.last_traces(jitted)[-1]
    inventory = saved_for_backward(forward)
    first, second = report.saved_bytes_by_layer(forward, inventory, 2)
    # Per-block checkpointing: each Block saves what the other does; the token ids, the targets and
    # the fused loss head's log-sum-exp are saved outside the Blocks.
    assert first == second > 0
    assert 0 < inventory.activation_bytes - (first + second) < first
