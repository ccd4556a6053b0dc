"""Which elementwise ops does inductor (EAGER_NUMERICS options) compute bit-identically to ATen on CUDA?"""
import torch
from thunder_memopt.executors.fusion import EAGER_NUMERICS
torch.manual_seed(0)
n = 1 << 20
x = torch.randn(n, device="cuda") * 3
x[:1000] = torch.rand(1000, device="cuda") * 1e-39  # denormals
y = torch.randn(n, device="cuda") * 3
pos = x.abs() + 1e-3
b = x.to(torch.bfloat16)
unary = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
         "log": lambda t: torch.log(t.abs() + 1e-3), "log1p": lambda t: torch.log1p(t.abs()), "log2": lambda t: torch.log2(t.abs() + 1e-3),
         "sqrt": lambda t: torch.sqrt(t.abs()), "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-5), "reciprocal": torch.reciprocal,
         "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "erfc": torch.erfc, "sin": torch.sin, "cos": torch.cos,
         "sign": torch.sign, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
         "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"), "relu": torch.relu,
         "bf16_roundtrip": lambda t: t.to(torch.bfloat16).to(torch.float32)}
binary = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": lambda a, c: torch.pow(a.abs() + 1e-3, c),
          "maximum": torch.maximum, "minimum": torch.minimum, "where": lambda a, c: torch.where(a > c, a, c),
          "mul_add": lambda a, c: a * c + a, "mul_sub_mul": lambda a, c: (a - c) * c * 0.5}
res = {}
for name, f in unary.items():
    for dt, inp in (("fp32", x), ("bf16", b)):
        try:
            torch._dynamo.reset()
            g = lambda t, f=f: f(t)
            eager = f(inp); comp = torch.compile(g, fullgraph=True, dynamic=False, options=EAGER_NUMERICS)(inp)
            res[f"{name}[{dt}]"] = torch.equal(eager, comp)
        except Exception as e:
            res[f"{name}[{dt}]"] = f"error {type(e).__name__}"
for name, f in binary.items():
    torch._dynamo.reset()
    g = lambda a, c, f=f: f(a, c)
    eager = f(x, y); comp = torch.compile(g, fullgraph=True, dynamic=False, options=EAGER_NUMERICS)(x, y)
    res[name] = torch.equal(eager, comp)
print("EXACT:", sorted(k for k, v in res.items() if v is True))
print("DIFFER:", sorted(k for k, v in res.items() if v is not True))
