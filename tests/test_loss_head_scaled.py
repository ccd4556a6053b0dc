"""The fused loss head of models that scale or soft-cap their logits before the loss, and the head's
chunk shapes.

transformers' Granite divides the logits by ``logits_scaling``, Cohere multiplies them by
``logit_scale``, Gemma-2 soft-caps them (``tanh(logits / cap) * cap``); OPT returns them through
``.contiguous()``. Narrowed (width 64, one layer, vocabulary 256), fp32, CPU, called as
``model(input_ids=x, labels=x)`` under ``torch.compile(backend=thunderfx_backend(fusion=False))``
(the loss head on; fusion off spares inductor's CPU compilation): the head is fused; the returned
logits, the loss and the gradients are within fp32 rounding of eager's (Thunder computes the layers
below the head in its own order, and the fused head sums in another order).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import pytest
import torch

from _hf import symbol_names
from thunder_memopt import thunderfx_backend
from thunder_memopt.executors import linear_cross_entropy
from thunder_memopt.executors._head_shapes import aligned_classes, chunk_tokens, padded_row, spans, vocabulary_width

FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_GRAD = dict(rtol=1e-4, atol=1e-5)
HEAD_WITH_LOGITS = "memopt_linear_cross_entropy_forward_and_logits_with_gradients"
NARROW = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=256)
# Scales that round: neither is a power of two, so a fused head that multiplied by 1 / scale
# instead of dividing would not give eager's bits.
MODELS = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(NARROW, logits_scaling=3.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(NARROW, logit_scale=0.3)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(NARROW, head_dim=16, final_logit_softcapping=2.0)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                ffn_dim=128, vocab_size=256, word_embed_proj_dim=64)),
}


class Step(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]
    names: set[str]


@functools.cache
def _step(family: str, fused: bool) -> Step:
    """One forward and backward of the narrowed model, eagerly or under thunderfx_backend."""
    transformers = pytest.importorskip("transformers")
    config_name, model_name, config = MODELS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(**config, attn_implementation="sdpa", use_cache=False)
    model = getattr(transformers, model_name)(cfg).eval()  # no dropout (OPT's)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    backend = thunderfx_backend(fusion=False, loss_head=True) if fused else None
    out = (torch.compile(model, backend=backend) if fused else model)(input_ids=x, labels=x)
    # A term of the returned logits, so that their own gradient reaches the fused head too.
    (out.loss + out.logits.square().mean()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return Step(out.loss.detach(), out.logits.detach(), grads, symbol_names(backend) if fused else set())


@pytest.mark.parametrize("family", MODELS)
def test_scaled_and_capped_heads_fuse_and_match_eager(family):
    eager, fused = _step(family, False), _step(family, True)
    assert HEAD_WITH_LOGITS in fused.names
    torch.testing.assert_close(fused.logits, eager.logits, **FP32)
    torch.testing.assert_close(fused.loss, eager.loss, **FP32)
    assert fused.grads.keys() == eager.grads.keys()
    for name, grad in eager.grads.items():
        torch.testing.assert_close(fused.grads[name], grad, **FP32_GRAD, msg=name)


def _unfused(hidden, weight, targets, scale, softcap):
    logits = torch.nn.functional.linear(hidden, weight) / scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


# vocab 1000: the backward walks the vocabulary (slices of 128); 100: the tokens; in_forward: the
# gradients in the forward.
@pytest.mark.parametrize("dtype,softcap,vocab,in_forward", [
    (torch.float32, 5.0, 1000, False), (torch.bfloat16, 5.0, 1000, False), (torch.bfloat16, None, 1000, False),
    (torch.float32, 5.0, 100, False), (torch.float32, None, 1000, True), (torch.bfloat16, 5.0, 1000, True)])
def test_chunks_apply_the_models_steps_as_the_unfused_head(dtype, softcap, vocab, in_forward):
    """The executor's Thunder ops with steps, run directly: a division by 3 in the model's dtype
    (rounded to bf16 there, as the model rounds it), then the optional soft-cap, per chunk. fp32:
    within fp32 rounding. bf16: the loss of the same bf16 logits within fp32 rounding; the
    gradients within 2% in norm (the unfused head rounds the logits' gradient to bf16 after each
    of its ops, the fused one once)."""
    from thunder_memopt.executors import chunked_cross_entropy as cce

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, 64, generator=g).mul_(0.2).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (300,), generator=g)
    steps = (("true_divide", 3),) + (() if softcap is None else (
        ("true_divide", softcap), ("tanh", None), ("mul", softcap)))
    expected = _unfused(hidden, weight, targets, 3, softcap)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    with torch.no_grad():
        options = (hidden, weight, None, targets, -100, "mean", 64, steps, cce.dtypes.float32)
        if in_forward:
            loss, *grads = cce._with_gradients_impl(*options)
        else:
            loss, lse = cce._forward_impl(*options)
            grads = cce._backward_impl(torch.ones(()), hidden, weight, None, targets, lse, -100, "mean", 64, steps)
    torch.testing.assert_close(loss, expected, **FP32)
    for got, want in zip(grads, expected_grads):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, **FP32_GRAD)
        else:
            assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


def test_function_with_softcap_matches_the_unfused_head():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(150, 64, generator=g, requires_grad=True)
    weight = torch.randn(1000, 64, generator=g).mul_(0.2).requires_grad_()
    targets = torch.randint(0, 1000, (150,), generator=g)
    expected = _unfused(hidden, weight, targets, 1, 5.0)
    got = linear_cross_entropy(hidden, weight, targets, softcap=5.0, chunk_size=64)
    torch.testing.assert_close(got, expected, **FP32)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(expected, (hidden, weight))):
        torch.testing.assert_close(a, b, **FP32_GRAD)


# (vocabulary, tokens) -> (tokens per chunk on CPU, on CUDA; classes per vocabulary slice on CUDA)
SHAPES = {
    (32000, 8192): (1024, 1024, 3968), (49155, 8192): (640, 640, 3840), (128256, 8192): (256, 512, 3968),
    (151936, 8192): (128, 512, 3968), (256000, 8192): (128, 512, 3968),
    (32000, 4096): (512, 512, 3968), (49155, 4096): (512, 512, 6144), (128256, 4096): (256, 512, 8064),
    (151936, 4096): (128, 512, 8064), (256000, 4096): (128, 512, 8064),
}


@pytest.mark.parametrize("vocab,tokens", SHAPES)
def test_every_matmul_shape_the_head_chooses_is_a_multiple_of_128(vocab, tokens):
    """Token chunks and vocabulary slices are multiples of 128 (the last takes the rest); on CUDA a
    chunk has at least 512 rows, and a slice no more logits than 128 MiB of fp32."""
    cpu, cuda, width = SHAPES[vocab, tokens]
    assert chunk_tokens(tokens, vocab) == cpu
    assert chunk_tokens(tokens, vocab, device="cuda") == cuda
    assert vocabulary_width(tokens, vocab, cuda) == width
    assert tokens * width * 4 <= 128 * 2**20
    for chunk in (cpu, cuda):
        assert all((stop - start) % 128 == 0 for start, stop in spans(vocab, vocabulary_width(tokens, vocab, chunk))[:-1])
    assert padded_row(vocab, 2) % 8 == 0 and 0 <= padded_row(vocab, 2) - vocab < 8


@pytest.mark.parametrize("vocab", [49155, 1003])
def test_a_vocabulary_of_odd_width_is_one_matmul_of_whole_16_bytes_and_one_of_the_rest(vocab, monkeypatch):
    """Where the classes are not a whole number of 16 bytes (Granite's 49155), the head's logits come
    from two matmuls, the classes up to the last whole 16 bytes and the few left (on CUDA, where one
    matmul of such a width runs on a slow kernel; here on CPU through the same code), in the head's
    aligned logits buffer: the aligned classes bit for bit as one matmul; the few left within fp32
    rounding, since BLAS may run a matmul that narrow on another kernel (MKL on an AVX2 CPU sums
    their 32 products in another order: 3.3e-6 apart at most here)."""
    import thunder_memopt.executors.chunked_cross_entropy as head

    assert aligned_classes(vocab, 2) == vocab // 8 * 8 and aligned_classes(vocab, 4) == vocab // 4 * 4
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(64, 32, generator=g), torch.randn(vocab, 32, generator=g), torch.randn(vocab)
    for b in (None, bias):
        expected = torch.nn.functional.linear(hidden, weight, b)
        monkeypatch.setattr(head, "SPLIT_DEVICES", {"cuda", "cpu"})
        calls = []
        monkeypatch.setattr(head.torch, "mm", lambda *a, **k: calls.append(a[1].shape) or torch.matmul(*a, **k))
        monkeypatch.setattr(head.torch, "addmm",
                            lambda c, x, w, out: calls.append(w.shape) or torch.add(c, x @ w, out=out))
        got = head._linear(hidden, weight, b)
        monkeypatch.undo()
        assert calls == [(32, vocab // 4 * 4), (32, vocab % 4)]
        aligned = vocab // 4 * 4
        assert torch.equal(got[:, :aligned], expected[:, :aligned])
        torch.testing.assert_close(got[:, aligned:], expected[:, aligned:], rtol=1.3e-6, atol=1e-5)
