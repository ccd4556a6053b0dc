"""torchrun worker: FSDP2 (``fully_shard`` per Block) under thunderfx_backend, against eager FSDP2.

Runs zero2 and zero3 (``reshard_after_forward`` False/True) with dynamo skipping FSDP hooks, and
zero3 with ``skip_fsdp_hooks=False``, where functional collectives reach the backend. Writes, from
rank 0, losses, the largest sharded-gradient difference and the number of collective nodes the
backend kept out of Thunder to the JSON path in argv[1].
"""

from __future__ import annotations

import sys

import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import thunder_memopt.backend as backend_module
from thunder_memopt.collectives import keep_collectives_out_of_thunder
from _common import finish, max_grad_diff
from thunder_memopt.models import build_model, narrow_config, random_batch

CONFIG = narrow_config("pythia-14m", n_layer=2, n_embd=256, block_size=128)


def step(reshard: bool, compiled: bool):
    model = build_model(CONFIG, dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend=backend_module.thunderfx_backend())
    x, y = random_batch(CONFIG, batch_size=2, seq_len=64)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def sharded_grad_diff(ref: dict, got: dict) -> float:
    strip = lambda n: n.removeprefix("_orig_mod.")  # noqa: E731 - torch.compile's wrapper prefix
    return max_grad_diff(ref, {strip(n): g for n, g in got.items()})


def count_hidden_collectives() -> list[int]:
    """Wrap the guard so the run records how many collective nodes each dynamo graph had."""
    counts: list[int] = []

    def counting(gm) -> int:
        counts.append(keep_collectives_out_of_thunder(gm))
        return counts[-1]

    backend_module.keep_collectives_out_of_thunder = counting
    return counts


def main(path: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for name, reshard, skip_hooks in (("zero2", False, True), ("zero3", True, True), ("zero3_hooks_traced", True, False)):
        torch._dynamo.config.skip_fsdp_hooks = skip_hooks
        ref_loss, ref_grads = step(reshard, compiled=False)
        counts = count_hidden_collectives()
        loss, grads = step(reshard, compiled=True)
        results[name] = {
            "ref_loss": ref_loss,
            "loss": loss,
            "max_grad_diff": sharded_grad_diff(ref_grads, grads),
            "collectives_kept_out": sum(counts),
        }
    finish(path, results)


if __name__ == "__main__":
    main(sys.argv[1])
