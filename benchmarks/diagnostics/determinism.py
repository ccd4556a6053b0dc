"""Which kernels do not repeat their bits under torch.use_deterministic_algorithms(True).

The long run (benchmarks/long_run.py) compares offload with its unoffloaded twin bit for bit, which
holds only if a setting repeats its own bits. This repeats one forward and backward of the same
weights on the same batch several times and names the parameters whose gradient differs from the
first repeat's, for each executor configuration:

- ``eager``: the model in eager PyTorch (torch's SDPA, flash);
- ``memopt``: thunder.jit with thunder_memopt's executors and MemoryOptimization(activation_budget=B);
- ``memopt-no-cudnn``: the same with ``executors(cudnn_attention=False)`` (Thunder's SDPA executor);
- ``memopt-no-fusion``: the same with ``executors(fusion=False)`` (no inductor regions, no fused head).

A configuration whose gradients differ and whose variant without one executor repeats points at
that executor's kernels. Run on a GPU:

    python benchmarks/diagnostics/determinism.py [--layers 2] [--seq-len 4096] [--repeats 6]
"""

from __future__ import annotations

import os
import sys

# cuBLAS reads it when it makes its first handle; without it, deterministic mode refuses cuBLAS.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import thunder  # noqa: E402
import torch  # noqa: E402

from _numerics_args import numerics_parser, parse_on_gpu  # noqa: E402
from thunder_memopt import MemoryOptimization, executors  # noqa: E402
from thunder_memopt.arguments import fraction, positive_int  # noqa: E402
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch  # noqa: E402

CONFIGURATIONS = {
    "eager": None,
    "memopt": {},
    "memopt-no-cudnn": {"cudnn_attention": False},
    "memopt-no-fusion": {"fusion": False},
}


def gradients(step, parameters, x, y) -> dict[str, torch.Tensor]:
    """Each parameter's gradient after one forward and backward, on the host."""
    for p in parameters.values():
        p.grad = None
    step(x, y).backward()
    return {name: p.grad.to("cpu") for name, p in parameters.items()}


def differing(config_name: str, options: dict | None, model_name: str, layers: int, seq_len: int,
              budget: float, repeats: int) -> dict[str, int]:
    """For each parameter whose gradient differs in some repeat from the first: in how many."""
    torch.manual_seed(0)
    config = narrow_config(model_name, n_layer=layers, block_size=seq_len)
    gpt = build_model(config, device="cuda")
    module = GPTWithLoss(gpt, upcast_logits=True)
    step = module if options is None else thunder.jit(
        module, executors=executors(**options), transforms=[MemoryOptimization(activation_budget=budget)])
    x, y = random_batch(config, batch_size=1, seq_len=seq_len, device="cuda")
    parameters = dict(gpt.named_parameters())
    first = gradients(step, parameters, x, y)
    counts: dict[str, int] = {}
    for _ in range(repeats - 1):
        for name, grad in gradients(step, parameters, x, y).items():
            if not torch.equal(grad, first[name]):
                counts[name] = counts.get(name, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = numerics_parser(__doc__, models=["stablecode-completion-alpha-3b"], seq_len=4096)
    parser.add_argument("--budget", type=fraction, default=0.0)
    parser.add_argument("--repeats", type=positive_int, default=6)
    parser.add_argument("--configurations", nargs="+", choices=sorted(CONFIGURATIONS), default=list(CONFIGURATIONS))
    parser.set_defaults(layers=2)
    args = parse_on_gpu(parser, argv)
    torch.use_deterministic_algorithms(True)
    for model_name in args.models:
        print(f"\n## {model_name}, {args.layers} layers, T={args.seq_len}, bf16, budget {args.budget:g}, "
              f"{args.repeats} repeats of one forward and backward, torch.use_deterministic_algorithms(True)\n")
        print("| configuration | parameters whose gradient differs from the first repeat (in how many repeats) |")
        print("|---|---|")
        for name in args.configurations:
            try:
                counts = differing(name, CONFIGURATIONS[name], model_name, args.layers, args.seq_len,
                                   args.budget, args.repeats)
                text = ", ".join(f"{p} ({n})" for p, n in sorted(counts.items())) or "none: every repeat bit-identical"
            except RuntimeError as error:  # an op without a deterministic kernel says which
                text = f"failed: {str(error).splitlines()[0]}"
            print(f"| {name} | {text} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
