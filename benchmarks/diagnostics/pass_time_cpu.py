"""MemoryOptimization's pass seconds on CPU under thunder.jit, by depth and budget (issue 14, item 9).

Narrowed stablecode (n_embd 256, T=128, bf16), one forward and backward; prints
``MemoryOptimization.pass_seconds`` per configuration:

    python benchmarks/diagnostics/pass_time_cpu.py --layers 8 32 --budgets 1.0 0.5
"""

from __future__ import annotations

import argparse

import thunder

from thunder_memopt import MemoryOptimization
from thunder_memopt.arguments import fraction, positive_int
from thunder_memopt.models import build_model, narrow_config, random_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, nargs="+", default=[8, 32])
    parser.add_argument("--budgets", type=fraction, nargs="+", default=[1.0, 0.5])
    args = parser.parse_args()
    print("| layers | budget | recompute s | schedule s | all passes s |")
    print("|---|---|---|---|---|")
    for n_layer in args.layers:
        for budget in args.budgets:
            config = narrow_config("stablecode-completion-alpha-3b", n_layer=n_layer, n_embd=256, block_size=128)
            model = build_model(config)
            x, _ = random_batch(config, batch_size=1, seq_len=128)
            mo = MemoryOptimization(activation_budget=budget)
            thunder.jit(model, transforms=[mo])(x).sum().backward()
            s = mo.pass_seconds
            print(f"| {n_layer} | {budget:g} | {s.get('recompute', 0):.2f} | {s.get('schedule', 0):.2f} | "
                  f"{sum(s.values()):.2f} |", flush=True)


if __name__ == "__main__":
    main()
