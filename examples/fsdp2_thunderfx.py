"""FSDP2 (fully_shard) + torch.compile with Thunder and MemoryOptimization.

    torchrun --nproc-per-node 2 examples/fsdp2_thunderfx.py

Uses NCCL on GPUs and gloo on CPU (with a model narrowed to width 256), so it runs anywhere.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.arguments import litgpt_model_name, positive_int
from thunder_memopt.models import build_model, narrow_config, random_batch


def shard(model, on_gpu: bool, reshard_after_forward: bool) -> None:
    """fully_shard per Block, on the embedding, head and final norm, then the root."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if on_gpu else MixedPrecisionPolicy()
    for module in [*model.transformer.h, model.transformer.wte, model.lm_head, model.transformer.ln_f]:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--block-size", type=positive_int, default=None, help="default: 4096 on GPU, 128 on CPU")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--zero3", action="store_true", help="reshard after forward")
    args = p.parse_args()

    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    block_size = args.block_size or (4096 if on_gpu else 128)
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=None if on_gpu else 256, block_size=block_size)
    model = build_model(cfg, dtype=torch.bfloat16 if on_gpu else torch.float32, device=device)
    shard(model, on_gpu, reshard_after_forward=args.zero3)
    compiled = torch.compile(model, backend=thunderfx_backend(MemoryOptimization()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    for step in range(args.steps):
        x, y = random_batch(cfg, batch_size=1, seq_len=block_size, device=device, seed=step)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if on_gpu else ""
            print(f"step {step}: loss {loss.item():.4f}, {time.perf_counter() - start:.2f} s{peak}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
