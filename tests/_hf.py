"""Narrowed Hugging Face transformers causal LMs for the tests: built from their configs with random
weights, the loss computed by the model from ``labels``, as transformers users train them.

``build`` skips the calling test where transformers is not installed (the Makefile installs it)."""

from __future__ import annotations

import pytest
import torch

# Small enough for CPU: 4 query heads sharing 2 KV heads (grouped-query attention, as in Llama-3 and
# Qwen2), head size 16.
NARROW = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, vocab_size=256)
FAMILIES = ("llama", "qwen2")


def build(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **config) -> torch.nn.Module:
    """``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` from a narrowed config, SDPA attention, without a
    KV cache in the training call (``use_cache=False``); ``config`` overrides fields of NARROW."""
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    cfg = config_class(**{**NARROW, **config}, attn_implementation="sdpa", use_cache=False)
    return model_class(cfg).to(dtype)


def tokens(model: torch.nn.Module, batch: int, seq_len: int, seed: int = 1) -> torch.Tensor:
    """Random token ids of the model's vocabulary, (batch, seq_len)."""
    return torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def train_steps(model: torch.nn.Module, backend, x: torch.Tensor, steps: int,
                parameters: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """``steps`` AdamW steps of ``torch.compile(model, backend=backend)`` on ``model(input_ids=x,
    labels=x)``: each step's loss (detached) and the bytes saved for backward in the last step, less
    ``parameters`` (the local tensors of the parameters: under FSDP2 their shards)."""
    from thunder_memopt.measure import measure_saved

    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses, saved = [], 0
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        measured = measure_saved(compiled, input_ids=x, labels=x, parameters=parameters)
        measured.output.loss.backward()
        optimizer.step()
        losses.append(measured.output.loss.detach())
        saved = measured.activation_bytes
    return losses, saved


def symbol_names(backend) -> set[str]:
    """The names of the bound symbols in the last forward and backward traces of every Thunder region
    that a ``thunderfx_backend`` (or ``ThunderCompiler``) compiled."""
    import thunder

    compiler = getattr(backend, "compiler", backend)
    names: set[str] = set()
    for info in compiler.subgraph_infos:
        for fn in info.thunder_compiled_fns:
            for trace in thunder.last_traces(fn)[-1:] + thunder.last_backward_traces(fn)[-1:]:
                names.update(b.sym.name for b in trace.bound_symbols)
    return names
