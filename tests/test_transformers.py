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


def _gpt2_step(backend) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of a narrowed GPT-2 (tied head, Conv1D's addmm, LayerNorm, learned
    positions; no dropout), under ``torch.compile(backend=backend)``: the loss and the gradients."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                                  use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    x = torch.randint(0, 256, (1, 32))
    loss = torch.compile(model, backend=backend)(input_ids=x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_gpt2_fusion_off_is_plain_thundercompiler_on_the_rewritten_graph():
    """Fusion off keeps plain ThunderCompiler's bits on the graph the backend's rewrites give it. On
    the graph as dynamo gives it, which plain ThunderCompiler splits at the mask's preparation and
    at each addmm, the loss is the same and some gradients differ in fp32's last bits: the joined
    regions sum a tensor's gradient contributions in another order (rewrite_for_thunder)."""
    from thunder_memopt.graph_rewrites import rewrite_for_thunder

    def rewritten(gm, example_inputs, compiler=ThunderCompiler()):
        rewrite_for_thunder(gm)
        return compiler(gm, example_inputs)

    loss, grads = _gpt2_step(thunderfx_backend(fusion=False))
    same_graph_loss, same_graph_grads = _gpt2_step(rewritten)
    plain_loss, plain_grads = _gpt2_step(ThunderCompiler())
    assert torch.equal(loss, same_graph_loss) and torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], g) for n, g in same_graph_grads.items())
    differing = {n for n, g in plain_grads.items() if not torch.equal(grads[n], g)}
    assert "transformer.wte.weight" in differing
    for name in differing:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=0, atol=4 * torch.finfo(torch.float32).eps,
                                   msg=name)
