"""Sliding-window attention (thunder_memopt.executors.window_attention) and the proof that puts it in
place of SDPA with a mask (``causal_mask.sliding_window``).

On CPU: which masks the ops that make them prove a window of ``w`` keys (``0 <= q_idx - kv_idx < w``
exactly), transformers' own included, also across a graph break (thunder_memopt.causal_inputs), and
that there, where flash does not run, the attention keeps its mask; and the window ops through
Thunder with flash's two kernels replaced by the formulas they compute.

On a GPU only (skipped without one): flash's window kernel in bf16 against eager SDPA with the mask
in fp32, each result within 2% of its largest element, and a narrow Qwen2 with a sliding layer
trained on it within 2% (loss) and 3% (gradients): bf16's rounding over these sums.
"""

from __future__ import annotations

import pytest
import thunder
import torch
import torch.nn.functional as F
from thunder.core.pytree import tree_flatten
from thunder.dynamo import ThunderCompiler

from _hf import build, tokens
from benchmarks.fsdp2.compile_rows import attention_kinds
from thunder_memopt import thunderfx_backend
from thunder_memopt.causal_inputs import marked_band
from thunder_memopt.executors import window_attention
from thunder_memopt.passes.causal_mask import is_causal_mask, sliding_window
from thunder_memopt.passes.index_values import TensorValues

T = 16
LAYERS = dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"])


def _indices():
    return torch.arange(T)[None, :], torch.arange(T)[:, None]


def _window(w: int) -> torch.Tensor:
    kv, q = _indices()
    return (kv <= q) & (kv > q - w)


# name: (how the function makes its mask from an input, the window proven, whether proven causal)
MASKS = {
    "window_4": (lambda x: _window(4), 4, False),
    "window_4_as_at_least": (lambda x: (_indices()[0] <= _indices()[1]) & (_indices()[0] >= _indices()[1] - 3), 4,
                             False),
    "window_1_the_diagonal": (lambda x: _window(1), 1, False),
    "window_4_broadcast": (lambda x: torch.ones(1, 1, T, T, dtype=torch.bool) & _window(4), 4, False),
    # As thunder_memopt.causal_inputs makes a marked window in the graph that reads it.
    "tril_and_triu": (lambda x: torch.ones(T, T, dtype=torch.bool).tril() & torch.ones(T, T, dtype=torch.bool).triu(-3),
                      4, False),
    # Every query's keys fit in it: causal.
    "window_of_every_key": (lambda x: _window(T), None, True),
    "causal": (lambda x: _indices()[0] <= _indices()[1], None, True),
    "window_without_causal": (lambda x: _indices()[0] > _indices()[1] - 4, None, False),
    "window_above_the_diagonal": (lambda x: (_indices()[0] < _indices()[1]) & (_indices()[0] > _indices()[1] - 4),
                                  None, False),
    "window_or_causal": (lambda x: (_indices()[0] <= _indices()[1]) | (_indices()[0] > _indices()[1] - 4), None,
                         False),
    "window_and_an_input": (lambda x: _window(4) & (x > 0), None, False),
    "empty_window": (lambda x: _window(0), None, False),
}


@pytest.mark.parametrize("name", MASKS)
def test_the_window_is_proven_only_where_the_mask_is_one(name):
    make_mask, window, causal = MASKS[name]
    jitted = thunder.jit(make_mask)
    x = torch.randn(T, T)
    made = jitted(x)
    trace = thunder.last_traces(jitted)[0]
    (mask,) = tree_flatten(trace.output)[0]
    values = TensorValues(trace)
    assert sliding_window(values, mask) == window
    assert is_causal_mask(values, mask) is causal
    if window is not None:  # the mask is that window indeed
        assert torch.equal(made, torch.broadcast_to(_window(window), made.shape))


def _regions(backend) -> list:
    return [fn for info in backend.compiler.subgraph_infos for fn in info.thunder_compiled_fns]


def test_transformers_sliding_window_mask_is_proven_and_on_cpu_keeps_its_mask():
    """Qwen2 with a sliding layer and a full one: the first's mask is a window of 4 keys, the
    second's causal. On CPU flash does not run, so both keep SDPA, the first its mask, and the step
    is plain Thunder's (tests/test_transformers.py, tests/test_padding.py)."""
    torch._dynamo.reset()
    model = build("qwen2", **LAYERS)
    backend = thunderfx_backend()
    x = tokens(model, 1, T)
    torch.compile(model, backend=backend)(input_ids=x, labels=x).loss.backward()
    found = []
    for fn in _regions(backend):
        first, last = thunder.last_traces(fn)[0], thunder.last_traces(fn)[-1]
        values = TensorValues(first)
        for b in first.bound_symbols:
            if b.sym.name == "scaled_dot_product_attention":
                found.append(sliding_window(values, b.args[3]))
        assert not any(b.sym.name.startswith("memopt_window_attention") for b in last.bound_symbols)
    assert found == [4, None]


def _window_of(x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[-2])
    return (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 4)


def _attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_window_made_in_one_graph_is_proven_in_the_graph_that_reads_it():
    """Across a graph break (as FSDP2's units make them), the mask's graph marks it a window of 4
    keys (thunder_memopt.causal_inputs) and the attention's graph reads it remade in the graph,
    where the causal_mask pass proves it; on CPU the attention keeps it, bit for bit as plain
    ThunderCompiler's."""
    torch._dynamo.reset()
    memopt = thunderfx_backend(fusion=False, cudnn_attention=True)
    mask = torch.compile(_window_of, backend=memopt)(torch.zeros(T, 8))
    assert marked_band(mask) == 4 and torch.equal(mask, _window(4))
    results = []
    for backend in (memopt, ThunderCompiler()):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, T, 8, generator=g, requires_grad=True) for _ in range(3))
        out = torch.compile(_attention, backend=backend)(q, k, v, mask)
        out.sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (attention,) = [fn for fn in _regions(memopt) if "scaled_dot_product_attention" in str(thunder.last_traces(fn)[0])]
    first = thunder.last_traces(attention)[0]
    (sdpa,) = [b for b in first.bound_symbols if b.sym.name == "scaled_dot_product_attention"]
    assert sliding_window(TensorValues(first), sdpa.args[3]) == 4


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="flash's window kernels run on CUDA")


@requires_cuda
@pytest.mark.parametrize("window", [1, 100, 511])
def test_window_attention_is_sdpa_with_the_mask_within_bf16_rounding(window):
    from thunder_memopt import MemoryOptimization, executors

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 4, 512, 64)
    q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
    weight = torch.randn(shape, device="cuda", generator=g)

    def attend(q, k, v):
        kv, qi = torch.arange(512, device=q.device)[None, :], torch.arange(512, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= qi) & (kv > qi - window))

    results = []
    for dtype, f in ((torch.float32, attend),
                     (torch.bfloat16, thunder.jit(attend, executors=executors(), transforms=[MemoryOptimization()]))):
        inputs = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        out = f(*inputs)
        (out.float() * weight).sum().backward()
        results.append([out.float(), *(t.grad.float() for t in inputs)])
    names = {b.sym.name for b in thunder.last_traces(f)[-1].bound_symbols}
    assert "memopt_window_attention_forward" in names and "scaled_dot_product_attention" not in names
    for got, expected in zip(results[1], results[0]):
        # bf16 inputs and outputs: within 2% of the largest fp32 element, and 1e-4 absolute: with a window of 1
        # the gradients of q and k are zero in exact arithmetic, so their largest fp32 element is rounding noise.
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 * expected.abs().max().item() + 1e-4)


@requires_cuda
def test_qwen2_with_a_sliding_layer_trains_on_the_window_kernel_within_bf16_rounding():
    torch._dynamo.reset()
    model = build("qwen2", dtype=torch.bfloat16, num_key_value_heads=4, hidden_size=256, **LAYERS).cuda()
    reference = build("qwen2", num_key_value_heads=4, hidden_size=256, **LAYERS).cuda()
    x = tokens(model, 1, 64).cuda()
    backend = thunderfx_backend()
    loss = torch.compile(model, backend=backend)(input_ids=x, labels=x).loss
    loss.backward()
    expected = reference(input_ids=x, labels=x).loss
    expected.backward()
    names = {b.sym.name for fn in _regions(backend) for b in thunder.last_traces(fn)[-1].bound_symbols}
    assert "memopt_window_attention_forward" in names
    torch.testing.assert_close(loss.float(), expected, rtol=2e-2, atol=0)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.float(), r.grad, rtol=0, atol=3e-2 * r.grad.abs().max().item(), msg=name)


def _reference_forward(query, key, value, window, scale):
    """Flash's forward as a formula, on (B, T, H, D) tensors: the output and the log-sum-exp."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    kv, qi = torch.arange(q.shape[-2])[None, :], torch.arange(q.shape[-2])[:, None]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~((kv <= qi) & (kv > qi - window)), -torch.inf)
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ v).transpose(1, 2), lse


def _reference_backward(grad, query, key, value, out, lse, window, scale):
    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
    with torch.enable_grad():
        remade, _ = _reference_forward(*inputs, window, scale)
    return torch.autograd.grad(remade, inputs, grad)


def test_the_window_ops_train_a_model_as_eager_with_their_kernels_written_as_formulas(monkeypatch):
    """The window ops through Thunder on CPU, where flash does not run: its two kernels replaced by
    the formulas they compute (the pass, the ops' gradient rule, the other passes and the executors
    around them are thunder_memopt's). Qwen2 with a sliding layer, fp32: loss within 1e-5 relative
    of eager's, each gradient within 1e-5 of its largest element, as in tests/test_padding.py."""
    monkeypatch.setattr(window_attention, "SERVED_DEVICES", {"cpu"})
    monkeypatch.setattr(window_attention, "_DTYPES", (thunder.dtypes.float32,))
    monkeypatch.setattr(window_attention, "_flash_forward", _reference_forward)
    monkeypatch.setattr(window_attention, "_flash_backward", _reference_backward)
    torch._dynamo.reset()
    model = build("qwen2", **LAYERS)
    x = tokens(model, 2, T)
    results = []
    for backend in (None, thunderfx_backend()):
        model.zero_grad(set_to_none=True)
        loss = (model if backend is None else torch.compile(model, backend=backend))(input_ids=x, labels=x).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (expected, expected_grads), (got, got_grads) = results
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    for n, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[n], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=n)
    names = [b.sym.name for fn in _regions(backend) for trace in (thunder.last_traces(fn)[-1],
             thunder.last_backward_traces(fn)[-1]) for b in trace.bound_symbols]
    assert names.count("memopt_window_attention_forward") == 1 and names.count("memopt_window_attention_backward") == 1
    # As a benchmark row reports them: the sliding layer's on the window kernel, the full one's causal.
    assert sorted(kind for fn in _regions(backend) for kind in attention_kinds(thunder.last_traces(fn))) == [
        "is_causal", "window"]
