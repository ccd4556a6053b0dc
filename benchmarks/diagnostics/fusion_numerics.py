"""Numerics of thunder_memopt's executors on CUDA, against eager and inductor.

For each model (litgpt config at its real width, a few layers, bf16, in-graph cross-entropy):
- the first step's gradients of every backend against eager's: the largest absolute difference per
  parameter group (a parameter's name without its layer index), and its ratio to inductor's;
- the loss after three AdamW steps against inductor's.
The acceptance of issue 13: thunder+memopt's differences at most 2x inductor's in every group, its
loss after three steps within 1% of inductor's. Run on a GPU:

    python benchmarks/diagnostics/fusion_numerics.py [--layers 4] [--seq-len 2048]
"""

from __future__ import annotations

import re
import sys

import thunder
import torch

from _numerics_args import numerics_parser, parse_on_gpu
from thunder_memopt import MemoryOptimization, executors
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

BACKENDS = ("eager", "inductor", "thunder", "thunder+fusion", "thunder+memopt")
STEPS = 3
LEARNING_RATE = 1e-4
GRAD_RATIO_LIMIT = 2.0
LOSS_RTOL = 0.01


def compiled(module: torch.nn.Module, backend: str):
    if backend == "eager":
        return module
    if backend == "inductor":
        return torch.compile(module)
    if backend == "thunder":
        return thunder.jit(module)
    transforms = [MemoryOptimization()] if backend == "thunder+memopt" else []
    return thunder.jit(module, executors=executors(), transforms=transforms)


def run(model_name: str, backend: str, layers: int, seq_len: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The first step's gradients (fp32 copies) and the losses of STEPS AdamW steps."""
    config = narrow_config(model_name, n_layer=layers, block_size=seq_len)
    gpt = build_model(config, device="cuda")
    module = GPTWithLoss(gpt)
    step = compiled(module, backend)
    x, y = random_batch(config, batch_size=1, seq_len=seq_len, device="cuda")
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=LEARNING_RATE)
    grads, losses = {}, []
    for i in range(STEPS):
        loss = step(x, y)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.float().clone() for n, p in gpt.named_parameters()}
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads, losses


def group_of(name: str) -> str:
    return re.sub(r"\.h\.\d+\.", ".h.*.", name)


def main(argv: list[str] | None = None) -> int:
    parser = numerics_parser(__doc__, models=["stablecode-completion-alpha-3b", "Llama-3-8B"], seq_len=2048)
    args = parse_on_gpu(parser, argv)
    failed = False
    for model_name in args.models:
        results = {b: run(model_name, b, args.layers, args.seq_len) for b in BACKENDS}
        reference = results["eager"][0]
        groups = sorted({group_of(n) for n in reference})
        worst = {b: {g: 0.0 for g in groups} for b in BACKENDS}
        for b in BACKENDS:
            for name, grad in results[b][0].items():
                g = group_of(name)
                worst[b][g] = max(worst[b][g], (grad - reference[name]).abs().max().item())
        print(f"\n## {model_name}, {args.layers} layers, T={args.seq_len}, bf16\n")
        print("max |grad - eager grad| per parameter group, first step (ratio to inductor's)\n")
        print("| group | " + " | ".join(BACKENDS[1:]) + " |")
        print("|---|" + "---|" * (len(BACKENDS) - 1))
        for g in groups:
            base = worst["inductor"][g]
            cells = [f"{worst[b][g]:.3g}" + ("" if b == "inductor" or base == 0 else f" ({worst[b][g] / base:.2f}x)")
                     for b in BACKENDS[1:]]
            print(f"| {g} | " + " | ".join(cells) + " |")
        print("\nloss per step\n")
        for b in BACKENDS:
            print(f"- {b}: " + ", ".join(f"{v:.5f}" for v in results[b][1]))
        memopt, inductor = results["thunder+memopt"], results["inductor"]
        ratios = [worst["thunder+memopt"][g] / worst["inductor"][g] for g in groups if worst["inductor"][g] > 0]
        loss_rel = abs(memopt[1][-1] - inductor[1][-1]) / abs(inductor[1][-1])
        ok = max(ratios, default=0.0) <= GRAD_RATIO_LIMIT and loss_rel <= LOSS_RTOL
        failed |= not ok
        print(f"\nthunder+memopt: worst gradient ratio to inductor {max(ratios, default=0.0):.2f} "
              f"(limit {GRAD_RATIO_LIMIT}), loss after {STEPS} steps {loss_rel:.2%} from inductor's "
              f"(limit {LOSS_RTOL:.0%}): {'PASS' if ok else 'FAIL'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
