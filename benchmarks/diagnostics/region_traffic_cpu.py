"""How many fusion regions a step runs, and the bytes they read and write, with and without
MemoryOptimization (issue 13: thunder+memopt's step is above thunder+fusion's).

Each region reads its inputs from and writes its outputs to device memory once, so the bytes at
region boundaries are a proxy for the fused code's memory traffic. On CPU, with the fusion executor
claiming CPU tensors, narrowed litgpt model, one forward and backward:

    python benchmarks/diagnostics/region_traffic_cpu.py --n-layer 2 --n-embd 256 --block-size 256
"""

from __future__ import annotations

import argparse

import thunder
from thunder.core.proxies import TensorProxy

from thunder_memopt import MemoryOptimization
from thunder_memopt.arguments import positive_int
from thunder_memopt.core.memory import tensor_nbytes
from thunder_memopt.executors import InductorFusionExecutor, linear_cross_entropy_ex
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

MIB = 2**20


def tensor_bytes(proxies) -> int:
    return sum(tensor_nbytes(p) for p in proxies if isinstance(p, TensorProxy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", default="stablecode-completion-alpha-3b")
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--n-embd", type=positive_int, default=256)
    parser.add_argument("--block-size", type=positive_int, default=256)
    args = parser.parse_args()
    fusion = InductorFusionExecutor("memopt_fusion_cpu_diagnostic", devices=("cpu",))
    config = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    x, y = random_batch(config, batch_size=1, seq_len=args.block_size)
    print("| configuration | trace | regions | read MiB | written MiB |")
    print("|---|---|---|---|---|")
    for label, transforms in (("thunder+fusion", []), ("thunder+memopt", [MemoryOptimization()])):
        jitted = thunder.jit(GPTWithLoss(build_model(config)), transforms=transforms,
                             executors=[linear_cross_entropy_ex, fusion, *thunder.get_default_executors()])
        jitted(x, y).backward()
        for name, trace in (("forward", thunder.last_traces(jitted)[-1]),
                            ("backward", thunder.last_backward_traces(jitted)[-1])):
            regions = [b for b in trace.bound_symbols if fusion.is_own_fusion(b)]
            read = tensor_bytes(a for b in regions for a in b.flat_proxy_args)
            written = tensor_bytes(o for b in regions for o in b.flat_proxy_outs)
            print(f"| {label} | {name} | {len(regions)} | {read / MIB:.2f} | {written / MIB:.2f} |", flush=True)


if __name__ == "__main__":
    main()
