"""FSDP2 with the head and the loss a unit of their own (``HeadWithLoss.loss_head``, the benchmark's
``--head-unit loss``), against the head in the root's unit.

The root's unit is reduce-scattered only when the whole backward ends, so with the head there its
gradient stays unsharded through every Block's backward, and under zero2 its gathered weight too.
As a unit of its own, whose input requires grad, FSDP2 reduce-scatters it as soon as the head's
backward ends. Run on CPU under torch's fake process group at 8 ranks (at one rank FSDP2 skips the
reduce-scatter), with eager's hooks; then compiled, the head still fuses with its loss.
"""

from __future__ import annotations

import pytest
import thunder
import torch
from torch.distributed.fsdp import fully_shard

from _fsdp2 import fake_group  # noqa: F401 (a fixture)
from thunder_memopt import thunderfx_backend
from thunder_memopt.core.ops import FUSED_LOSS_HEAD_FORWARDS
from thunder_memopt.models import HeadWithLoss, build_model, narrow_config, random_batch

CONFIG = narrow_config("stablecode-completion-alpha-3b", n_layer=2, n_embd=128, block_size=64)


def _sharded(own_unit: bool) -> HeadWithLoss:
    gpt = build_model(CONFIG, dtype=torch.float32, seed=0)
    model = HeadWithLoss(gpt)
    units = [*gpt.transformer.h, gpt.transformer.wte, *([model.loss_head] if own_unit else [])]
    for unit in [*units, model]:
        fully_shard(unit, reshard_after_forward=False)  # zero2
    return model


@pytest.mark.parametrize("own_unit", [False, True])
def test_a_loss_head_unit_is_reduce_scattered_before_the_blocks_backward(fake_group, own_unit):
    model = _sharded(own_unit)
    head = model.loss_head.head.weight
    seen = []
    model.gpt.transformer.h[-1].register_full_backward_pre_hook(lambda *_: seen.append(head.grad is not None))
    model(*random_batch(CONFIG, batch_size=1, seq_len=64)).backward()
    # The last Block's backward is the first after the head's: the head's sharded gradient exists
    # there only when its unit was reduce-scattered already.
    assert seen == [own_unit]
    assert head.grad is not None and head.grad.to_local().shape == head.to_local().shape


def test_compiled_the_loss_head_unit_fuses_the_head_with_its_loss(fake_group):
    torch._dynamo.reset()
    model = _sharded(own_unit=True)
    backend = thunderfx_backend(fusion=False, loss_head=True)
    torch.compile(model, backend=backend)(*random_batch(CONFIG, batch_size=1, seq_len=64)).backward()
    programs = [{b.sym.name for b in thunder.last_traces(fn)[-1].bound_symbols}
                for info in backend.compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    (head,) = [names for names in programs if names & FUSED_LOSS_HEAD_FORWARDS]
    assert "embedding" not in head  # the unit's own program, not the root's
