"""Saved bytes of a narrowed transformers Llama against litgpt's Llama of the same config, both under
MemoryOptimization with the fused loss head, measured on the real saved tensors of one forward.

transformers' model also returns its logits, so its fused head makes them whole. Saving them for the
backward kept tokens x vocab alive until it ran, more than the litgpt head's gradients at this
length; the head saves nothing of vocabulary size, and beside litgpt's head only what the logits'
own gradient needs.
"""

from __future__ import annotations

import thunder
import torch

from thunder_memopt import MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.measure import measure_saved
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

# Llama-3-8B narrowed to one layer (2 query heads of 64, one key/value head, MLP 448, vocabulary 512), 256 tokens:
# the logits (256 x 512) outweigh the litgpt head's saved gradients (512 x 128 and 256 x 128).
N_LAYER, N_EMBD, SEQ_LEN = 1, 128, 256


def _transformers_saved_per_layer() -> tuple[float, int]:
    from benchmarks.fsdp2 import hf_models

    torch._dynamo.reset()
    config = hf_models.config("Llama-3-8B", n_layer=N_LAYER, n_embd=N_EMBD, block_size=SEQ_LEN)
    model = hf_models.build("Llama-3-8B", config, dtype=torch.bfloat16, device="cpu", seed=0)
    x = torch.randint(0, config.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    backend = thunderfx_backend()
    measured = measure_saved(torch.compile(model, backend=backend), input_ids=x, labels=x,
                             parameters=list(model.parameters()))
    logits_bytes = measured.output.logits.untyped_storage().nbytes()
    return measured.activation_bytes / N_LAYER, logits_bytes


def _litgpt_saved_per_layer() -> float:
    config = narrow_config("Llama-3-8B", n_layer=N_LAYER, n_embd=N_EMBD, block_size=SEQ_LEN)
    model = build_model(config, dtype=torch.bfloat16)
    x, y = random_batch(config, batch_size=1, seq_len=SEQ_LEN)
    jitted = thunder.jit(GPTWithLoss(model, upcast_logits=True), executors=executors(),
                         transforms=[MemoryOptimization()])
    return measure_saved(jitted, x, y, parameters=[*model.parameters(), *model.buffers()]).activation_bytes / N_LAYER


# What transformers' head keeps for its logits' own gradient, should the model's caller give them one
# (executors.chunked_cross_entropy's head_scale_with_logits_grad): its input (bf16), each token's
# log-sum-exp (fp32) and target (int64). litgpt's head returns no logits and keeps none of them.
LOGITS_GRADIENT_INPUTS = SEQ_LEN * (N_EMBD * 2 + 4 + 8)


def test_transformers_llama_saves_no_more_per_layer_than_litgpt_and_not_its_logits():
    transformers_per_layer, logits_bytes = _transformers_saved_per_layer()
    litgpt_per_layer = _litgpt_saved_per_layer()
    assert transformers_per_layer <= litgpt_per_layer + LOGITS_GRADIENT_INPUTS / N_LAYER, (
        transformers_per_layer, litgpt_per_layer)
    # With the logits saved it would be above litgpt's: what the head no longer saves is their bytes.
    assert transformers_per_layer + logits_bytes / N_LAYER > litgpt_per_layer, (transformers_per_layer, logits_bytes)
