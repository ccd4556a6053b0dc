"""An output whose gradient the backward reads in the fused head alone (a model's returned logits)
gets, where the caller leaves it unused, one broadcast zero for a gradient instead of zeros of its
size (thunder_memopt.executors.unmade_gradients), which the head takes for none: the same gradients,
bit for bit, under thunder.jit (autograd split; the head's gradients in the forward and in the
backward) and under thunderfx_backend; the memory model counts none of its bytes."""

import pytest
import thunder
import torch

from _hf import build, tokens
from thunder_memopt import MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.core.memory import backward_storages
from thunder_memopt.core.trace import unmade_cotangents
from thunder_memopt.executors import chunked_cross_entropy as cce
from thunder_memopt.executors import unmade_gradients

VOCAB, HIDDEN, TOKENS = 256, 32, 32  # VOCAB: _hf's narrowed vocabulary
MARK = "memopt_unused_gradient_unmade"


class _Head(torch.nn.Module):
    """A layer and a loss head that returns its logits beside the loss, as transformers' models do;
    with ``logits_in_loss``, the loss also reads the logits (their gradient has another reader)."""

    def __init__(self, logits_in_loss: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.logits_in_loss = logits_in_loss

    def forward(self, x, targets):
        logits = self.head(torch.tanh(self.body(x)))
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))
        if self.logits_in_loss:
            loss = loss + logits.square().mean()
        return loss, logits


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=g), torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)


def _model(via: str, logits_in_loss: bool = False):
    """The model, its call with the inputs (loss and logits), its compiled function and backend (None:
    thunder.jit, ``jit:HEAD_GRADIENTS``): under thunderfx_backend a narrowed transformers Llama, whose
    loss the pass fuses (the head above traces through dynamo to log_softmax and nll_loss)."""
    via, _, head_gradients = via.partition(":")
    torch.manual_seed(0)
    if via == "jit":
        model = _Head(logits_in_loss)
        fn = thunder.jit(model, executors=executors(), transforms=[MemoryOptimization(head_gradients=head_gradients)])
        return model, lambda: fn(*_inputs()), fn, None
    model = build("llama", num_hidden_layers=1)
    x = tokens(model, 1, TOKENS)
    torch._dynamo.reset()
    backend = thunderfx_backend()
    compiled = torch.compile(model, backend=backend)

    def call():
        out = compiled(input_ids=x, labels=x)
        return out.loss, out.logits

    return model, call, compiled, backend


def _traces(fn, backend):
    fns = [fn] if backend is None else [f for i in backend.compiler.subgraph_infos for f in i.thunder_compiled_fns]
    (one,) = fns
    return thunder.last_traces(one)[-1], thunder.last_backward_traces(one)[-1]


def _step(via, use_logits, seen, *, logits_in_loss=False):
    """One step's gradients, and the strides of each logits' gradient the fused head checked."""
    model, call, fn, backend = _model(via, logits_in_loss)
    loss, logits = call()
    (loss + logits.square().mean() if use_logits else loss).backward()
    strides, seen[:] = list(seen), []
    return {n: p.grad for n, p in model.named_parameters()}, strides, _traces(fn, backend)


@pytest.fixture
def seen(monkeypatch):
    """Each logits' gradient the fused head received: its strides, and whether the head took it for
    none (the zero broadcast for logits left unused)."""
    received = []

    def model_logits_grad(t):
        got = read(t)
        received.append((t.stride(), got is None))
        return got

    read = cce._model_logits_grad
    monkeypatch.setattr(cce, "_model_logits_grad", model_logits_grad)
    return received


# jit: the head's gradients in the forward (time first) and in the backward (memory first).
VIAS = ["jit:forward", "jit:backward", "thunderfx"]


@pytest.mark.parametrize("via", VIAS)
def test_unused_logits_get_one_broadcast_zero_and_the_same_gradients_bit_for_bit(monkeypatch, seen, via):
    grads, strides, (forward, backward) = _step(via, False, seen)
    assert strides == [((0, 0), True)]  # not a tokens x vocabulary tensor of zeros, and read as none
    assert MARK in {b.sym.name for b in forward.bound_symbols}
    (cotangent,) = unmade_cotangents(backward).values()
    assert cotangent.shape[-1] == VOCAB and cotangent.numel() == TOKENS * VOCAB
    assert backward_storages(forward, backward)[cotangent.name] == (cotangent.name, 0)
    # Thunder's own connection: autograd makes the zeros, and the head reads them whole.
    monkeypatch.setattr(thunder, "connect_to_autograd", unmade_gradients._thunder_connect_to_autograd)
    expected, strides, _ = _step(via, False, seen)
    assert strides == [((VOCAB, 1), False)]
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("via", VIAS)
def test_used_logits_get_their_gradient_as_before(monkeypatch, seen, via):
    grads, strides, _ = _step(via, True, seen)
    assert strides == [((VOCAB, 1), False)]  # the gradient autograd made
    monkeypatch.setattr(thunder, "connect_to_autograd", unmade_gradients._thunder_connect_to_autograd)
    expected, _, _ = _step(via, True, seen)
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name


def test_logits_whose_gradient_has_another_reader_are_not_marked(seen):
    # The loss reads the logits beside the head: the returned logits' gradient is added to that
    # reader's, so the head never reads it alone.
    grads, strides, (forward, backward) = _step("jit:forward", False, seen, logits_in_loss=True)
    assert MARK not in {b.sym.name for b in forward.bound_symbols}
    assert not unmade_cotangents(backward)
    assert all(s[-1] == 1 and not unmade for s, unmade in strides)
    torch.manual_seed(0)
    model = _Head(logits_in_loss=True)
    model(*_inputs())[0].backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
