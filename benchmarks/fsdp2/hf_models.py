"""transformers causal LMs for the benchmark (``--model-source transformers``): a registry of the
widths of released models, built from their config classes with random weights, trained as
transformers users train them.

Most people who try Thunder on a transformer bring a Hugging Face model, whose code differs from
litgpt's where a compiler's work is: the causal mask is materialized under dynamo and handed to
SDPA, and the model computes its loss from ``labels`` (``ForCausalLMLoss``: fp32 logits, labels
shifted by a pad). So the benchmark measures that code too:

- the model is ``<Family>ForCausalLM(<Family>Config(...))``, SDPA attention, ``use_cache=False``
  (no KV cache in a training call), in the trial's dtype; no hub download, no ``AutoConfig``;
- a step's loss is ``model(input_ids=x, labels=x).loss`` (the model shifts the labels itself);
- under FSDP2 ``fully_shard`` goes on each decoder layer and on the root, as transformers models
  are sharded (the embedding, final norm, head and loss in the root's unit).

Narrowing (``--n-embd``) keeps an architecture as ``thunder_memopt.models.narrow_config`` does for
litgpt: head size 64, the ratio of query heads to key/value heads, the MLP's expansion ratio;
vocabulary 512. transformers is imported only where a model is built (the ``hf`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING

from thunder_memopt.models import HEAD_SIZE

if TYPE_CHECKING:
    import torch

SOURCE = "transformers"  # the --model-source value, and a row's model_source
NARROW_VOCAB_SIZE = 512
# A family: transformers' config class and causal-LM class, by name.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """A released model's architecture, as its config on the hub states it (depth apart: --n-layer)."""

    family: str  # a key of FAMILIES
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    # Attention to the last this many tokens only: past it the mask is not causal, and attention
    # runs with the mask (no is_causal kernel applies).
    sliding_window: int | None = None


# Named as litgpt names the same models, so that rows of both sources line up.
MODELS: dict[str, CausalLM] = {
    "Llama-3-8B": CausalLM("llama", 4096, 14336, 32, 8, 128256, rope_theta=500000.0, rms_norm_eps=1e-5),
    "Qwen2.5-7B": CausalLM("qwen2", 3584, 18944, 28, 4, 152064, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "Mistral-7B-v0.3": CausalLM("mistral", 4096, 14336, 32, 8, 32768, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "Phi-3-mini-4k-instruct": CausalLM("phi3", 3072, 8192, 32, 32, 32064, rope_theta=10000.0, rms_norm_eps=1e-5,
                                       sliding_window=2047),
}


def model_name(text: str) -> str:
    """A name of MODELS, for argparse: its one-line error, with the closest names, otherwise."""
    if text in MODELS:
        return text
    close = difflib.get_close_matches(text, list(MODELS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"one of {', '.join(MODELS)}"
    raise argparse.ArgumentTypeError(f"{text!r} is not a transformers model of the benchmark; {hint}")


@dataclasses.dataclass(frozen=True)
class Width:
    """The widths a trial builds: the model's own, or narrowed to ``hidden_size``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int


def width(name: str, n_embd: int | None) -> Width:
    """The widths of MODELS[name], narrowed to ``n_embd`` (a multiple of HEAD_SIZE) if given."""
    model = MODELS[name]
    if n_embd is None:
        return Width(model.hidden_size, model.intermediate_size, model.num_attention_heads,
                     model.num_key_value_heads, model.vocab_size)
    heads = n_embd // HEAD_SIZE
    group_ratio = model.num_attention_heads // model.num_key_value_heads
    intermediate = int(round(model.intermediate_size / model.hidden_size * n_embd / 64)) * 64
    return Width(n_embd, intermediate, heads, max(1, heads // group_ratio), NARROW_VOCAB_SIZE)


def config(name: str, *, n_layer: int, n_embd: int | None, block_size: int):
    """The transformers config of MODELS[name] with ``n_layer`` decoder layers, at its width or
    narrowed to ``n_embd``, for sequences of ``block_size`` tokens: SDPA, no KV cache."""
    import transformers

    model = MODELS[name]
    config_class = getattr(transformers, FAMILIES[model.family][0])
    return config_class(**dataclasses.asdict(width(name, n_embd)), num_hidden_layers=n_layer,
                        max_position_embeddings=block_size, rms_norm_eps=model.rms_norm_eps,
                        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
                        sliding_window=model.sliding_window, tie_word_embeddings=False,
                        attn_implementation="sdpa", use_cache=False,
                        # Random tokens need no special ones (Phi-3's default pad and eos, 32000, lie
                        # outside a narrowed vocabulary).
                        pad_token_id=None, bos_token_id=None, eos_token_id=None)


def build(name: str, hf_config, *, dtype: torch.dtype, device: str | torch.device, seed: int) -> torch.nn.Module:
    """MODELS[name]'s causal LM of ``hf_config`` with deterministic random weights (transformers'
    own initialization), in ``dtype`` on ``device``."""
    import torch
    import transformers

    model_class = getattr(transformers, FAMILIES[MODELS[name].family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(hf_config)
    return model.to(dtype)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM: FSDP2's units, activation checkpointing's."""
    return list(model.model.layers)


def loss_from_labels(compiled: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(input_ids, targets) -> loss: the model's own loss from ``labels=input_ids`` (it shifts them,
    so the benchmark's targets are not used), as transformers users train."""

    def forward(input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return compiled(input_ids=input_ids, labels=input_ids).loss

    return forward
