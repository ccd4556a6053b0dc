"""One attention's forward and backward at Phi-3's, Gemma-2's and Mistral's shapes (T=8192, bf16), by kernel:
cuDNN and memory-efficient with the window as an additive bias (what runs where the mask is kept), cuDNN and
flash causal (no window: a bound), and flash's window kernel that executors/window_attention.py runs.
Prints the median ms of each and the window kernel's largest error against fp32 SDPA with the mask.

    python benchmarks/diagnostics/window_attention_speed.py      (CUDA)
"""
import torch
import torch.nn.functional as F
from _cuda_timing import median_cuda_ms
from torch.nn.attention import SDPBackend, sdpa_kernel

from thunder_memopt.executors.window_attention import _flash_backward, _flash_forward

SHAPES = (("phi3", 32, 96, 2047), ("gemma2", 8, 256, 4096), ("mistral", 32, 128, 4096))  # name, heads, head size, window


def window_mask(t: int, w: int) -> torch.Tensor:
    i = torch.arange(t, device="cuda")
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < w)


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name, h, d, w in SHAPES:
        t = 8192
        q, k, v = (torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16)
        mask = window_mask(t, w)
        bias = torch.zeros(t, t, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))

        def sdpa(backend, **kwargs):
            def step():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                torch.autograd.grad(out, (q, k, v), g)
            return step

        def flash_window():
            qt, kt, vt = (x.detach().transpose(1, 2) for x in (q, k, v))
            out, lse = _flash_forward(qt, kt, vt, w, None)
            _flash_backward(g.transpose(1, 2), qt, kt, vt, out, lse, w, None)

        result = {}
        for label, step in (("cudnn_bias", sdpa(SDPBackend.CUDNN_ATTENTION, attn_mask=bias)),
                            ("efficient_bias", sdpa(SDPBackend.EFFICIENT_ATTENTION, attn_mask=bias)),
                            ("cudnn_causal", sdpa(SDPBackend.CUDNN_ATTENTION, is_causal=True)),
                            ("flash_causal", sdpa(SDPBackend.FLASH_ATTENTION, is_causal=True)),
                            ("flash_window", flash_window)):
            result[label] = round(median_cuda_ms(step, repeats=10, warmup=3), 2)
        with torch.no_grad():
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            out, _ = _flash_forward(qt, kt, vt, w, None)
            reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            bf16_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        result["err_flash_vs_fp32"] = float((out.transpose(1, 2).float() - reference).abs().max())
        result["err_bf16sdpa_vs_fp32"] = float((bf16_sdpa.float() - reference).abs().max())
        print(name, dict(h=h, d=d, w=w, t=t), result, flush=True)


if __name__ == "__main__":
    main()
