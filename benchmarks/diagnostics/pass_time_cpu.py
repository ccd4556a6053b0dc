"""MemoryOptimization's pass seconds on CPU under thunder.jit, by depth and budget or memory limit
(issue 14, item 9; issue 35, item 4).

Narrowed stablecode (n_embd 256, T=128, bf16), one forward and backward; prints
``MemoryOptimization.pass_seconds`` per configuration:

    python benchmarks/diagnostics/pass_time_cpu.py --layers 8 32 --budgets 1.0 0.5 --memory-limits 1
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
    parser.add_argument("--budgets", type=fraction, nargs="*", default=[1.0, 0.5])
    parser.add_argument("--memory-limits", type=positive_int, nargs="*", default=[],
                        help="MemoryOptimization(memory_limit=...) in bytes (1: nothing fits, every rung priced)")
    args = parser.parse_args()
    options = [{"activation_budget": b} for b in args.budgets] + [{"memory_limit": m, "over_limit": "lowest"}
                                                                 for m in args.memory_limits]
    print("| layers | option | recompute s | schedule s | all passes s |")
    print("|---|---|---|---|---|")
    for n_layer in args.layers:
        for option in options:
            config = narrow_config("stablecode-completion-alpha-3b", n_layer=n_layer, n_embd=256, block_size=128)
            model = build_model(config)
            x, _ = random_batch(config, batch_size=1, seq_len=128)
            mo = MemoryOptimization(**option)
            thunder.jit(model, transforms=[mo])(x).sum().backward()
            s = mo.pass_seconds
            name, value = next(iter(option.items()))  # the budget or the limit
            print(f"| {n_layer} | {name}={value:g} | {s.get('recompute', 0):.2f} | {s.get('schedule', 0):.2f} | "
                  f"{sum(s.values()):.2f} |", flush=True)


if __name__ == "__main__":
    main()
