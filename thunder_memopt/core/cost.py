"""What ops cost in time: their FLOPs, the bytes they move, and the seconds a device takes for them.

The recompute pass orders its expensive ops by FLOPs (``estimate_flops``). The offload pass asks
how long a trace computes, before and after each point, which tells the copies that hide behind
compute from those that would stall it (``op_seconds``, on a roofline of a ``DeviceRates``).
``measure_rates`` measures a GPU's rates once, at start-up.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, fields

import torch
from thunder.core.symbol import BoundSymbol

from thunder_memopt.core.memory import tensor_nbytes
from thunder_memopt.core.ops import FUSED_LOSS_HEAD_MATMULS, WINDOW_ARGUMENT, moves_data, op_names
from thunder_memopt.core.trace import is_bookkeeping, tensor_args, tensor_outs

__all__ = ["DeviceRates", "estimate_flops", "op_seconds", "measure_rates"]


@dataclass(frozen=True)
class DeviceRates:
    """A device's throughputs, in bytes or FLOPs per second."""

    to_host: float  # device -> pinned host copies
    to_device: float  # pinned host -> device copies
    flops: float  # a large bf16 matmul
    memory: float  # device memory (bytes read plus written by a copy)

    def __post_init__(self) -> None:
        # Each rate divides a size into seconds: zero, negative or NaN would make every plan wrong.
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"DeviceRates: {field.name} must be a number > 0, got {value!r}")
            if not value > 0:
                raise ValueError(f"DeviceRates: {field.name} must be > 0, got {value!r}")
            object.__setattr__(self, field.name, float(value))  # frozen: numpy's scalars become floats once


def estimate_flops(bsym: BoundSymbol) -> int:
    """Rough FLOPs of an expensive op: 2 x output elements x reduction length, and for the fused loss
    head 2 x tokens x hidden x vocabulary per product it runs."""
    args, outs = tensor_args(bsym), tensor_outs(bsym)
    if not outs:
        return 0
    out_numel = sum(int(o.numel) for o in outs)
    head_matmuls = FUSED_LOSS_HEAD_MATMULS.get(bsym.sym.name)
    if head_matmuls:
        # Its outputs are a scalar loss and gradients or the log-sum-exp, which say nothing of the
        # vocabulary; its first two matrices are the hidden state (tokens x hidden) and the weight.
        hidden, weight = [a for a in args if len(a.shape) == 2][:2]
        return 2 * head_matmuls * int(hidden.numel) * int(weight.shape[0])
    names = set(op_names(bsym))
    if names & {"scaled_dot_product_attention"} or any("sdpa" in n or "attention" in n for n in names):
        q = args[0]
        seq_k = int(args[1].shape[-2]) if len(args) > 1 else int(q.shape[-2])
        if bsym.sym.name in WINDOW_ARGUMENT:
            seq_k = min(seq_k, int(bsym.args[WINDOW_ARGUMENT[bsym.sym.name]]))
        return 4 * int(q.numel) * seq_k
    if args and len(args[0].shape) > 0 and names & {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm"}:
        return 2 * out_numel * int(args[0].shape[-1])
    return out_numel


def op_seconds(bsym: BoundSymbol, rates: DeviceRates) -> float:
    """The time of one bound symbol on the roofline: its FLOPs or the bytes it reads and writes,
    whichever takes longer. Views, unpacking and deletions take none."""
    if is_bookkeeping(bsym) or not moves_data(bsym):
        return 0.0
    moved = sum(tensor_nbytes(t) for t in (*tensor_args(bsym), *tensor_outs(bsym)))
    return max(estimate_flops(bsym) / rates.flops, moved / rates.memory)


# How long the matmul runs before its rate is timed, so that the clocks have risen.
_WARM_UP_SECONDS = 0.05


@functools.cache
def measure_rates(device: torch.device) -> DeviceRates:
    """A CUDA device's copy, matmul and memory rates, each the best of a few timed runs after the
    matmul has run for about ``_WARM_UP_SECONDS`` (so that the clocks have risen), measured once per
    process (about a tenth of a second). Timed cold, a 4096-square matmul's rate moved by 18%
    between processes on one H100, and the offload plans that hide copies behind the forward it
    models moved with it (docs/results.md, "The memory limit under a real cap")."""

    def seconds(run) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def best_seconds(run, repeats: int = 5) -> float:
        run()  # warm-up: kernels loaded, pinned blocks cached
        return min(seconds(run) for _ in range(repeats))

    nbytes = 256 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(dev)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    warm = 0.0
    while warm < _WARM_UP_SECONDS:
        warm += seconds(lambda: a @ b)
    return DeviceRates(
        to_host=nbytes / best_seconds(lambda: host.copy_(dev, non_blocking=True)),
        to_device=nbytes / best_seconds(lambda: dev.copy_(host, non_blocking=True)),
        flops=2 * n**3 / best_seconds(lambda: a @ b),
        memory=2 * nbytes / best_seconds(lambda: other.copy_(dev)),
    )
