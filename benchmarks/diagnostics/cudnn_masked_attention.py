"""cuDNN attention with a sliding-window boolean mask through thunder_memopt's executor, against
torch's math kernel in fp32: output and gradients; also torch's own dispatch and the memory-efficient kernel."""
import torch, thunder, time
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
import thunder_memopt

torch.manual_seed(0)
print("cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(), torch.__version__)
for D, T, window in ((256, 2048, 512), (128, 2048, 512), (256, 8192, 4096)):
    B, H = 1, 8
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    i = torch.arange(T, device="cuda")
    mask = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window))[None, None]

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def grads(fn, *a):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, mask)
        out.backward(g)
        torch.cuda.synchronize()
        return [out.detach().float()] + [t.grad.float() for t in (q, k, v)]

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
        o.backward(g.float())
    ref = [o.detach(), q32.grad, k32.grad, v32.grad]
    jf = thunder.jit(f, executors=thunder_memopt.executors())
    results = {"memopt (thunder.jit)": grads(jf)}
    names = [b.sym.name for b in thunder.last_traces(jf)[-1].bound_symbols]
    results["torch dispatch"] = grads(f)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        results["mem-efficient"] = grads(f)
    print(f"D={D} T={T} window={window}: memopt trace attention symbols:",
          [n for n in names if "sdpa" in n or "attention" in n])
    for name, r in results.items():
        errs = [(a - b).abs().max().item() / b.abs().max().item() for a, b in zip(r, ref)]
        print(f"  {name:22s} max rel err out/dq/dk/dv: " + " ".join(f"{e:.2e}" for e in errs))
    for name, fn in (("memopt", jf), ("torch dispatch", f)):
        for _ in range(2):
            grads(fn)
        t0 = time.perf_counter()
        for _ in range(5):
            grads(fn)
        print(f"  {name:22s} fwd+bwd {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms")
