"""torchrun worker: thunder fsdp (ZERO2, ZERO3) with and without MemoryOptimization's collectives pass.

``report`` gives, for each strategy, losses, the largest sharded-gradient difference (gathered from
every rank), trace facts and estimated peaks; run on its own, rank 0 writes them as JSON to the path
given as argv[1]. tests/test_collectives.py asserts on them (through all_workers.py).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import thunder
from thunder.distributed import FSDPType, fsdp

from thunder_memopt.core.memory import saved_for_backward, storage_roots
from thunder_memopt.core.trace import strip_deletions, tensor_args
from thunder_memopt.passes.collectives import ALL_GATHER, REDUCE_SCATTER, WAIT, collective_bytes_at_peak
from _common import finish, max_grad_diff
from thunder_memopt.models import build_model, narrow_config, random_batch
from thunder_memopt.transform import MemoryOptimization

PREFETCH = 2


def run(strategy: FSDPType, transforms: list):
    cfg = narrow_config("pythia-14m", n_layer=2, n_embd=256, block_size=128)
    model = build_model(cfg, dtype=torch.float32)
    tm = fsdp(thunder.jit(model, transforms=transforms), device=torch.device("cpu"), sharding_strategy=strategy)
    x, y = random_batch(cfg, batch_size=2, seq_len=64)
    loss = torch.nn.functional.cross_entropy(tm(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in tm.named_parameters()}
    return loss.item(), grads, thunder.last_traces(tm)[-1], thunder.last_backward_traces(tm)[-1]


def max_in_flight(trace) -> int:
    """Most all-gathers issued and not yet waited on at any point."""
    futures, most = set(), 0
    for b in trace.bound_symbols:
        if b.sym.name == ALL_GATHER:
            futures.add(b.flat_proxy_outs[0].name)
            most = max(most, len(futures))
        elif b.sym.name == WAIT:
            futures.discard(b.flat_proxy_args[0].name)
    return most


def scatters_before_next_gradient(trace) -> bool:
    """Each gradient's reduce-scatter is issued before the next gradient's producer runs."""
    bsyms = strip_deletions(trace).bound_symbols
    producer = {o.name: i for i, b in enumerate(bsyms) for o in b.flat_proxy_outs if hasattr(o, "name")}

    def grad_index(i: int) -> int:  # walk back through the `/ world_size` to the gradient itself
        name = tensor_args(bsyms[i])[0].name
        j = producer[name]
        return producer[tensor_args(bsyms[j])[0].name] if bsyms[j].sym.name.endswith("divide") else j

    rs = sorted((grad_index(i), i) for i, b in enumerate(bsyms) if b.sym.name == REDUCE_SCATTER)
    return all(issue < next_grad for (_, issue), (next_grad, _) in zip(rs, rs[1:]))


def saved_unsharded(fw) -> list[str]:
    """Saved tensors whose storage is an all-gathered (unsharded) parameter."""
    bsyms = strip_deletions(fw).bound_symbols
    infos = storage_roots(fw)
    gathered = {b.flat_proxy_outs[0].name for b in bsyms if b.sym.name == WAIT}
    return [t.name for t in saved_for_backward(fw).tensors if infos[t.name].storage in gathered]


def report() -> dict:
    """What each strategy's step did, without and with MemoryOptimization (the process group initialized)."""
    results = {}
    for strategy in (FSDPType.ZERO2, FSDPType.ZERO3):
        ref_loss, ref_grads, ref_fw, ref_bw = run(strategy, [])
        loss, grads, fw, bw = run(strategy, [MemoryOptimization(prefetch=PREFETCH)])
        results[strategy.name] = {
            "ref_loss": ref_loss,
            "loss": loss,
            "max_grad_diff": max_grad_diff(ref_grads, grads),
            "prefetch": PREFETCH,
            "in_flight": {"ref_fw": max_in_flight(ref_fw), "fw": max_in_flight(fw), "bw": max_in_flight(bw)},
            "scatters_early": {"ref": scatters_before_next_gradient(ref_bw), "opt": scatters_before_next_gradient(bw)},
            "saved_unsharded": {"ref": saved_unsharded(ref_fw), "opt": saved_unsharded(fw)},
            "peaks": {
                name: collective_bytes_at_peak(t).__dict__
                for name, t in (("ref_fw", ref_fw), ("fw", fw), ("ref_bw", ref_bw), ("bw", bw))
            },
        }
    return results


def main(path: str) -> None:
    dist.init_process_group("gloo")
    finish(path, report())


if __name__ == "__main__":
    main(sys.argv[1])
