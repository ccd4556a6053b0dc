"""The fused loss head of a model that also returns its logits (transformers), with the loss's
gradients computed in the forward from the logits it makes whole anyway (head_gradients "forward",
the default at budget 1.0), and recomputing them in the backward ("backward").

The ops run directly on a head of 300 tokens, width 64: 1000 classes walk the vocabulary in
slices, 100 classes the tokens in chunks (``GRADIENT_SLICE_BYTES`` made small, so that each walk
takes several). fp32 against autograd through the unfused head of the same logits: the logits the
same bits, the loss and the gradients within fp32 rounding. Then a narrowed Gemma-2 (soft-capped
logits) under ``thunderfx_backend`` in both modes, against eager.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _hf import symbol_names
from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.executors import _head_shapes
from thunder_memopt.executors import chunked_cross_entropy as cce

FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_GRAD = dict(rtol=1e-4, atol=1e-5)
SOFTCAP = (("true_divide", 3), ("true_divide", 5.0), ("tanh", None), ("mul", 5.0))


def _head(vocab: int, steps, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, 64, generator=g).mul_(0.2).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (300,), generator=g)
    targets[:17] = -100
    logits = torch.nn.functional.linear(hidden, weight)
    for op, value in steps:
        logits = torch.tanh(logits) if op == "tanh" else getattr(torch, op)(logits, value)
    return hidden, weight, targets, logits


# Per vocabulary: the bytes of a slice of the logits' gradient, and the (rows, classes) it gives: four
# slices of the vocabulary (the last of 232 classes), or three chunks of tokens (the last of 44).
SLICES = {1000: (300 * 256 * 4, (300, 256)), 100: (128 * 100 * 4, (128, 100))}


@pytest.mark.parametrize("vocab", SLICES)
@pytest.mark.parametrize("steps", [(), SOFTCAP], ids=["plain", "softcap"])
@pytest.mark.parametrize("with_logits_grad", [False, True])
def test_gradients_from_the_whole_logits_match_autograd(monkeypatch, vocab, steps, with_logits_grad):
    """The forward's loss and unit gradients, scaled in the backward by an upstream gradient of 0.5,
    plus, where the model's logits get a gradient of their own, its contribution."""
    slice_bytes, slices = SLICES[vocab]
    monkeypatch.setattr(_head_shapes, "GRADIENT_SLICE_BYTES", slice_bytes)
    assert _head_shapes.gradient_slices(300, vocab, 4) == slices
    hidden, weight, targets, logits = _head(vocab, steps)
    expected = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=-100)
    logits_grad = (torch.randn(300, vocab, generator=torch.Generator().manual_seed(1)) * 1e-3
                   if with_logits_grad else torch.zeros(300, vocab))
    expected_grads = torch.autograd.grad(0.5 * expected + (logits * logits_grad).sum(), (hidden, weight))
    with torch.no_grad():
        loss, got_logits, lse, *unit = cce._logits_with_gradients_impl(hidden, weight, None, targets, -100, "mean",
                                                                       64, steps, cce.dtypes.float32)
        grads = cce._scale_with_logits_grad_impl(torch.tensor(0.5), logits_grad, hidden, weight, None, targets, lse,
                                                 -100, "mean", 64, steps, *unit)
    assert torch.equal(got_logits, logits)
    torch.testing.assert_close(loss, expected, **FP32)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **FP32_GRAD)


@pytest.mark.parametrize("steps", [(), SOFTCAP], ids=["plain", "softcap"])
def test_the_loss_is_the_same_bits_at_any_chunk_size_and_in_every_mode(steps):
    """The loss is summed once over every token's log-sum-exp and target logit, not per chunk: the
    head that recomputes its logits (chunks of 64 and 128 tokens), the one that computes its
    gradients in the forward (one chunk of 300) and the one that also returns its logits give the
    same bits."""
    hidden, weight, targets, _ = _head(1000, steps)
    options = (None, targets, -100, "mean")
    with torch.no_grad():
        losses = [cce._forward(hidden, weight, *options, steps, chunk, torch.float32)[0] for chunk in (64, 128)]
        losses.append(cce._forward_with_gradients(hidden, weight, *options, steps, 300, torch.float32)[0])
        losses.append(cce._logits_with_gradients_impl(hidden, weight, *options, 64, steps, cce.dtypes.float32)[0])
    assert all(torch.equal(loss, losses[0]) for loss in losses), losses


def test_a_logits_gradient_of_zeros_or_none_costs_no_matmul_in_the_backward(monkeypatch):
    """Autograd hands a result that nothing used a gradient of zeros (or Thunder None): the backward
    only scales what the forward computed, bit for bit and in place (the memory model reads its
    outputs as those tensors), and walks no chunk; an upstream gradient of 1 leaves them as they are."""
    hidden, weight, targets, _ = _head(1000, ())
    with torch.no_grad():
        _, _, lse, *unit = cce._logits_with_gradients_impl(hidden, weight, None, targets, -100, "mean", 64, (),
                                                           cce.dtypes.float32)
        monkeypatch.setattr(cce, "_backward", lambda *a, **k: pytest.fail("the backward walked the logits"))
        for logits_grad in (None, torch.zeros(300, 1000)):
            for upstream in (0.5, 1.0):
                computed = [None if g is None else g.clone() for g in unit]
                given = [None if g is None else g.clone() for g in unit]
                grads = cce._scale_with_logits_grad_impl(torch.tensor(upstream), logits_grad, hidden, weight, None,
                                                         targets, lse, -100, "mean", 64, (), *given)
                for got, was, before in zip(grads, given, computed):
                    assert got is was
                    assert got is None or torch.equal(got, before * upstream)


def test_compiled_the_models_logits_are_made_over_the_matmul_in_one_kernel_with_its_bits(monkeypatch):
    """Where the chunk math is compiled (CUDA; here CPU, where inductor's C++ backend serves), the
    model's ops on its logits run as one kernel over the matmul's output, compiled ahead with the
    head's other functions, in the same memory: the bits of torch.compile's kernel of those ops."""
    from thunder_memopt.executors.fusion import compile_stats, reset_compile_stats

    hidden, weight, _, _ = _head(100, SOFTCAP, torch.bfloat16)
    monkeypatch.setattr(cce, "COMPILED_DEVICES", {"cpu", "cuda"})
    reset_compile_stats()
    with torch.no_grad():
        raw = torch.nn.functional.linear(hidden, weight)
        logits = cce._model_logits_(raw, SOFTCAP)
    assert logits is raw
    torch._dynamo.reset()
    compiled_model = torch.compile(lambda x: torch.tanh(x / 3 / 5.0) * 5.0)  # SOFTCAP, as the model runs it
    assert torch.equal(logits, compiled_model(torch.nn.functional.linear(hidden, weight).detach()))
    assert compile_stats().functions == 1
    reset_compile_stats()


GEMMA2 = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=256, head_dim=16, final_logit_softcapping=2.0)
HEAD_OPS = {
    "forward": {"memopt_linear_cross_entropy_forward_and_logits_with_gradients",
                "memopt_linear_cross_entropy_scale_gradients_and_logits_grad"},
    "backward": {"memopt_linear_cross_entropy_forward_and_logits", "memopt_linear_cross_entropy_backward"},
}


@functools.cache
def _gemma2_step(head_gradients: str | None):
    """One forward and backward of the narrowed Gemma-2 with its logits unused by the loss (the
    usual training step), eagerly (None) or under thunderfx_backend with the loss head."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(**GEMMA2, attn_implementation="sdpa", use_cache=False)
    model = transformers.Gemma2ForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    backend = None if head_gradients is None else thunderfx_backend(
        MemoryOptimization(head_gradients=head_gradients), fusion=False, loss_head=True)
    out = (model if backend is None else torch.compile(model, backend=backend))(input_ids=x, labels=x)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads, set() if backend is None else symbol_names(backend)


@pytest.mark.parametrize("head_gradients", ["forward", "backward"])
def test_softcapped_model_head_matches_eager_either_way(head_gradients):
    loss, logits, grads, _ = _gemma2_step(None)
    got_loss, got_logits, got_grads, names = _gemma2_step(head_gradients)
    assert HEAD_OPS[head_gradients] <= names
    torch.testing.assert_close(got_logits, logits, **FP32)
    torch.testing.assert_close(got_loss, loss, **FP32)
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, **FP32_GRAD, msg=name)
