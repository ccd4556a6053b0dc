"""Narrowed transformers Llama and Qwen2 (tests/_hf.py), called as ``model(input_ids=x, labels=x)``,
trained for three AdamW steps under thunderfx_backend with fusion off against plain
``ThunderCompiler()``: bit-identical, with fewer saved bytes, and with the graph in one Thunder
region where plain ThunderCompiler splits it in three.

Fusion off keeps every kernel of plain Thunder. cuDNN attention is asked for, so that the
causal-mask pass runs: on CPU cuDNN claims nothing, and Thunder's decomposition of SDPA masks the
logits the same way for ``is_causal=True`` as for transformers' boolean mask, so the rewrite keeps
every bit here. (On a GPU it changes the kernel, flash or cuDNN for the memory-efficient one, and
the fused loss head sums in another order: tests/test_loss_head.py and tests/test_causal_mask.py
state those tolerances.)
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import thunder
import torch
from thunder.dynamo import ThunderCompiler

from _hf import FAMILIES, build, tokens, train_steps
from thunder_memopt import thunderfx_backend

STEPS = 3


class Training(NamedTuple):
    losses: list[torch.Tensor]
    parameters: dict[str, torch.Tensor]
    saved_bytes: int  # saved for backward in the last step, parameters apart
    regions: list  # each Thunder region's traces
    split_reasons: str


def _train(family: str, backend) -> Training:
    torch._dynamo.reset()
    model = build(family)
    losses, saved = train_steps(model, backend, tokens(model, 2, 32), STEPS, list(model.parameters()))
    compiler = getattr(backend, "compiler", backend)
    regions = [thunder.last_traces(fn) for info in compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    reasons = " ".join(r.info for info in compiler.subgraph_infos for r in info.split_reasons)
    return Training(losses, {n: p.detach() for n, p in model.named_parameters()}, saved, regions, reasons)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_is_bit_identical_to_plain_thundercompiler_in_one_region_and_saves_less(family):
    plain = _train(family, ThunderCompiler())
    memopt = _train(family, thunderfx_backend(fusion=False, cudnn_attention=True))
    assert all(torch.equal(a, b) for a, b in zip(memopt.losses, plain.losses))
    assert all(torch.equal(memopt.parameters[n], p) for n, p in plain.parameters.items())
    assert memopt.saved_bytes < plain.saved_bytes, (memopt.saved_bytes, plain.saved_bytes)
    # Plain ThunderCompiler hands the mask preparation's torch.diff and new_ones to inductor: three
    # Thunder regions around them. thunderfx_backend rewrites both: one region, where the pass proves
    # the mask both layers' attention reads causal.
    assert len(plain.regions) == 3 and "diff" in plain.split_reasons and "new_ones" in plain.split_reasons
    (traces,) = memopt.regions
    assert not memopt.split_reasons
    proven = {str(t.get_provenance()) for t in traces if "causal_mask" in str(t.get_provenance())}
    assert proven == {"# Constructed by thunder_memopt causal_mask: the masks of 2 of 2 attentions proven causal"}
