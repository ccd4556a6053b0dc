"""MemoryOptimization(memory_limit=...) under FSDP2 at one rank (gloo, world size 1): the first plan's
prediction against the measured peak of a step (fit.first_step, ``StepTerms.peak``).

At one rank a unit's gradient shard is as large as its parameters. The peak the planner takes is a
Block's backward with the other Blocks' saved tensors alive; no other Block's backward has run
there, so their gradients are not: the other calls hold their saved tensors or their gradient,
never both (``StepTerms.call_gradient_bytes``). Counted together, the prediction was 9.5% over the
measured peak here (17,742,336 B against 16,205,388), against 1.9% at 8 ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from _fsdp2 import first_step
from thunder_memopt import MemoryOptimization
from thunder_memopt.measure import peak_live_bytes
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

CONFIG = narrow_config("Llama-3-8B", n_layer=2, n_embd=128, block_size=256)
# What the plan leaves out (tests/test_fit_first_step.py's too): the embedding's gradient, counted
# with the root's though made after the Blocks' backward, and FSDP2's copy-in and copy-out details.
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    torch._dynamo.reset()
    dist.destroy_process_group()


def test_at_one_rank_the_first_plan_predicts_the_measured_peak(one_rank):
    gpt = build_model(CONFIG, dtype=torch.float32, seed=0)
    model = GPTWithLoss(gpt)
    memopt = MemoryOptimization(memory_limit=1 << 40)
    step, resident = first_step(model, [*gpt.transformer.h, model], memopt,
                                random_batch(CONFIG, batch_size=1, seq_len=256))
    measured = resident + peak_live_bytes(step)
    report = memopt.fit_report
    block = report.choices[0]
    block_bytes = sum(p.nbytes for p in gpt.transformer.h[0].parameters())
    assert block.terms.calls == CONFIG.n_layer and block.terms.call_gradient_bytes == block_bytes
    predicted = report.predicted_peak_bytes
    print(f"\npredicted {predicted}, measured {measured}")
    assert predicted == pytest.approx(measured, rel=TOLERANCE), (predicted, measured)
    # The other Block's gradient counted beside its saved tensors: over by more than the tolerance.
    both = block.predicted_peak_bytes + (block.terms.calls - 1) * block.terms.call_gradient_bytes
    assert both > (1 + TOLERANCE) * measured
    check = memopt.check_fit(measured)
    assert not check.replan and not check.over
