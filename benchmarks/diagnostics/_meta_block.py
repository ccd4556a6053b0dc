"""One real-width litgpt Block under MemoryOptimization on the meta device, shared by the meta diagnostics.

The GPU's executors are made to claim meta tensors (cuDNN attention, the fusion regions, which are
never compiled), so that the traces are the GPU's without a GPU.
"""

from __future__ import annotations

import thunder
import thunder.torch as ltorch
import torch
from litgpt.model import Block

import thunder_memopt.transform as transform_module
from thunder_memopt import MemoryOptimization
from thunder_memopt.executors import InductorFusionExecutor, cudnn_attention_ex, linear_cross_entropy_ex
from thunder_memopt.models import narrow_config

# The fusion executor, claiming meta tensors.
META_FUSION = InductorFusionExecutor("memopt_fusion_meta", devices=("meta",))


def run_block_on_meta(model_name: str, block_size: int, memopt: MemoryOptimization,
                      stop: type[Exception] | tuple[type[Exception], ...] = ()) -> thunder.ThunderModule:
    """Jit a Block of ``model_name`` at its real width with ``memopt`` and run a forward of
    ``block_size`` tokens on meta; ``stop``: exceptions of the run that end it (the traces are made
    by then). Returns the jitted Block, whose last traces are the pair."""
    cudnn_attention_ex.implmap[ltorch.scaled_dot_product_attention.id].checker = lambda *a, **k: True
    transform_module.compile_ahead = lambda traces: 0
    config = narrow_config(model_name, n_layer=1, block_size=block_size)
    with torch.device("meta"):
        block = Block(config, block_idx=0).to(torch.bfloat16)
    executors = [linear_cross_entropy_ex, cudnn_attention_ex, META_FUSION, *thunder.get_default_executors()]
    jitted = thunder.jit(block, transforms=[memopt], executors=executors)
    x = torch.empty(1, block_size, config.n_embd, device="meta", dtype=torch.bfloat16, requires_grad=True)
    cos = torch.empty(1, block_size, config.rope_n_elem, device="meta", dtype=torch.bfloat16)
    try:
        jitted(x, cos, cos.clone())
    except stop:
        pass
    return jitted
