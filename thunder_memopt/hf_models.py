"""transformers causal LMs for the benchmark (``--model-source transformers``) and for ``python -m
thunder_memopt plan``: any decoder-only architecture of transformers' causal-LM mapping, at the
width of a released model or of its config class's defaults, built with random weights and trained
as transformers users train them.

- ``--model-name`` is a name of MODELS (a released model's config, depth apart), a model type of
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (``qwen3``, ``gemma2``) or its config class (``Qwen3Config``):
  the last two at the config class's default width;
- the model is ``AutoModelForCausalLM.from_config``: SDPA attention, ``use_cache=False``, in the
  trial's dtype; no hub download;
- a step's loss is ``model(input_ids=x, labels=x).loss`` (the model shifts the labels itself);
- under FSDP2 ``fully_shard`` goes on each decoder layer and on the root.

Narrowing (``--n-embd``) keeps an architecture as ``thunder_memopt.models.narrow_config`` does for
litgpt: head size 64, the ratio of query heads to key/value heads, the MLP's expansion ratio;
vocabulary 512. transformers is imported only where a model is built (the ``hf`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from thunder_memopt.models import HEAD_SIZE

if TYPE_CHECKING:
    import torch

__all__ = ["SOURCE", "NARROW_VOCAB_SIZE", "CausalLM", "MODELS", "causal_lm_types", "resolve", "model_name", "Width",
           "width", "config", "build", "decoder_layers", "loss_from_labels"]

SOURCE = "transformers"  # the --model-source value, and a row's model_source
NARROW_VOCAB_SIZE = 512


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


@dataclasses.dataclass(frozen=True)
class CausalLM:
    """A released model's architecture: its model type and the config fields its hub config states
    where they differ from the config class's defaults (depth apart: --n-layer)."""

    model_type: str  # a key of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    fields: dict[str, Any]


def _released(model_type: str, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
              theta: float, eps: float, **fields: Any) -> CausalLM:
    # Tied or not as the checkpoint is; no KV cache; random tokens need no special ones (Phi-3's
    # default pad and eos, 32000, lie outside a narrowed vocabulary).
    return CausalLM(model_type, dict(
        hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab, rope_parameters=_rope(theta), rms_norm_eps=eps, **{"tie_word_embeddings": False, **fields}))


# Named as litgpt names the same models where it has them, so that rows of both sources line up.
MODELS: dict[str, CausalLM] = {
    "Llama-3-8B": _released("llama", 4096, 14336, 32, 8, 128256, 500000.0, 1e-5),
    "Qwen2.5-7B": _released("qwen2", 3584, 18944, 28, 4, 152064, 1000000.0, 1e-6),
    "Qwen3-8B": _released("qwen3", 4096, 12288, 32, 8, 151936, 1000000.0, 1e-6, head_dim=128),
    "Mistral-7B-v0.3": _released("mistral", 4096, 14336, 32, 8, 32768, 1000000.0, 1e-5, sliding_window=None),
    # Attention to the last 2047 tokens only: past that the mask is not causal, and attention runs with it.
    "Phi-3-mini-4k-instruct": _released("phi3", 3072, 8192, 32, 32, 32064, 10000.0, 1e-5, sliding_window=2047),
    "OLMo-2-7B": _released("olmo2", 4096, 11008, 32, 32, 100352, 500000.0, 1e-6),
    # Sliding-window layers (4096) between global ones, soft-capped attention and logits, a tied head.
    "Gemma-2-2B": _released("gemma2", 2304, 9216, 8, 4, 256000, 10000.0, 1e-6, head_dim=256, sliding_window=4096,
                            final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                            tie_word_embeddings=True),
    # The logits divided by 16 before the loss; muP-style multipliers; a tied head.
    "Granite-3-8B": _released("granite", 4096, 12800, 32, 8, 49155, 10000000.0, 1e-5, embedding_multiplier=12.0,
                              logits_scaling=16.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                              tie_word_embeddings=True),
}


@functools.cache
def causal_lm_types() -> dict[str, str]:
    """transformers' causal-LM model types, each with its config class's name."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {t: CONFIG_MAPPING_NAMES[t] for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t in CONFIG_MAPPING_NAMES}


def resolve(name: str) -> CausalLM:
    """The architecture ``name`` stands for: a name of MODELS, or a causal-LM model type or config
    class name at that class's default width (no fields of its own)."""
    if name in MODELS:
        return MODELS[name]
    types = causal_lm_types()
    by_class = {config_class: t for t, config_class in types.items()}
    if name in types or name in by_class:
        return CausalLM(by_class.get(name, name), {})
    raise KeyError(name)


def model_name(text: str) -> str:
    """A name that ``resolve`` takes, for argparse: its one-line error, with the closest names, otherwise."""
    try:
        resolve(text)
    except KeyError:
        pass
    except ImportError:  # no transformers: only the registry's names
        if text in MODELS:
            return text
    else:
        return text
    close = difflib.get_close_matches(text, list(MODELS), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"one of {', '.join(MODELS)}"
    raise argparse.ArgumentTypeError(f"{text!r} is not a transformers model of the benchmark (a released model's "
                                     f"name, or a causal-LM model type or config class); {hint}")


@dataclasses.dataclass(frozen=True)
class Width:
    """The widths a trial builds: the model's own, or narrowed to ``hidden_size``."""

    hidden_size: int
    intermediate_size: int | None  # None: the architecture has no such field (its MLP is sized otherwise)
    num_attention_heads: int
    num_key_value_heads: int | None
    vocab_size: int


def _default_config(model_type: str, **fields: Any):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **fields)


def width(name: str, n_embd: int | None) -> Width:
    """The widths of ``name``'s architecture, narrowed to ``n_embd`` (a multiple of HEAD_SIZE) if given."""
    model = resolve(name)
    full = _default_config(model.model_type, **model.fields)
    intermediate = getattr(full, "intermediate_size", None)
    kv_heads = getattr(full, "num_key_value_heads", None) or None
    if n_embd is None:
        return Width(full.hidden_size, intermediate, full.num_attention_heads, kv_heads, full.vocab_size)
    heads = n_embd // HEAD_SIZE
    narrow_kv = None if kv_heads is None else max(1, heads // (full.num_attention_heads // kv_heads))
    narrow_intermediate = (None if intermediate is None
                           else int(round(intermediate / full.hidden_size * n_embd / 64)) * 64)
    return Width(n_embd, narrow_intermediate, heads, narrow_kv, NARROW_VOCAB_SIZE)


def config(name: str, *, n_layer: int, n_embd: int | None, block_size: int):
    """The transformers config of ``name``'s architecture with ``n_layer`` decoder layers, at its
    width or narrowed to ``n_embd``, for sequences of ``block_size`` tokens: SDPA, no KV cache."""
    model = resolve(name)
    fields = dict(model.fields)
    if n_embd is not None:
        narrow = {k: v for k, v in dataclasses.asdict(width(name, n_embd)).items() if v is not None}
        fields.update(narrow)
        # An explicit head size (Gemma's 256, Qwen3's 128) follows the narrowing's.
        if getattr(_default_config(model.model_type, **model.fields), "head_dim", None) is not None:
            fields.update(head_dim=HEAD_SIZE)
    return _default_config(model.model_type, **fields, num_hidden_layers=n_layer, max_position_embeddings=block_size,
                           attn_implementation="sdpa", use_cache=False,
                           pad_token_id=None, bos_token_id=None, eos_token_id=None)


def build(name: str, hf_config, *, dtype: torch.dtype, device: str | torch.device, seed: int) -> torch.nn.Module:
    """The causal LM of ``hf_config`` (``name``'s architecture) with deterministic random weights
    (transformers' own initialization), in ``dtype`` on ``device``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return model.to(dtype)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM: FSDP2's units, activation checkpointing's.
    The model's one module list of ``num_hidden_layers`` modules."""
    import torch

    n_layer = model.config.num_hidden_layers
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layer]
    if len(lists) != 1:
        raise ValueError(f"{type(model).__name__}: {len(lists)} module lists of {n_layer} layers; expected one")
    return list(lists[0])


def loss_from_labels(compiled: Callable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(input_ids, targets) -> loss: the model's own loss from ``labels=input_ids`` (it shifts them,
    so the benchmark's targets are not used), as transformers users train."""

    def forward(input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return compiled(input_ids=input_ids, labels=input_ids).loss

    return forward
