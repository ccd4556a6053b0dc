"""Unsharded parameter and gradient bytes under thunder fsdp, with and without MemoryOptimization.

    torchrun --nproc-per-node 2 benchmarks/diagnostics/thunder_fsdp_unsharded_bytes.py [--n-layer 8 --block-size 128]

Runs one training step of the real-width model on CPU (gloo) for ZERO2 and ZERO3 and prints, from
rank 0, what thunder_memopt.passes.collectives.collective_bytes_at_peak reads off the forward and backward
traces: the most all-gathered parameter bytes and the most unsharded gradient bytes alive at any
point (these do not depend on the sequence length), and the all-gathered weights saved for
backward (what ZeRO-3's plan would replace by shards: collectives.plan_zero3).
"""

from __future__ import annotations

import argparse
import time

import thunder
import torch
import torch.distributed as dist
from thunder.distributed import FSDPType, fsdp

from thunder_memopt import MemoryOptimization
from thunder_memopt.models import build_model, narrow_config, random_batch
from thunder_memopt.passes.collectives import collective_bytes_at_peak, plan_zero3

GIB = 2**30


def step_traces(args, strategy: FSDPType, transforms: list):
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, block_size=args.block_size)
    model = build_model(cfg, dtype=torch.bfloat16)
    tm = fsdp(thunder.jit(model, transforms=transforms), device=torch.device("cpu"), sharding_strategy=strategy)
    x, y = random_batch(cfg, batch_size=1, seq_len=args.block_size)
    loss = torch.nn.functional.cross_entropy(tm(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    return thunder.last_traces(tm)[-1], thunder.last_backward_traces(tm)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-name", default="stablecode-completion-alpha-3b")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{args.model_name}, {args.n_layer} layers, T={args.block_size}, bf16, thunder fsdp on "
              f"{dist.get_world_size()} CPU ranks (GiB per rank)")
        print("| strategy | transform | max all-gathered params, fw / bw | max unsharded grads, bw | "
              "unsharded weights saved for backward |")
        print("|---|---|---|---|---|")
    for strategy in (FSDPType.ZERO2, FSDPType.ZERO3):
        for label, transforms in (("none", []), ("MemoryOptimization()", [MemoryOptimization()])):
            start = time.perf_counter()
            fw, bw = step_traces(args, strategy, transforms)
            f, b = collective_bytes_at_peak(fw), collective_bytes_at_peak(bw)
            if rank0:
                print(f"| {strategy.name} | {label} | {f.max_unsharded_param_bytes / GIB:.3f} / "
                      f"{b.max_unsharded_param_bytes / GIB:.3f} | {b.max_unsharded_grad_bytes / GIB:.3f} | "
                      f"{plan_zero3(fw).unsharded_bytes / GIB:.3f} |  ({time.perf_counter() - start:.0f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
