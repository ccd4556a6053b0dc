"""The causal-mask pass (thunder_memopt.passes.causal_mask) and the backend's rewrite of transformers'
mask preparation (thunder_memopt.graph_rewrites.keep_mask_preparation_in_thunder).

Which masks the checker proves causal from the ops that make them, and that every attention, the
ones it rewrites to ``is_causal=True`` and the ones it leaves, computes what it did: on CPU bit for
bit, since Thunder's decomposition of SDPA masks the logits the same way for ``is_causal=True`` as
for the boolean mask. (On a GPU the rewrite changes the kernel: flash or cuDNN instead of the
memory-efficient one.) The pass runs where cuDNN attention is asked for (``cudnn_attention=True``);
on CPU cuDNN claims nothing, so the attention stays Thunder's. transformers' own mask, made in the
attention's region and proven there: tests/test_transformers.py.
"""

from __future__ import annotations

import pytest
import thunder
import torch

from _hf import build, tokens
from thunder_memopt import MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.graph_rewrites import keep_mask_preparation_in_thunder

T = 16
PROVEN = "thunder_memopt causal_mask"


def _causal(shape=(T, T)) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool).tril()


def _arange_le(strict: bool = False, shift: int = 0) -> torch.Tensor:
    kv, q = torch.arange(T)[None, :], torch.arange(T)[:, None] + shift
    return kv < q if strict else kv <= q


# name: (how the function makes its mask from an input tensor, whether the pass proves it causal)
MASKS = {
    "ones_tril": (lambda x: _causal(), True),
    "float_ones_tril_to_bool": (lambda x: torch.tril(torch.ones(T, T)).to(torch.bool), True),
    "kv_index_le_q_index": (lambda x: _arange_le(), True),
    "all_true_and_causal": (lambda x: torch.ones(1, 1, T, T, dtype=torch.bool) & _arange_le(), True),
    "not_strictly_upper": (lambda x: ~torch.ones(T, T, dtype=torch.bool).triu(1), True),
    # Causal, but Tensor.bool() is a torch fallback in Thunder 0.2.6, which the checker does not follow.
    "float_ones_tril_bool_method": (lambda x: torch.tril(torch.ones(T, T)).bool(), False),
    "tril_above_the_diagonal": (lambda x: torch.ones(T, T, dtype=torch.bool).tril(1), False),
    "tril_below_the_diagonal": (lambda x: torch.ones(T, T, dtype=torch.bool).tril(-1), False),
    "kv_index_lt_q_index": (lambda x: _arange_le(strict=True), False),
    "shifted": (lambda x: _arange_le(shift=1), False),
    "triu": (lambda x: torch.ones(T, T, dtype=torch.bool).triu(), False),
    "random": (lambda x: torch.rand(T, T) > 0.5, False),
    "from_an_input": (lambda x: x > 0, False),
}


def _attention_step(make_mask, transforms):
    """Output and gradients of SDPA with the mask ``make_mask`` builds, under thunder.jit; the traces."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, requires_grad=True) for _ in range(3))
    x = torch.randn(T, T, generator=g)

    def f(q, k, v, x):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(x))

    jitted = thunder.jit(f, executors=executors(fusion=False, cudnn_attention=True), transforms=transforms)
    torch.manual_seed(0)  # the random mask's draw
    out = jitted(q, k, v, x)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)], thunder.last_traces(jitted)


def _proven(traces) -> list:
    """The traces the pass rewrote (Thunder lists a trace again where a later transform keeps it)."""
    return list({id(t): t for t in traces if PROVEN in str(t.get_provenance())}.values())


@pytest.mark.parametrize("name", MASKS)
def test_checker_proves_causal_only_the_masks_made_causal_and_no_attention_changes_its_numerics(name):
    make_mask, proven = MASKS[name]
    plain = _attention_step(make_mask, [])
    memopt = _attention_step(make_mask, [MemoryOptimization()])
    rewritten = _proven(memopt[2])
    assert bool(rewritten) is proven
    if proven:  # the mask is causal indeed, and the attention now says so instead
        torch.manual_seed(0)
        mask = make_mask(None)
        assert torch.equal(mask, torch.broadcast_to(_causal(), mask.shape))
        (attention,) = [b for b in rewritten[0].bound_symbols if b.sym.name == "scaled_dot_product_attention"]
        assert attention.args[3] is None and attention.args[5] is True
    # Bit for bit where plain Thunder is finite. A mask below the diagonal leaves the first query
    # nothing to see: NaN in plain Thunder, SDPA's zeros with the masked_rows pass (tests/test_padding.py).
    for a, b in zip([memopt[0], *memopt[1]], [plain[0], *plain[1]]):
        assert a.isfinite().all() and torch.equal(a[b.isfinite()], b[b.isfinite()])


def test_a_padding_mask_from_the_caller_is_not_proven_and_keeps_its_meaning():
    """A padding mask passed in is a trace input: whatever its values (the first row all ones, as a
    tokenizer gives for an unpadded row; the second with four tokens masked out in its middle, which
    the later tokens must attend around), the ops prove nothing about it, the pass leaves the trace
    as it was, and the step computes eager PyTorch's loss and gradients within fp32 rounding. (Left
    padding would leave its first queries nothing to attend to, where Thunder's decomposition of
    SDPA gives NaN and eager PyTorch does not. transformers' own causal mask, proven, and its
    bit-identical training: tests/test_transformers.py.)"""
    model = build("llama", num_hidden_layers=1)
    x = tokens(model, 2, 32)
    attention_mask = torch.ones(2, 32, dtype=torch.long)
    attention_mask[1, 8:12] = 0
    labels = x.masked_fill(attention_mask == 0, -100)
    memopt = thunderfx_backend(fusion=False, cudnn_attention=True)
    torch._dynamo.reset()
    results = []
    for step, mask in ((torch.compile(model, backend=memopt), attention_mask), (model, attention_mask),
                       (model, torch.ones_like(attention_mask))):
        model.zero_grad(set_to_none=True)
        loss = step(input_ids=x, labels=labels, attention_mask=mask).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    regions = [thunder.last_traces(fn) for info in memopt.compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    assert regions and not any(_proven(traces) for traces in regions)
    (got, got_grads), (expected, expected_grads), (unmasked, _) = results
    fp32 = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, expected, **fp32)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(AssertionError):  # the mask matters: without it, another loss
        torch.testing.assert_close(unmasked, expected, **fp32)


def test_mask_preparation_rewrite_keeps_the_values():
    counts = []

    def backend(gm, example_inputs):
        counts.append(keep_mask_preparation_in_thunder(gm))
        return gm.forward

    def f(x, p, b):
        return (torch.diff(x, prepend=p, dim=-1), torch.diff(x, dim=0), x.diff(append=p), b.diff(),
                x.new_ones((2, 3), dtype=torch.bool), x.new_ones(4))

    g = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 9, (3, 5), generator=g), torch.randint(0, 9, (3, 1), generator=g),
            torch.rand(3, 5, generator=g) > 0.5)
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(*args)
    assert counts == [6]
    for a, b in zip(got, f(*args)):
        assert a.dtype == b.dtype and torch.equal(a, b)
