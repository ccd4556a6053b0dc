"""The fused loss head (thunder_memopt.linear_cross_entropy) against the unfused head, on a GPU.

For the heads of stablecode (n_embd 2560, vocab 49152) and Llama-3-8B (4096, 128256) at T=8192 in
bf16: forward and backward time (median of CUDA-event timings), the peak memory above the inputs,
and the relative error of the loss and of each gradient against an fp32 reference, for
``F.cross_entropy(F.linear(h, W))`` in eager and under torch.compile (inductor), and for the fused
head both ways (the logits recomputed in the backward; the gradients computed in the forward). With
``--profile``, the fused head's top CUDA kernels. Run on a GPU:

    python benchmarks/diagnostics/loss_head.py
"""

from __future__ import annotations

import functools
import sys

import torch
from _cuda_timing import median_cuda_ms

from thunder_memopt.executors import linear_cross_entropy

HEADS = [("stablecode", 2560, 49152), ("Llama-3-8B", 4096, 128256)]
TOKENS = 8192
REPEATS = 10


def unfused(hidden, weight, targets):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight), targets)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def measure(fn, hidden, weight, targets):
    """(median ms of forward+backward, peak MiB above the inputs, loss, grads)."""

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, targets)
        loss.backward()
        return loss

    step()
    ms = median_cuda_ms(step, repeats=REPEATS, warmup=2)
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak, loss.detach(), (hidden.grad, weight.grad)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    print(f"T={TOKENS}, bf16; peak = max allocated above the inputs during forward+backward\n")
    profiles: list[str] = []
    print("| head | loss | fwd+bwd ms | peak MiB | loss rel err | d hidden | d weight |")
    print("|---|---|---|---|---|---|---|")
    for name, n_embd, vocab in HEADS:
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = (torch.randn(TOKENS, n_embd, device="cuda", generator=g)).bfloat16().requires_grad_()
        weight = (torch.randn(vocab, n_embd, device="cuda", generator=g) * n_embd**-0.5).bfloat16().requires_grad_()
        targets = torch.randint(0, vocab, (TOKENS,), device="cuda", generator=g)
        ref_h, ref_w = (t.detach().float().requires_grad_() for t in (hidden, weight))
        ref = unfused(ref_h, ref_w, targets)
        ref.backward()
        in_forward = functools.partial(linear_cross_entropy, gradients_in_forward=True)
        for label, fn in (("eager F.cross_entropy", unfused), ("inductor", torch.compile(unfused)),
                          ("linear_cross_entropy (logits recomputed in backward)", linear_cross_entropy),
                          ("linear_cross_entropy (gradients in forward)", in_forward)):
            ms, peak, loss, (gh, gw) = measure(fn, hidden, weight, targets)
            print(f"| {name} | {label} | {ms:.2f} | {peak:.0f} | {relative_error(loss, ref.detach()):.1e} | "
                  f"{relative_error(gh, ref_h.grad):.1e} | {relative_error(gw, ref_w.grad):.1e} |", flush=True)
            if "--profile" in sys.argv and fn in (linear_cross_entropy, in_forward):
                profiles.append(f"{name}, {label}:\n" + profile(fn, hidden, weight, targets))
        del ref_h, ref_w, ref
    for table in profiles:
        print("\n```\n" + table + "```")
    return 0


def profile(fn, hidden, weight, targets) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(hidden, weight, targets).backward()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60)


if __name__ == "__main__":
    sys.exit(main())
