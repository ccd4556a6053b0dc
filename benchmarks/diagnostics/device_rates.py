"""The GPU rates the offload plans and the fit's recompute times are made on, measured in this
process (``core.cost.measure_rates``): matmul TFLOP/s, device memory GB/s, and pinned host copies
GB/s each way. ``--cold`` measures the matmul rate as the package did up to ``32b375e``: the best of
three 4096-square bf16 matmuls after one, with no warm-up. One process is one sample; the spread
across fresh processes is what moves a plan:

    for i in 1 2 3 4 5; do python benchmarks/diagnostics/device_rates.py; python benchmarks/diagnostics/device_rates.py --cold; done
"""

from __future__ import annotations

import argparse
import sys

import torch

from thunder_memopt.core.cost import measure_rates


def cold_matmul_flops(device: torch.device) -> float:
    """The matmul rate as ``measure_rates`` measured it up to ``32b375e``."""
    n = 4096
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="the matmul rate measured as up to 32b375e")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_rates: needs a GPU")
        return 2
    device = torch.device("cuda")
    if args.cold:
        print(f"cold: matmul {cold_matmul_flops(device) / 1e12:.1f} TFLOP/s")
        return 0
    rates = measure_rates(device)
    print(f"measure_rates: matmul {rates.flops / 1e12:.1f} TFLOP/s, memory {rates.memory / 1e9:.0f} GB/s, "
          f"to host {rates.to_host / 1e9:.1f} GB/s, to device {rates.to_device / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
