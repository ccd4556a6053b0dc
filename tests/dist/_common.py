"""What the torchrun workers share: the cross-rank gradient comparison, the rank-0 JSON report, and
the process settings of tests/_faster_tracing.py (applied on import)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
import _faster_tracing  # noqa: E402

_faster_tracing.apply()


def max_grad_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """The largest difference between this rank's gradient shards, over every rank."""
    local = max((ref[n] - got[n]).abs().max().item() for n in ref)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return max(out)


def finish(path: str, results: dict) -> None:
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    # Gloo's worker threads can still free a finished collective's tensors while the interpreter shuts
    # down; taking the GIL then aborts the process ("terminate called without an active exception",
    # pytorch/pytorch#190489). The results are written, so leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
