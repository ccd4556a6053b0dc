"""The offload plan of one real-width transformer Block, made on the meta device (issue 16).

The plan (thunder_memopt.passes.offload) is made from the final forward and backward of each pair
and the device's rates; here they are a Block's at the model's real width and sequence length,
traced on the meta device with the GPU's executors made to claim meta tensors (cuDNN attention,
the fusion regions), so that the saved tensors are the GPU's without a GPU. The copies cannot run
on meta, so the step stops after the plan is made. Prints the plan and, for each candidate, when
the forward makes it, its copy time, when the backward first reads it, and whether it hides alone:

    python benchmarks/diagnostics/offload_plan_meta.py --model-name Llama-3-8B --block-size 8192

The rates are stated (``--to-host-gbps`` and the rest), not measured: a plan for an H200 by default.
"""

from __future__ import annotations

import argparse

from _meta_block import run_block_on_meta

from thunder_memopt import MemoryOptimization
from thunder_memopt.arguments import fraction, litgpt_model_name, positive_float, positive_int
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.core.trace import strip_deletions
from thunder_memopt.passes import offload as offload_pass

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    parser.add_argument("--block-size", type=positive_int, default=16384, help="sequence length T")
    parser.add_argument("--offload", choices=("auto", "budget"), default="auto")
    parser.add_argument("--budget", type=fraction, default=1.0, help="MemoryOptimization's activation_budget")
    parser.add_argument("--offload-budget", type=fraction,
                        help="MemoryOptimization's offload_budget, with --offload budget (default: --budget)")
    parser.add_argument("--to-host-gbps", type=positive_float, default=50.0)
    parser.add_argument("--to-device-gbps", type=positive_float, default=50.0)
    parser.add_argument("--tflops", type=positive_float, default=700.0, help="a large bf16 matmul's rate")
    parser.add_argument("--memory-tbps", type=positive_float, default=4.0, help="device memory bandwidth")
    args = parser.parse_args()
    if args.offload_budget is not None and args.offload != "budget":
        parser.error("--offload-budget applies to --offload budget")
    rates = DeviceRates(to_host=args.to_host_gbps * 1e9, to_device=args.to_device_gbps * 1e9,
                        flops=args.tflops * 1e12, memory=args.memory_tbps * 1e12)

    pairs = []  # the final forward and backward the plan is made from
    make_plan = offload_pass.plan_offload

    def recorded_plan(forward, backward, **options):
        # Copies: the forward handed back to Thunder takes the offloads in place afterwards.
        pairs.append((strip_deletions(forward), strip_deletions(backward)))
        return make_plan(forward, backward, **options)

    offload_pass.plan_offload = recorded_plan
    keep = {} if args.offload_budget is None else {"offload_budget": args.offload_budget}
    memopt = MemoryOptimization(activation_budget=args.budget, offload=args.offload, offload_rates=rates, **keep)
    # The first copy to the host cannot run on meta: the plan is made by then.
    run_block_on_meta(args.model_name, args.block_size, memopt, stop=NotImplementedError)
    t = args.block_size
    (plan,) = memopt.offload_plans
    print(f"{args.model_name} Block, T={t}, offload={args.offload!r} at budget {args.budget:g}, offload budget "
          f"{memopt.offload_budget:g}: {len(plan.offloaded)} tensors offloaded, {plan.offloaded_bytes / MIB:.1f} MiB "
          f"({len(plan.spilled)} spilled past the forward); "
          f"{plan.kept_bytes / MIB:.1f} MiB of saved activations kept on the device; "
          f"copies to the host hidden: {plan.to_host_hidden}; reload wait {plan.exposed_seconds * 1e3:.2f} ms; "
          f"region outputs donated an input: {memopt.donated_outputs}")
    (forward, backward), = pairs
    pair = offload_pass._Pair.of(forward, backward, rates)
    chained = offload_pass._is_chained(forward, backward)
    candidates, activation_bytes = offload_pass._candidates(forward, pair, offload_pass.MIN_BYTES)
    print(f"forward {pair.forward_times[-1] * 1e3:.2f} ms, backward {pair.backward_times[-1] * 1e3:.2f} ms, "
          f"saved activations {activation_bytes / MIB:.1f} MiB, chained: {chained}")
    print("| tensor | MiB | made at ms | copy ms | first backward read at ms | hides alone | reload wait alone ms | "
          "offloaded |")
    print("|---|---|---|---|---|---|---|---|")
    for c in sorted(candidates, key=lambda c: c.produced):
        hidden, wait = offload_pass._exposed([c], pair, rates, chained=chained)
        made = pair.forward_times[c.produced + 1] if c.produced >= 0 else 0.0
        print(f"| {c.name} | {c.nbytes / MIB:.1f} | {made * 1e3:.2f} | {c.nbytes / rates.to_host * 1e3:.2f} | "
              f"{pair.backward_times[c.first_read] * 1e3:.2f} | {hidden} | {wait * 1e3:.2f} | {c.name in plan.offloaded} |")


if __name__ == "__main__":
    main()
