"""Offload on CUDA against the same configuration without it: bit-identical training, less memory.

For each model (litgpt config at its real width, a few layers, bf16, in-graph cross-entropy, under
``thunder.jit`` with thunder_memopt's executors and ``MemoryOptimization(activation_budget=B)``):
three AdamW steps with ``offload="off"``, again with it (a control: some CUDA backward kernels,
attention's among them, accumulate with atomics and do not repeat bit for bit), and with
``offload="budget"``. Offload passes where its largest gradient difference from the first run is no
larger than the control's (bit-identical where the control is); the copies run on a side stream,
so this is also a check of their synchronization. The peaks of allocated memory of the first step
(compilation included) and of the next two are reported, with what the plan moved to the host.
Run on a GPU:

    python benchmarks/diagnostics/offload_numerics.py [--layers 4] [--seq-len 8192] [--budget 0.0]
"""

from __future__ import annotations

import sys

import thunder
import torch

from _numerics_args import numerics_parser, parse_on_gpu
from thunder_memopt import MemoryOptimization, executors
from thunder_memopt.arguments import fraction
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

STEPS = 3
LEARNING_RATE = 1e-4
GIB = 1 << 30


def run(model_name: str, offload: str, layers: int, seq_len: int, budget: float):
    """(losses, gradients of every step, peak bytes allocated in the first step and in the others,
    the transform, the tensors the forward offloads)."""
    torch.manual_seed(0)
    config = narrow_config(model_name, n_layer=layers, block_size=seq_len)
    gpt = build_model(config, device="cuda")
    memopt = MemoryOptimization(activation_budget=budget, offload=offload)
    step = thunder.jit(GPTWithLoss(gpt), executors=executors(), transforms=[memopt])
    x, y = random_batch(config, batch_size=1, seq_len=seq_len, device="cuda")
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=LEARNING_RATE)
    losses, grads, peaks = [], [], []
    for i in range(STEPS):
        if i < 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        loss = step(x, y)
        loss.backward()
        losses.append(loss.detach().to("cpu"))
        # Kept on the host, so that the peaks measured are the run's own.
        grads.append({n: p.grad.to("cpu") for n, p in gpt.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    torch.cuda.synchronize()
    peaks.append(torch.cuda.max_memory_allocated())
    copies = [b.args[0] for b in thunder.last_traces(step)[-1].bound_symbols if b.sym.name == "memopt_offload"]
    return losses, grads, peaks, memopt, copies


def largest_difference(a, b) -> float:
    """The largest absolute difference between two runs' gradients, over every step and parameter."""
    return max((ga[n].float() - gb[n].float()).abs().max().item() for ga, gb in zip(a[1], b[1]) for n in ga)


def main(argv: list[str] | None = None) -> int:
    parser = numerics_parser(__doc__, models=["stablecode-completion-alpha-3b"], seq_len=8192)
    parser.add_argument("--budget", type=fraction, default=0.0)
    args = parse_on_gpu(parser, argv)
    failed = False
    for model_name in args.models:
        off = run(model_name, "off", args.layers, args.seq_len, args.budget)
        control = run(model_name, "off", args.layers, args.seq_len, args.budget)
        on = run(model_name, "budget", args.layers, args.seq_len, args.budget)
        noise, difference = largest_difference(off, control), largest_difference(off, on)
        same_losses = all(torch.equal(a, b) for a, b in zip(off[0], on[0]))
        ok = difference <= noise
        failed |= not ok
        plans = on[3].offload_plans
        print(f"\n## {model_name}, {args.layers} layers, T={args.seq_len}, bf16, budget {args.budget:g}\n")
        print(f"- losses, offload off: {[round(v.item(), 5) for v in off[0]]}; on: {[round(v.item(), 5) for v in on[0]]}"
              f" (bit-identical: {same_losses})")
        print(f"- largest gradient difference over {STEPS} steps: offload off run twice {noise:.3g}, "
              f"off against on {difference:.3g}: {'PASS' if ok else 'FAIL'}")
        for name, result in (("without offload", off), ("with offload", on)):
            print(f"- peak allocated {name}: first step {result[2][0] / GIB:.2f} GiB, next steps {result[2][1] / GIB:.2f} GiB")
        print(f"- offloaded {sum(p.offloaded_bytes for p in plans) / GIB:.3f} GiB in {len(plans)} plan(s), "
              f"{sum(len(p.offloaded) for p in plans)} tensors; kept {sum(p.kept_bytes for p in plans) / GIB:.3f} GiB; "
              f"model's exposed reload time {1e3 * sum(p.exposed_seconds for p in plans):.2f} ms")
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in on[4])
        print(f"- offloaded tensors: {shapes}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
