"""cuDNN attention (thunder_memopt.executors.cudnn_attention_ex) against Thunder's sdpa executor.

For causal bf16 SDPA of a few shapes under ``thunder.jit``: forward and backward time (median of
CUDA-event timings), the relative error of the output and of each input's gradient against an fp32
eager reference, for the cuDNN executor and for Thunder's default (flash attention). Run on a GPU:

    python benchmarks/diagnostics/cudnn_attention.py
"""

from __future__ import annotations

import sys

import thunder
import torch
from _cuda_timing import median_cuda_ms

from thunder_memopt.executors import cudnn_attention_ex

SHAPES = [(1, 32, 8192, 80), (1, 32, 8192, 128), (2, 16, 2048, 64)]
REPEATS = 20


def attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    print("| shape (B, H, T, D) | executor | fwd+bwd ms | out rel err | dq | dk | dv | symbols |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref = attention(*ref_in)
        ref.backward(g.float())
        for name, executors in (("thunder sdpa (default)", None), ("cudnn_attention_ex", [cudnn_attention_ex])):
            jitted = thunder.jit(attention, executors=executors)

            def step():
                for t in (q, k, v):
                    t.grad = None
                out = jitted(q, k, v)
                out.backward(g)
                return out

            out = step()
            errors = [relative_error(out, ref)] + [relative_error(t.grad, r.grad) for t, r in zip((q, k, v), ref_in)]
            ms = median_cuda_ms(step, repeats=REPEATS, warmup=3)
            fw = thunder.last_traces(jitted)[-1]
            names = sorted({b.sym.name for b in fw.bound_symbols if "attention" in b.sym.name or "sdpa" in b.sym.name})
            print(f"| {shape} | {name} | {ms:.2f} | " + " | ".join(f"{e:.1e}" for e in errors) + f" | {', '.join(names)} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
