"""What the donate pass gives one real-width transformer Block, on the meta device.

The Block's forward and backward under MemoryOptimization, with and without the ``donate`` pass
(thunder_memopt.passes.donate): the estimated peak of the pair (``core.memory.estimate_step``) and
each region that donates, with the inputs it writes into. No GPU is needed: the traces are the
GPU's (``_meta_block``), so this says where donations land before a GPU row measures them:

    python benchmarks/diagnostics/donate_meta.py --model-name Llama-3-8B --block-size 8192
"""

from __future__ import annotations

import argparse

import thunder
from _meta_block import META_FUSION, run_block_on_meta

from thunder_memopt import PASSES, MemoryOptimization
from thunder_memopt.arguments import fraction, litgpt_model_name, positive_int
from thunder_memopt.core.memory import estimate_step
from thunder_memopt.core.trace import tensor_args, tensor_outs

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", type=litgpt_model_name, default="Llama-3-8B")
    parser.add_argument("--block-size", type=positive_int, default=8192, help="sequence length T")
    parser.add_argument("--budget", type=fraction, default=1.0, help="MemoryOptimization's activation_budget")
    args = parser.parse_args()

    for donating in (False, True):
        passes = PASSES if donating else tuple(p for p in PASSES if p != "donate")
        memopt = MemoryOptimization(activation_budget=args.budget, passes=passes)
        jitted = run_block_on_meta(args.model_name, args.block_size, memopt)
        forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
        peak = estimate_step(forward, backward).peak_bytes
        print(f"{args.model_name} Block, T={args.block_size}, budget {args.budget:g}, "
              f"{'with' if donating else 'without'} donate: estimated peak {peak / MIB:.1f} MiB, "
              f"{memopt.donated_outputs} region outputs donated an input")
        for name, trace in (("forward", forward), ("backward", backward)):
            for b in trace.bound_symbols:
                copies = [s for s in b.subsymbols if s.sym.name == "copy_"]
                if copies and META_FUSION.is_own_fusion(b):
                    into = ", ".join(f"{c.output.name} into {c.flat_proxy_args[1].name}" for c in copies)
                    print(f"  {name}: {b.sym.name}({', '.join(a.name for a in tensor_args(b))}) -> "
                          f"{', '.join(o.name for o in tensor_outs(b))}: {into}")


if __name__ == "__main__":
    main()
