"""A causal mask made in one dynamo graph and read by another's attention (thunder_memopt.causal_inputs):
the attention gets ``is_causal=True`` where the mask comes marked, and reads the mask otherwise.

Under thunderfx_backend with fusion off and cuDNN attention asked for (so that the causal_mask pass
runs; on CPU cuDNN claims nothing), against plain ``ThunderCompiler()``: bit for bit, since Thunder's
decomposition of SDPA masks the logits the same way for ``is_causal=True`` as for the boolean mask.
(On a GPU the rewrite changes the kernel: cuDNN or flash for the memory-efficient one.)

- Two compiled functions, the mask made from ``arange`` in the first, attention in the second: a
  copy of the mask (the same values, unmarked), a mask written in place after it was made, and a
  mask the caller makes take the variant that reads the mask, compiled at its first call.
- A narrowed transformers Llama under FSDP2 on one gloo rank (``fully_shard`` on each decoder layer
  and the root, so that the mask reaches the layers' graph as an input): two AdamW steps
  bit-identical to plain ThunderCompiler's, the layers' attention ``is_causal=True`` without a
  mask; a call with packed position ids (the mask is not causal) and one with a padding mask take
  the masked variant, with plain ThunderCompiler's loss and gradients.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import thunder
import torch
import torch.distributed as dist
from thunder.dynamo import ThunderCompiler

from _hf import build, tokens, train_steps
from thunder_memopt import thunderfx_backend
from thunder_memopt.causal_inputs import is_marked_causal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fsdp2.compile_rows import attention_kinds, thunderfx_summary  # noqa: E402

T = 16
STEPS = 1


def _memopt():
    return thunderfx_backend(fusion=False, cudnn_attention=True)


def attention_calls(backend) -> Counter:
    """The calls of the compiled regions so far, by the kind of attention they run (is_causal, mask)."""
    calls: Counter = Counter()
    for info in getattr(backend, "compiler", backend).subgraph_infos:
        for fn in info.thunder_compiled_fns:
            for kind in attention_kinds(thunder.last_traces(fn)):
                calls[kind] += thunder.compile_stats(fn).calls
    return calls


def _causal_mask(x: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(x.shape[-2])
    return positions[None, :] <= positions[:, None]


def _attention(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attend(attend, mask, seed: int = 0) -> list[torch.Tensor]:
    """The output of ``attend`` and the gradients of its query, key and value."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, T, 8, generator=g, requires_grad=True) for _ in range(3))
    out = attend(q, k, v, mask)
    out.sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _assert_bitwise(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_mask_made_causal_in_one_graph_is_causal_attention_in_another_and_only_while_marked():
    torch._dynamo.reset()
    memopt = _memopt()
    make = torch.compile(_causal_mask, backend=memopt)
    attend = torch.compile(_attention, backend=memopt)
    plain = torch.compile(_attention, backend=ThunderCompiler())
    x = torch.zeros(T, 8)
    mask = make(x)
    assert is_marked_causal(mask) and torch.equal(mask, torch.ones(T, T, dtype=torch.bool).tril())
    _assert_bitwise(_attend(attend, mask), _attend(plain, mask))
    assert attention_calls(memopt) == {"is_causal": 1}

    # The same values, unmarked: the variant that reads the mask, compiled now.
    copy = mask.clone()
    assert not is_marked_causal(copy)
    _assert_bitwise(_attend(attend, copy), _attend(plain, copy))
    assert attention_calls(memopt) == {"is_causal": 1, "mask": 1}

    # Written in place after it was made (its version counter moved): no longer causal, read as it is.
    written = make(x)
    written[0, 1] = True
    assert not is_marked_causal(written)
    _assert_bitwise(_attend(attend, written), _attend(plain, written))
    # A mask of the caller's, the diagonal kept so that every query sees a key.
    g = torch.Generator().manual_seed(2)
    random = (torch.rand(T, T, generator=g) > 0.5) | torch.eye(T, dtype=torch.bool)
    _assert_bitwise(_attend(attend, random, seed=1), _attend(plain, random, seed=1))
    # Marked again: the causal variant, not compiled again.
    _assert_bitwise(_attend(attend, make(x), seed=3), _attend(plain, mask, seed=3))
    assert attention_calls(memopt) == {"is_causal": 2, "mask": 3}
    assert len(memopt.compiler.subgraph_infos) == 3  # the mask's graph, attention's two variants


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fsdp2_run(backend) -> dict:
    """A narrowed Llama under FSDP2 (2 layers), STEPS AdamW steps on ``model(input_ids=x, labels=x)``,
    then the loss and the gradients of a call as the steps', one with packed position ids and one
    with a padding mask; the attention calls by kind after the steps and after each of those calls."""
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    model = build("llama")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    x = tokens(model, 2, 32)
    losses, _ = train_steps(model, backend, x, STEPS, [p.to_local() for p in model.parameters()])
    run = {"losses": losses, "parameters": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
           "calls": {"steps": attention_calls(backend)}, "summary": thunderfx_summary(getattr(backend, "compiler", backend))}
    compiled = torch.compile(model, backend=backend)
    padding = torch.ones_like(x)
    padding[1, 8:12] = 0  # later tokens attend around them; every query keeps a key
    packed = torch.cat([torch.arange(16), torch.arange(16)])[None]  # two sequences in each row
    for name, kwargs in (("causal", {}), ("packed", {"position_ids": packed}), ("padding", {"attention_mask": padding})):
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=x, labels=x, **kwargs).loss
        loss.backward()
        run[name] = [loss.detach(), *(p.grad.to_local().clone() for p in model.parameters())]
        run["calls"][name] = attention_calls(backend)
    return run


def test_fsdp2_llama_layers_attend_with_is_causal_and_keep_every_bit(process_group):
    plain, memopt = _fsdp2_run(ThunderCompiler()), _fsdp2_run(_memopt())
    assert all(torch.equal(a, b) for a, b in zip(memopt["losses"], plain["losses"]))
    assert all(torch.equal(memopt["parameters"][n], p) for n, p in plain["parameters"].items())
    # The layers' graph (one region, which both layers run): attention is_causal, without the mask.
    assert plain["summary"]["attentions"] == {"is_causal": 0, "window": 0, "mask": 1, "neither": 0}
    assert memopt["summary"]["attentions"] == {"is_causal": 1, "window": 0, "mask": 0, "neither": 0}
    assert memopt["summary"]["graphs"] == plain["summary"]["graphs"]
    assert memopt["calls"]["steps"] == {"is_causal": 2 * STEPS}
    assert memopt["calls"]["causal"] == {"is_causal": 2 * STEPS + 2}
    # Packed position ids make the mask block-causal: not marked, the layers read it (a variant
    # compiled at that call); a padding mask, made from the caller's attention_mask, likewise.
    assert memopt["calls"]["packed"] == {"is_causal": 2 * STEPS + 2, "mask": 2}
    assert memopt["calls"]["padding"] == {"is_causal": 2 * STEPS + 2, "mask": 4}
    for name in ("causal", "packed", "padding"):
        _assert_bitwise(memopt[name], plain[name])
    for name in ("packed", "padding"):  # the masks matter: another loss than the causal mask's
        assert not torch.equal(memopt[name][0], memopt["causal"][0])
