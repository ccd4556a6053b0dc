"""Padded batches (thunder_memopt.passes.masked_rows): a query that its mask hides every key from (a
left pad's; with a sliding window, a right pad's too) gets torch SDPA's zeros, where Thunder's
decomposition of SDPA gives NaN, and the NaN reaches every row of the next layer.

A narrowed transformers Qwen2 (tests/_hf.py), one layer of full causal attention and one of a
sliding window, T=16, under ``thunderfx_backend()`` against eager on a batch of two, one row padded
on the left or on the right (labels -100 there), where plain ThunderCompiler's loss is NaN: the loss
within 1e-5 relative and each gradient within 1e-5 of its largest eager element (measured on CPU,
2026-12-06: 5e-7 at most; eager runs torch's fused CPU attention kernel, Thunder its decomposition,
and the fused loss head sums in another order). On a bare SDPA under thunder.jit, the rows that see a
key are plain Thunder's bit for bit.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import thunder
import torch
import torch.nn.functional as F

from _hf import NARROW, build
from thunder_memopt import PASSES, MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.passes import masked_rows

T, PAD = 16, 5
PROVENANCE = "thunder_memopt masked_rows"
# Qwen2's layers as Qwen2 builds them with sliding windows on: the first attends to itself and the 3
# tokens before it (Mistral's sliding-window mask, where a right pad past the third sees only pads),
# the second to every earlier token (Llama's mask), where the first's NaN would reach every row. One
# compile covers both masks.
LAYERS = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])


@functools.cache
def _compiled():
    """The model (random weights, fp32), its ``torch.compile(backend=thunderfx_backend())`` and the
    backend, made once."""
    torch._dynamo.reset()
    model = build("qwen2", **LAYERS)
    backend = thunderfx_backend()
    return model, torch.compile(model, backend=backend), backend


def _padded_batch(side: str) -> dict[str, torch.Tensor]:
    """Two rows of T tokens; the second's first (left) or last (right) PAD are padding."""
    x = torch.randint(0, NARROW["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, T, dtype=torch.long)
    attention_mask[1, slice(None, PAD) if side == "left" else slice(T - PAD, None)] = 0
    return dict(input_ids=x, attention_mask=attention_mask, labels=x.masked_fill(attention_mask == 0, -100))


def _step(call, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = call(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_give_eagers_loss_and_gradients(side):
    model, compiled, backend = _compiled()
    batch = _padded_batch(side)
    expected, expected_grads = _step(model, model, batch)
    got, got_grads = _step(compiled, model, batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for n, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[n], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=n)
    # The pass's work: both layers' attentions, each with its own mask, zeroed where no key is seen.
    (traces,) = [thunder.last_traces(fn) for info in backend.compiler.subgraph_infos
                 for fn in info.thunder_compiled_fns]
    assert max(map(_zeroed_attentions, traces)) == 2


def _zeroed_attentions(trace) -> int:
    """The attentions whose output the trace zeroes with a ``where`` (the masked_rows rewrite)."""
    outputs = {b.output.name for b in trace.bound_symbols if b.sym.name == "scaled_dot_product_attention"}
    return sum(b.sym.name == "where" and getattr(b.args[1], "name", None) in outputs for b in trace.bound_symbols)


def _attention(mask: torch.Tensor, transforms=None):
    """SDPA's output and the gradients of q, k and v, eager (``transforms`` None) or under
    thunder.jit with thunder_memopt's executors."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, requires_grad=True) for _ in range(3))
    weight = torch.randn(2, 2, 6, 8, generator=g)
    f = F.scaled_dot_product_attention
    if transforms is not None:
        f = thunder.jit(f, executors=executors(), transforms=transforms)
    out = f(q, k, v, mask)
    (out * weight).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _bool_mask() -> torch.Tensor:
    """Causal, and in batch 0 the first two queries, in batch 1 the first three keys, masked out."""
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, ..., :2, :] = False
    mask[1, ..., :3] = False
    return mask


MASKS = {"bool": _bool_mask, "float_neg_inf": lambda: torch.zeros(2, 1, 6, 6).masked_fill(~_bool_mask(), -torch.inf)}


@pytest.mark.parametrize("kind", MASKS)
def test_fully_masked_rows_give_sdpas_zeros_and_gradients_under_thunder_jit(kind):
    mask = MASKS[kind]()
    eager = _attention(mask)
    memopt = _attention(mask, [MemoryOptimization()])
    plain = _attention(mask, [MemoryOptimization(passes=[p for p in PASSES if p != "masked_rows"])])
    seen = _bool_mask().any(-1, keepdim=True).expand(2, 2, 6, 8)  # the queries that see a key
    assert plain[0][~seen].isnan().all()  # Thunder's decomposition: NaN
    assert torch.equal(memopt[0][~seen], torch.zeros(int((~seen).sum())))
    for got, expected in zip(memopt, eager):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(memopt[0][seen], plain[0][seen], rtol=0, atol=0)
    torch.testing.assert_close(memopt[1][seen], plain[1][seen], rtol=0, atol=0)  # dq of those rows


def _sliding_window(window: int, n: int = 8) -> torch.Tensor:
    """transformers' sliding-window causal mask, made as its masking_utils makes it: each query sees
    itself and the ``window - 1`` keys before it."""
    q_idx, kv_idx = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return torch.ones((), dtype=torch.bool) & (kv_idx > q_idx - window) & (kv_idx <= q_idx)


def _computation_trace(f, *args):
    jitted = thunder.jit(f)
    jitted(*args)
    return thunder.last_traces(jitted)[0]


def test_attention_whose_mask_hides_no_row_by_how_it_is_made_is_left_as_it_was():
    q = torch.randn(1, 2, 8, 4)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    unchanged = {
        "proven_causal": lambda q: F.scaled_dot_product_attention(q, q, q, torch.ones(8, 8, dtype=torch.bool).tril()),
        "is_causal": lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        "no_mask": lambda q: F.scaled_dot_product_attention(q, q, q),
        "finfo_min_fill": lambda q: F.scaled_dot_product_attention(
            q, q, q, torch.zeros(8, 8).masked_fill(~causal, torch.finfo(torch.float32).min)),
    }
    unchanged["sliding_window"] = lambda q: F.scaled_dot_product_attention(q, q, q, _sliding_window(3))
    for name, f in unchanged.items():
        trace = _computation_trace(f, q)
        assert masked_rows.zero_fully_masked_rows(trace) is trace, name
    # A window of no key (kv_idx > q_idx) hides every key from every query.
    empty = _computation_trace(lambda q: F.scaled_dot_product_attention(q, q, q, _sliding_window(0)), q)
    assert PROVENANCE in str(masked_rows.zero_fully_masked_rows(empty).get_provenance())
    # float32's minimum is -inf in bf16: cast there, the fill may hide every key.
    overflow = _computation_trace(lambda q: F.scaled_dot_product_attention(
        q, q, q, torch.zeros(8, 8).masked_fill(~causal, torch.finfo(torch.float32).min).to(q.dtype)),
        q.to(torch.bfloat16))
    assert PROVENANCE in str(masked_rows.zero_fully_masked_rows(overflow).get_provenance())
    # Through the transform, without cuDNN attention (so the causal_mask pass does not run): no rewrite.
    jitted = thunder.jit(unchanged["proven_causal"], executors=executors(cudnn_attention=False),
                         transforms=[MemoryOptimization()])
    jitted(q)
    assert not any(_zeroed_attentions(t) for t in thunder.last_traces(jitted))


def test_a_failing_pass_leaves_the_attention_as_it_was_with_one_warning(monkeypatch):
    def fail(trace):
        raise RuntimeError("no")

    monkeypatch.setattr(masked_rows, "zero_fully_masked_rows", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _attention(_bool_mask(), [MemoryOptimization()])[0]
    assert [str(w.message) for w in caught if "masked_rows" in str(w.message)] == [
        "thunder_memopt: masked_rows left fully masked rows as Thunder computes them (NaN) (RuntimeError: no)"]
    assert out.isnan().any()
