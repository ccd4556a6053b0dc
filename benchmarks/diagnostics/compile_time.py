"""Where a thunder+memopt first step goes, with cold compile caches (issue 13: the first step may
take at most 1.5x plain Thunder's).

Builds a litgpt model with its in-graph loss under ``thunder.jit`` with thunder_memopt's executors
and MemoryOptimization, runs three training steps, and prints: each step's seconds; the fusion
regions' compiled functions (how many, the seconds of their first calls, the slowest ones with
their ops); and torch's own compile-phase times (dynamo, AOT, inductor). ``--inductor KEY=VALUE``
sets an inductor config option for a what-if. Run on a GPU:

    python benchmarks/diagnostics/compile_time.py --n-layer 4 --block-size 8192
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter


def inductor_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for parse in (int, float):
        try:
            return key, parse(value)
        except ValueError:
            pass
    return key, {"True": True, "False": False}.get(value, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", default="stablecode-completion-alpha-3b")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=8192)
    parser.add_argument("--plain", action="store_true", help="plain Thunder: no executors of ours, no transform")
    parser.add_argument("--inductor", type=inductor_option, action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=12, help="slowest compiled functions to list")
    parser.add_argument("--cache-dir", help="inductor's and Triton's caches here, kept (a second run measures a warm "
                        "start); by default, a new empty directory: cold caches, as the benchmark's rows have")
    args = parser.parse_args()
    # Before torch is imported.
    cache = args.cache_dir or tempfile.mkdtemp(prefix="memopt_compile_time_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")

    import thunder
    import torch

    import thunder_memopt
    from thunder_memopt.executors import fusion
    from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    for key, value in args.inductor:
        setattr(torch._inductor.config, key, value)
    config = narrow_config(args.model_name, n_layer=args.n_layer, block_size=args.block_size)
    model = GPTWithLoss(build_model(config, device="cuda"))
    x, y = random_batch(config, batch_size=1, seq_len=args.block_size, device="cuda")
    if args.plain:
        jitted = thunder.jit(model)
    else:
        jitted = thunder.jit(model, executors=thunder_memopt.executors(),
                             transforms=[thunder_memopt.MemoryOptimization()])
    for step in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        jitted(x, y).backward()
        torch.cuda.synchronize()
        print(f"step {step}: {time.perf_counter() - start:.2f} s", flush=True)
    stats = fusion.compile_stats()
    print(f"\nfusion: {stats.functions} functions, {stats.compiled} compiled, {stats.compile_seconds:.2f} s "
          f"(lowering {stats.lowering_seconds:.2f} s, waiting for kernels {stats.kernel_wait_seconds:.2f} s); "
          f"input layouts compiled ahead {stats.layouts_ahead}, at a first call {stats.layouts_at_call}")
    cache_counters = {k: v for k, v in torch._dynamo.utils.counters["inductor"].items() if "cache" in k}
    print(f"inductor caches: {cache_counters}")
    slowest = sorted(fusion._compiled_functions.items(), key=lambda kv: -(kv[1].seconds or 0))[: args.top]
    for (canonical, _), fn in slowest:
        ops = Counter(op for op, *_ in canonical[0])
        print(f"  {fn.seconds or 0:6.2f} s  {sum(ops.values()):3d} ops: "
              + ", ".join(f"{op.split('.')[-1]}x{k}" for op, k in ops.most_common(6)))
    print("\n" + torch._dynamo.utils.compile_times(repr="str", aggregate=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
