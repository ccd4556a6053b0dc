"""The backend's graph rewrites for transformers models that Thunder 0.2.6 fails on
(thunder_memopt.graph_rewrites).

- An empty tensor filled by ``copy_`` into slices of its last axis, as DeepSeek's multi-head latent
  attention makes its keys (``fill_of_slices_as_cat``): the ``torch.cat`` of the sources. Its
  inputs, the split of one projection into keys and values of different sizes, reach the Thunder
  region as views of one storage, where plain ThunderCompiler fails on the in-place form (Thunder's
  ``insert_alias_updates`` reshapes one into the other). Under ``thunderfx_backend`` the step is
  eager's bit for bit (fusion off: the same kernels). A fill that leaves part of the tensor empty,
  or is read before it is whole, is left as it is.
- DeepSeek-V2's complex rotary embedding, which Thunder differentiates wrong, in real ops
  (``complex_products_as_real``); a complex product left in Thunder gets a warning.
- ``torch.eye`` (Qwen3.5's linear attention), which Thunder does not have, as a comparison of
  aranges.
- An in-place op on a tensor nothing else aliases, as its out-of-place form
  (``in_place_as_out_of_place``): Mixtral's router normalizes its top-k weights in place, and plain
  ThunderCompiler gives the router another gradient than eager's. A tensor viewed before it is
  changed, or an input, is left alone.
- Gemma-3n's AltUp: ``torch.multiply`` (an alias Thunder lacks) as ``torch.mul``, an in-place add
  through a permuted view as its out-of-place form, ``x[1:] += y`` as a ``torch.cat``
  (``slice_updates_as_cat``) and ``weight.data.clamp_`` outside Thunder, where plain ThunderCompiler
  fails.
- BLT's hash of byte n-grams: ``Tensor.unfold``, which plain ThunderCompiler fails on, as strided
  slices (``unfold_as_slices``), and ``%`` of a tensor, which Thunder does not map, as
  ``torch.remainder``; in one region, the grad mode on after the step.
- A 0-d tensor that needs a gradient, broadcast by an elementwise op (DiffLlama's ``lambda_full``),
  broadcast from ones (``zero_dim_operands_reshaped``): plain ThunderCompiler fails in the backward,
  or gives a wrong gradient.
"""

from __future__ import annotations

import warnings

import pytest
import thunder
import torch
from thunder.dynamo import ThunderCompiler

from thunder_memopt import thunderfx_backend
from thunder_memopt.in_place_rewrites import fill_of_slices_as_cat, in_place_as_out_of_place, slice_updates_as_cat

NOPE, ROPE, VALUE = 8, 4, 6


def _latent_keys(k_nope, value, k_rot):
    """DeepSeek-V3's ``DeepseekV3Attention``'s keys (transformers 5.17), then a use of keys and values."""
    k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
    keys = k_nope.new_empty(*k_nope.shape[:-1], NOPE + ROPE)
    keys[..., :NOPE].copy_(k_nope)
    keys[..., NOPE:].copy_(k_rot)
    return keys.sum(-1, keepdim=True) * value


def _step(backend) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 5, NOPE + VALUE, generator=g, requires_grad=True)
    k_rot = torch.randn(2, 1, 5, ROPE, generator=g, requires_grad=True)
    k_nope, value = torch.split(kv, [NOPE, VALUE], dim=-1)
    f = _latent_keys if backend is None else torch.compile(_latent_keys, backend=backend)
    out = f(k_nope, value, k_rot)
    out.sum().backward()
    return [out.detach(), kv.grad, k_rot.grad]


def test_latent_attentions_keys_train_as_eager_where_plain_thunder_fails():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="reshape"):
        _step(ThunderCompiler())
    torch._dynamo.reset()
    for got, expected in zip(_step(thunderfx_backend(fusion=False)), _step(None)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _rewritten(f, *args, rewrite=fill_of_slices_as_cat) -> list[int]:
    """What ``rewrite`` counts in each of ``f``'s dynamo graphs, which then run bit for bit as ``f``."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(rewrite(gm))
        return gm

    torch._dynamo.reset()
    expected = f(*[a.clone() for a in args])  # clones: f may change its inputs
    torch.testing.assert_close(torch.compile(f, backend=backend)(*args), expected, rtol=0, atol=0)
    return counts


def _partly_filled(x):
    keys = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])
    keys[..., : x.shape[-1]].copy_(x)
    return keys[..., : x.shape[-1]] * 2


def _read_while_filled(x):
    keys = x.new_empty(*x.shape[:-1], 2 * x.shape[-1])
    keys[..., : x.shape[-1]].copy_(x)
    first = keys[..., :1].clone()
    keys[..., x.shape[-1]:].copy_(x)
    return keys * first


def test_only_a_fill_that_tiles_the_tensor_before_any_read_is_rewritten():
    x = torch.randn(3, 4)
    assert _rewritten(_latent_keys, torch.randn(2, 3, 5, NOPE), torch.randn(2, 3, 5, VALUE),
                      torch.randn(2, 1, 5, ROPE)) == [1]
    assert _rewritten(_partly_filled, x) == [0]
    assert _rewritten(_read_while_filled, x) == [0]


def _complex_rotary(q, freqs):
    """DeepSeek-V2's rotary embedding (transformers 5.17's ``apply_rotary_emb``)."""
    rotated = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * freqs
    return torch.view_as_real(rotated).flatten(-2).type_as(q)


def _complex_norm(q, freqs):
    """A complex product read otherwise than through ``view_as_real``."""
    return (torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2)) * freqs).abs()


def test_a_complex_rotary_trains_as_eager_where_plain_thunder_does_not():
    """Plain ThunderCompiler's gradient through ``view_as_complex(q) * freqs`` is not torch's; the
    backend computes the product in real ops (within 1e-6: another order of the same products) and
    warns only of a complex product that it leaves in Thunder."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    freqs = torch.polar(torch.ones(5, 4), torch.randn(5, 4, generator=g))
    grads = []
    for backend in (None, ThunderCompiler(), thunderfx_backend(fusion=False)):
        torch._dynamo.reset()
        q.grad = None
        f = _complex_rotary if backend is None else torch.compile(_complex_rotary, backend=backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (f(q, freqs) * torch.arange(8.0)).sum().backward()
        assert not [w for w in caught if "products of complex tensors" in str(w.message)]
        grads.append(q.grad.clone())
    eager, thunder, memopt = grads
    assert not torch.allclose(thunder, eager)
    torch.testing.assert_close(memopt, eager, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="1 products of complex tensors run in Thunder"):
        torch.compile(_complex_norm, backend=thunderfx_backend(fusion=False))(q, freqs)


def _chunked_rule(x):
    """Qwen3.5's linear attention adds an identity of its chunk's size (transformers 5.17)."""
    return (x @ x.transpose(-1, -2)).tril(-1) + torch.eye(x.shape[-2], dtype=x.dtype, device=x.device)


def test_eye_runs_in_thunder_as_a_comparison_with_eyes_values():
    """Thunder 0.2.6 has no ``torch.eye`` (its interpreter raises NotImplementedError, as plain
    ThunderCompiler does on this function, after about two minutes on a 2-core CPU); the backend
    writes it as ``arange(n)[:, None] == arange(n)``, cast: bit for bit eager's, in one region."""
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with pytest.raises(NotImplementedError, match="torch.eye"):
        thunder.jit(lambda t: t + torch.eye(t.shape[-1]))(torch.randn(6, 6))
    torch._dynamo.reset()
    backend = thunderfx_backend(fusion=False)
    got = torch.compile(_chunked_rule, backend=backend)(x)
    torch.testing.assert_close(got, _chunked_rule(x), rtol=0, atol=0)
    assert [len(info.thunder_compiled_fns) for info in backend.compiler.subgraph_infos] == [1]


def _router(hidden, weight):
    """Mixtral's ``MixtralTopKRouter`` (transformers 5.17): top-2 of the softmax, normalized in place."""
    probs = torch.softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
    top, indices = torch.topk(probs, 2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, indices


def _routed(hidden, weight, experts):
    top, indices = _router(hidden, weight)
    return (top * experts.gather(-1, indices)).sum()


def test_a_router_normalized_in_place_gets_eagers_gradient_where_plain_thunder_does_not():
    """Thunder 0.2.6 saves ``top`` for the division's backward and overwrites it in the forward."""
    g = torch.Generator().manual_seed(0)
    hidden, experts = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    weight = torch.randn(4, 8, generator=g, requires_grad=True)
    grads = {}
    for name, backend in (("eager", None), ("thunder", ThunderCompiler()), ("memopt", thunderfx_backend(fusion=False))):
        torch._dynamo.reset()
        f = _routed if backend is None else torch.compile(_routed, backend=backend)
        grads[name], = torch.autograd.grad(f(hidden, weight, experts), weight)
    assert (grads["thunder"] - grads["eager"]).abs().max() > 0.1 * grads["eager"].abs().max()
    torch.testing.assert_close(grads["memopt"], grads["eager"], rtol=1e-6, atol=1e-6)


def _router_read_through_an_alias(hidden, weight):
    """HunYuan-MoE's router (transformers 5.17): ``.to`` of the normalized weights returns them."""
    top, indices = _router(hidden, weight)
    return top.to(torch.float32), indices


def _viewed_then_changed(x):
    y = x * 2
    row = y[0]
    y /= y.sum()
    return y + row.sum()


def _input_changed(x):
    x.mul_(2)
    return x + 1


def _narrowing_change(x):
    y = x * 3  # bf16: the in-place result keeps that dtype, the out-of-place one would not
    y /= torch.arange(1.0, 5.0)
    return y


def test_only_an_in_place_op_on_an_unaliased_tensor_of_the_graph_is_rewritten():
    router = torch.randn(6, 8), torch.randn(4, 8)
    assert _rewritten(_router, *router, rewrite=in_place_as_out_of_place) == [1]
    assert _rewritten(_router_read_through_an_alias, *router, rewrite=in_place_as_out_of_place) == [1]
    assert _rewritten(_narrowing_change, torch.randn(3, 4, dtype=torch.bfloat16),
                      rewrite=in_place_as_out_of_place) == [1]
    assert _rewritten(_viewed_then_changed, torch.randn(3, 4), rewrite=in_place_as_out_of_place) == [0]
    assert _rewritten(_input_changed, torch.randn(3, 4), rewrite=in_place_as_out_of_place) == [0]


def _permuted_then_changed(x):
    """Gemma-3n's ``predict`` (transformers 5.17): an in-place add through a permuted view."""
    y = (x * 2).permute(1, 0)
    y += 1
    return y.contiguous()


def _base_read_after_its_view_changed(x):
    base = x * 2
    y = base.permute(1, 0)
    y += 1
    return base + 1


def test_a_single_change_through_a_view_is_rewritten_where_nothing_reads_the_base_after_it():
    x = torch.randn(3, 4)
    assert _rewritten(_permuted_then_changed, x, rewrite=in_place_as_out_of_place) == [1]
    assert _rewritten(_base_read_after_its_view_changed, x, rewrite=in_place_as_out_of_place) == [0]


def _slice_updates(x, y):
    """One span of one axis updated in place: by an in-place op on the slice, a tensor, numbers."""
    z = x * 2
    first = z[0].clone()
    z[1:] += first * y
    total = z.sum(0)
    z[:, 1] = 7.0
    counts = (x > 0).long()
    counts[..., -1] = 7.6  # cast to the tensor's dtype, as setitem casts
    return z + 1, total, counts


def _slice_read_after_the_update(x, y):
    z = x * 2
    row = z[0]
    z[1:] += y
    return z + 1, row * 1


def _input_slice_updated(x, y):
    x[1:] += y
    return x * 1


def _strided_slice_updated(x, y):
    z = x * 2
    z[::2] = 0.0
    return z


def test_only_an_update_of_one_span_of_a_tensor_of_the_graph_is_rewritten():
    x, y = torch.randn(3, 4, 5), torch.randn(4, 5)
    assert _rewritten(_slice_updates, x, y, rewrite=slice_updates_as_cat) == [3]
    assert _rewritten(_slice_read_after_the_update, x, y, rewrite=slice_updates_as_cat) == [0]
    assert _rewritten(_input_slice_updated, x, y, rewrite=slice_updates_as_cat) == [0]
    assert _rewritten(_strided_slice_updated, x, y, rewrite=slice_updates_as_cat) == [0]


class _AltUp(torch.nn.Module):
    """Gemma-3n's AltUp around one layer (transformers 5.17), reduced: the clipped coefficients, the
    permuted predictions changed in place, a per-layer input read through ``torch.multiply`` beside
    all of them, and the correction added to a slice in place."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.coefs = torch.nn.Parameter(torch.randn(3, 8, generator=g))
        self.gate = torch.nn.Parameter(torch.randn(8, 8, generator=g))

    def forward(self, hidden, per_layer_inputs):
        self.coefs.data.clamp_(-0.5, 0.5)
        predictions = (hidden @ self.gate).unsqueeze(-1).expand(-1, -1, -1, 3) * self.coefs.sum(-1)
        predictions = predictions.permute(3, 0, 1, 2)
        predictions += hidden
        first = torch.multiply(torch.tanh(predictions[0].clone()), per_layer_inputs[:, :, 0, :])
        predictions[1:] += first
        return predictions * per_layer_inputs.sum(2)


def _altup_step(backend) -> list[torch.Tensor]:
    torch._dynamo.reset()
    module = _AltUp()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    per_layer_inputs = torch.randn(2, 5, 2, 8, generator=g, requires_grad=True)
    f = module if backend is None else torch.compile(module, backend=backend)
    out = f(hidden, per_layer_inputs)
    (out * torch.arange(8.0)).sum().backward()
    return [out.detach(), module.coefs.detach(),
            hidden.grad, per_layer_inputs.grad, module.gate.grad, module.coefs.grad]


def test_gemma3n_altup_trains_as_eager_in_one_region_where_plain_thunder_fails():
    """Values and the clipped weights bit for bit; gradients within fp32 rounding of eager's (the
    concatenation's backward sums in another order than the in-place add's)."""
    with pytest.raises(RuntimeError, match="modified inplace"):
        _altup_step(ThunderCompiler())
    backend = thunderfx_backend(fusion=False)
    got, expected = _altup_step(backend), _altup_step(None)
    for a, b in zip(got[:2], expected[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(got[2:], expected[2:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    # The clip runs outside Thunder; everything else in one region.
    assert [len(info.thunder_compiled_fns) for info in backend.compiler.subgraph_infos] == [1]


def _differential_attention(q, k, x):
    """DiffLlama's ``lambda_full * attn_output2`` (transformers 5.17), reduced."""
    weight = torch.exp(torch.sum(q * k, dim=-1, dtype=torch.float32)).to(x.dtype) - 0.8
    return (2 * x - weight * x).sum()


def _reduction_times_its_input(q, k, x):
    return (q.sum() * q).sum() + (k * x).sum()


@pytest.mark.parametrize("f", [_differential_attention, _reduction_times_its_input])
def test_a_broadcast_0d_tensor_gets_eagers_gradient_where_plain_thunder_does_not(f):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(16, generator=g, requires_grad=True) for _ in range(2))
    x = torch.randn(2, 8, 16, generator=g, requires_grad=True)
    eager = torch.autograd.grad(f(q, k, x), (q, k, x))
    torch._dynamo.reset()
    try:
        thunder_grads = torch.autograd.grad(torch.compile(f, backend=ThunderCompiler())(q, k, x), (q, k, x))
    except RuntimeError as e:
        assert "expand" in str(e)
    else:
        assert not all(torch.equal(a, b) for a, b in zip(thunder_grads, eager))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, backend=thunderfx_backend(fusion=False))(q, k, x), (q, k, x))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _byte_group_hash(tokens, table):
    """BLT's hash of byte n-grams (transformers 5.17), reduced: ``unfold`` and ``%`` in ``torch.no_grad()``."""
    with torch.no_grad():
        padded = torch.cat([torch.zeros(tokens.shape[0], 2, dtype=torch.int64), tokens], dim=1)
        hashes = (padded.unfold(1, 3, 1) * torch.tensor([1, 31, 961])).sum(-1) % table.shape[0]
    return (table[hashes] * table[hashes].unfold(-1, 2, 2).sum(-1).repeat_interleave(2, -1)).sum()


def test_blts_hash_runs_in_one_region_as_eager_where_plain_thunder_fails():
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    table = torch.randn(13, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unfold"):
        torch.compile(_byte_group_hash, backend=ThunderCompiler())(tokens, table)
    torch._dynamo.reset()
    backend = thunderfx_backend(fusion=False)
    got = torch.autograd.grad(torch.compile(_byte_group_hash, backend=backend)(tokens, table), table)
    assert torch.is_grad_enabled()
    expected = torch.autograd.grad(_byte_group_hash(tokens, table), table)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert [len(info.thunder_compiled_fns) for info in backend.compiler.subgraph_infos] == [1]

