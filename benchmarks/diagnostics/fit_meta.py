"""The memory-limit planner's choices for a real-width Block, traced on the meta device and counted
over every layer of a step (issue 35).

One Block of ``--model-name`` at its real width and ``--block-size`` tokens is traced on meta as the
GPU's executors make it (``_meta_block``) under ``MemoryOptimization(memory_limit=1, over_limit="lowest")``, which no
rung fits, so that every rung of the recompute ladder is planned and priced. Each rung is then
priced for a whole step in which the Block's program runs ``--calls`` times over ``--static-gib``
of static state (``passes.fit.StepTerms``), and for each of ``--limits-gib`` the rung the planner
takes is printed (``passes.fit.choose_by_limit``):

    python benchmarks/diagnostics/fit_meta.py --model-name Llama-3-8B --block-size 8192 --calls 32 \\
        --static-gib 16 --limits-gib 60 40 30 25

The static state and the calls are stated, not measured: on meta there is no allocator to read.
Recompute seconds are on ``fit.NOMINAL_RATES`` (an H200's datasheet figures). The recompute pass's
seconds for the Block are the planning time.
"""

from __future__ import annotations

import argparse
import warnings

from _meta_block import run_block_on_meta

from thunder_memopt import MemoryOptimization
from thunder_memopt.arguments import litgpt_model_name, positive_float, positive_int
from thunder_memopt.passes import fit

MIB, GIB = 2**20, 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", type=litgpt_model_name, default="Llama-3-8B")
    parser.add_argument("--block-size", type=positive_int, default=8192, help="sequence length T")
    parser.add_argument("--calls", type=positive_int, default=32, help="Blocks per step (calls of the program)")
    parser.add_argument("--static-gib", type=positive_float, default=16.0,
                        help="parameters, gradients, optimizer states and buffers resident through the step")
    parser.add_argument("--limits-gib", type=positive_float, nargs="+", default=[60.0, 40.0, 30.0, 25.0])
    args = parser.parse_args()
    memopt = MemoryOptimization(memory_limit=1, over_limit="lowest")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "thunder_memopt: no recompute plan fits")
        run_block_on_meta(args.model_name, args.block_size, memopt)
    (block,) = memopt.fit_report.choices
    terms = fit.StepTerms(static_bytes=int(args.static_gib * GIB), calls=args.calls)
    print(f"{args.model_name} Block, T={args.block_size}, {args.calls} calls a step over {args.static_gib:g} GiB "
          f"of static state; {len(block.rungs)} rungs planned and priced in "
          f"{memopt.pass_seconds['recompute']:.2f} s (the recompute pass)")
    print("| rung | saved MiB per Block | Block's own peak MiB | recompute ms | whole-step peak GiB |")
    print("|---|---|---|---|---|")
    for k, rung in enumerate(block.rungs):
        print(f"| {k} | {rung.saved_bytes / MIB:.0f} | {rung.pair_peak_bytes / MIB:.0f} | "
              f"{rung.recompute_seconds * 1e3:.3f} | {terms.peak(rung) / GIB:.2f} |")
    print()
    print("| limit GiB | rung taken | predicted GiB | fits |")
    print("|---|---|---|---|")
    for limit in args.limits_gib:
        choice = fit.choose_by_limit(block.rungs, terms, int(limit * GIB))
        print(f"| {limit:g} | {choice.rung} | {choice.predicted_peak_bytes / GIB:.2f} | {choice.fits} |")


if __name__ == "__main__":
    main()
