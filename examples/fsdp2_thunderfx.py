"""FSDP2 (fully_shard) + torch.compile with Thunder and MemoryOptimization.

    torchrun --nproc-per-node 2 examples/fsdp2_thunderfx.py

Uses NCCL on GPUs and gloo on CPU (with a model narrowed to width 256), so it runs anywhere.

The head (``lm_head``) stays in the root FSDP2 unit, next to the loss, and the loss is computed
inside the compiled module (``HeadWithLoss``). Under torch.compile each FSDP2 unit is a graph of its
own; with the head and its cross-entropy in one graph, MemoryOptimization's loss_head pass fuses
them and the logits are never held whole.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.arguments import litgpt_model_name, positive_int
from thunder_memopt.models import build_model, narrow_config, next_token_loss, random_batch


class HeadWithLoss(torch.nn.Module):
    """The GPT without its head, then the head and the loss, in one forward (one graph).

    Written out here as a model of your own would need it; ``thunder_memopt.models.HeadWithLoss``
    is this class for litgpt's GPT."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.head, gpt.lm_head, self.gpt = gpt.lm_head, torch.nn.Identity(), gpt

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.head(self.gpt(input_ids)), targets)


def shard(gpt: torch.nn.Module, root: torch.nn.Module, on_gpu: bool, reshard_after_forward: bool) -> None:
    """fully_shard each Block and the embedding, then the root, whose unit holds the final norm, the
    head and the loss."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if on_gpu else MixedPrecisionPolicy()
    for module in [*gpt.transformer.h, gpt.transformer.wte]:
        fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(root, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--block-size", type=positive_int, default=None, help="default: 4096 on GPU, 128 on CPU")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--zero3", action="store_true", help="reshard after forward")
    args = p.parse_args()
    if "RANK" not in os.environ:  # else init_process_group's ValueError, deep in torch
        raise SystemExit(f"{p.prog}: FSDP2 needs a process per rank; run it under torchrun: "
                         "torchrun --nproc-per-node 2 examples/fsdp2_thunderfx.py")

    on_gpu = torch.cuda.is_available()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    block_size = args.block_size or (4096 if on_gpu else 128)
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=None if on_gpu else 256, block_size=block_size)
    gpt = build_model(cfg, dtype=torch.bfloat16 if on_gpu else torch.float32, device=device)
    model = HeadWithLoss(gpt)
    shard(gpt, model, on_gpu, reshard_after_forward=args.zero3)
    compiled = torch.compile(model, backend=thunderfx_backend(MemoryOptimization()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    for step in range(args.steps):
        x, y = random_batch(cfg, batch_size=1, seq_len=block_size, device=device, seed=step)
        start = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if on_gpu else ""
            print(f"step {step}: loss {loss.item():.4f}, {time.perf_counter() - start:.2f} s{peak}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
