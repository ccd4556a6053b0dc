"""Train a litgpt model under thunder.jit with thunder_memopt's executors and MemoryOptimization, on
a GPU or, without one, on CPU (where the fusion executor, CUDA's, claims nothing).

The loss is computed inside the jitted module (``GPTWithLoss``), so that the loss_head pass can fuse
the head with its cross-entropy. Each flag is the MemoryOptimization option of the same name:

    python examples/jit_single_device.py --model-name pythia-160m --n-layer 4 --steps 5
    python examples/jit_single_device.py --activation-budget 0.0 --offload budget   # long context
    python examples/jit_single_device.py --offload budget --offload-budget 0.5   # half the saved bytes to the host
    python examples/jit_single_device.py --memory-limit 40GiB   # the fastest plan predicted to fit (GPU: checked)
"""

import argparse
import time

import thunder
import torch

from thunder_memopt import MemoryOptimization, executors
from thunder_memopt.arguments import fraction, litgpt_model_name, memory_limit, positive_int
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    p.add_argument("--n-layer", type=positive_int, default=2)
    p.add_argument("--block-size", type=positive_int, default=None, help="default: 2048 on GPU, 256 on CPU")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--activation-budget", type=fraction, default=1.0,
                   help="MemoryOptimization(activation_budget=...), in [0, 1]")
    p.add_argument("--offload", choices=["off", "auto", "budget"], default="off",
                   help="MemoryOptimization(offload=...): saved tensors to pinned host memory (CUDA only)")
    p.add_argument("--offload-budget", type=fraction, default=None,
                   help="MemoryOptimization(offload_budget=...) with --offload budget: the share of saved bytes "
                        "left on the GPU (default: --activation-budget)")
    p.add_argument("--memory-limit", type=memory_limit, default=None,
                   help="MemoryOptimization(memory_limit=...): bytes (40GiB or 4e10), a fraction of the GPU's memory "
                        "(0.9) or auto, instead of --activation-budget")
    args = p.parse_args()
    if args.offload_budget is not None and args.offload != "budget":
        p.error("--offload-budget applies to --offload budget")
    if args.memory_limit is not None and args.activation_budget != 1.0:
        p.error("--memory-limit and --activation-budget each choose the recompute plan; give one of them")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    block_size = args.block_size or (2048 if on_gpu else 256)
    # On CPU the model is narrowed to width 256 so that it runs anywhere.
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=None if on_gpu else 256, block_size=block_size)
    model = GPTWithLoss(build_model(cfg, device=device))
    memopt = MemoryOptimization(activation_budget=args.activation_budget, offload=args.offload,
                                offload_budget=args.offload_budget, memory_limit=args.memory_limit)
    jitted = thunder.jit(model, executors=executors(), transforms=[memopt])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)

    for step in range(args.steps):
        x, y = random_batch(cfg, batch_size=1, seq_len=block_size, device=device, seed=step)
        start = time.perf_counter()
        loss = jitted(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if on_gpu else ""
        if memopt.memory_limit is not None:
            # On a GPU the peak so far is checked against the prediction (and, once, planned again).
            replan = on_gpu and memopt.check_fit().replan
            report = memopt.fit_report
            peak += (f", limit {report.limit_bytes / 2**30:.2f} GiB, predicted "
                     f"{report.predicted_peak_bytes / 2**30:.2f}{' (planned again)' if replan else ''}")
        print(f"step {step}: loss {loss.item():.4f}, {time.perf_counter() - start:.2f} s{peak}", flush=True)


if __name__ == "__main__":
    main()
