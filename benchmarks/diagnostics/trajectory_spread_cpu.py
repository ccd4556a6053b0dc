"""How far apart two eager trainings end when they start one bf16 rounding step apart, with and
without gradient clipping: the noise floor of the long run's tail-loss criterion (issue 36).

Two backends that round differently start to differ in the first steps; a chaotic training carries
that difference into a loss curve of its own, and the mean loss over the last steps then differs
by what the chaos makes of it, not by any error. This trains a narrowed stablecode eagerly in bf16
on the long run's data (``benchmarks/fsdp2/long_run.py``: the standard library's bytes, AdamW, a
linear warm-up and a cosine learning rate), once as it is and once per ``--perturbations`` with one
weight of the first attention's projection moved by one bf16 step (``long_run.perturb_one_weight``,
the long run's perturbed-eager control), for each learning rate and clipping norm, and prints the
tail mean's relative difference from the unperturbed run's:

    python benchmarks/diagnostics/trajectory_spread_cpu.py --lrs 1e-3 3e-3 --max-grad-norms 0 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.fsdp2
from benchmarks.fsdp2.long_run import (ByteBatches, Corpus, Schedule, clip_gradients_before_each_step,  # noqa: E402
                                       perturb_one_weight, with_byte_vocabulary)
from thunder_memopt.arguments import non_negative_float, non_negative_int, positive_float, positive_int  # noqa: E402
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, training_step  # noqa: E402


def tail_loss(args: argparse.Namespace, corpus: Corpus, lr: float, max_norm: float, perturbation: int | None) -> float:
    """The mean loss of the last ``args.tail`` steps of one eager training."""
    config = with_byte_vocabulary(narrow_config("stablecode-completion-alpha-3b", n_layer=args.n_layer,
                                                n_embd=args.n_embd, block_size=args.block_size))
    gpt = build_model(config, dtype=torch.bfloat16, seed=0)
    if perturbation is not None:
        perturb_one_weight(gpt, perturbation)
    model = GPTWithLoss(gpt, upcast_logits=True)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=lr, foreach=True)
    scheduler = Schedule(lr, args.steps // 10).scheduler(optimizer, args.steps)
    if max_norm:
        clip_gradients_before_each_step(optimizer, list(gpt.parameters()), max_norm)
    batches = ByteBatches(corpus.data, seq_len=args.block_size, micro_batch=1, world_size=1, rank=0, seed=0)
    losses = []
    for step in range(args.steps):
        losses.append(training_step(model, optimizer, *batches.batch(step, torch.device("cpu"))).item())
        scheduler.step()
    return sum(losses[-args.tail:]) / args.tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=positive_int, default=2)
    parser.add_argument("--n-embd", type=positive_int, default=256)
    parser.add_argument("--block-size", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=500)
    parser.add_argument("--tail", type=positive_int, default=50)
    parser.add_argument("--lrs", type=positive_float, nargs="+", default=[1e-3, 3e-3])
    parser.add_argument("--max-grad-norms", type=non_negative_float, nargs="+", default=[0.0, 1.0],
                        help="0: no clipping")
    parser.add_argument("--perturbations", type=non_negative_int, default=2, help="perturbed runs per setting")
    args = parser.parse_args()
    if args.tail > args.steps:
        parser.error(f"--tail {args.tail} exceeds --steps {args.steps}")
    corpus = Corpus.read()
    print(f"stablecode narrowed to {args.n_layer} layers, n_embd {args.n_embd}, T={args.block_size}, bf16, eager, "
          f"{args.steps} steps; mean loss over the last {args.tail}\n")
    print("| lr | clipping norm | tail loss | perturbed runs against it |\n|---|---|---|---|")
    for lr in args.lrs:
        for max_norm in args.max_grad_norms:
            base = tail_loss(args, corpus, lr, max_norm, None)
            spread = [tail_loss(args, corpus, lr, max_norm, seed) / base - 1
                      for seed in range(1, args.perturbations + 1)]
            print(f"| {lr:g} | {max_norm:g} | {base:.4f} | {', '.join(f'{d:+.2%}' for d in spread)} |", flush=True)


if __name__ == "__main__":
    main()
