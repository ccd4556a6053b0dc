"""torchrun worker: FSDP2 (``fully_shard`` per Block) under thunderfx_backend, against eager FSDP2
and against plain ThunderCompiler (the same run without MemoryOptimization), and, for zero2 and
zero3, with offload against without it.

Runs zero2 and zero3 (``reshard_after_forward`` False/True) with dynamo skipping FSDP hooks, zero3
with ``skip_fsdp_hooks=False``, where functional collectives reach the backend, and zero3 under
``torch.autocast(bf16)`` over fp32 parameters, where the trace casts weights. Then a module that
calls a functional all-reduce in its forward, so that ``wait_tensor`` reaches the backend for
certain (FSDP2 in torch 2.11 does not put its collectives in the dynamo graph on gloo). ``report``
gives (rank 0 writes it to argv[1] when run on its own) losses, the largest sharded-gradient
differences, the number of collective nodes the backend kept out of Thunder and the
parameter-derived tensors each variant saves for backward.
"""

from __future__ import annotations

import sys

import contextlib

import thunder
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.fsdp import fully_shard

import thunder_memopt.backend as backend_module
import thunder_memopt.graph_rewrites as graph_rewrites
from thunder.dynamo import ThunderCompiler
from thunder_memopt.graph_rewrites import keep_collectives_out_of_thunder
from _common import finish, max_grad_diff
import thunder_memopt.passes.offload as offload_pass
from thunder_memopt import MemoryOptimization
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.core.memory import saved_for_backward, storage_roots
from thunder_memopt.core.trace import trace_inputs
from thunder_memopt.models import build_model, narrow_config, random_batch

CONFIG = narrow_config("pythia-14m", n_layer=2, n_embd=256, block_size=128)
# Compute far slower than the copies, so that the narrowed model's copies hide behind it.
RATES = DeviceRates(to_host=50e9, to_device=50e9, flops=1e9, memory=1e9)


def step(reshard: bool, backend: str, autocast: bool = False):
    """One step under ``backend``: "eager", "thunder" (plain ThunderCompiler), "memopt" or
    "memopt_offload" (offload="budget" at budget 1.0: what hides behind compute at ``RATES``, with
    CPU copies standing in for the host)."""
    model = build_model(CONFIG, dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    compiler = None
    if backend != "eager":
        torch._dynamo.reset()
        if backend == "thunder":
            compiler = ThunderCompiler()
        elif backend == "memopt_offload":
            memopt = MemoryOptimization(offload="budget", offload_rates=RATES)
            compiler = backend_module.thunderfx_backend(memopt)
            compiler.memory_optimization = memopt
        else:
            compiler = backend_module.thunderfx_backend()
        model = torch.compile(model, backend=compiler)
    x, y = random_batch(CONFIG, batch_size=2, seq_len=64)
    with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.to_local().clone() for n, p in model.named_parameters()}
    return loss.item(), grads, compiler


def saved_parameter_copies(compiler) -> int:
    """Saved tensors computed from parameters alone (casts, transposes): FSDP2 frees the
    parameters after forward, so such copies are the only parameter bytes the step keeps."""
    if compiler is None:
        return 0
    compiler = getattr(compiler, "compiler", compiler)
    count = 0
    for info in compiler.subgraph_infos:
        for fn in info.thunder_compiled_fns:
            fw = thunder.last_traces(fn)[-1]
            params = {t.name for t in trace_inputs(fw) if "STATIC_MEMORY_LOCATION" in str(t.tags)}
            derived = set(params)
            for bsym in fw.bound_symbols:
                args = [a.name for a in bsym.flat_proxy_args if hasattr(a, "name") and hasattr(a, "shape")]
                if args and all(a in derived for a in args):
                    derived.update(o.name for o in bsym.flat_proxy_outs)
            roots = storage_roots(fw)
            count += sum(1 for t in saved_for_backward(fw).tensors if t.name in derived and roots[t.name].storage not in params)
    return count


class AllReduceInForward(torch.nn.Module):
    """A matmul, a functional all-reduce (a ``wait_tensor`` follows it in the graph), a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = funcol.all_reduce(torch.tanh(x @ self.w), "sum", dist.group.WORLD)
        return (h * h).sum()


def functional_collective_step(backend: str) -> tuple[float, list[float]]:
    """Loss and weight gradient of AllReduceInForward under "eager" or "memopt"."""
    torch._dynamo.reset()
    model = AllReduceInForward()
    if backend == "memopt":
        model = torch.compile(model, backend=backend_module.thunderfx_backend())
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    loss = model(x)
    loss.backward()
    weight = model._orig_mod.w if backend == "memopt" else model.w
    return loss.item(), weight.grad.flatten().tolist()


def count_hidden_collectives() -> list[int]:
    """Wrap the guard so the run records how many collective nodes each dynamo graph had."""
    counts: list[int] = []

    def counting(gm) -> int:
        counts.append(keep_collectives_out_of_thunder(gm))
        return counts[-1]

    graph_rewrites.keep_collectives_out_of_thunder = counting
    return counts


def report() -> dict:
    """Every variant's steps, compared (the process group initialized). The offload pass's size floor,
    dynamo's FSDP hook setting and the backend's collective guard are set for it and restored."""
    saved_settings = offload_pass.MIN_BYTES, torch._dynamo.config.skip_fsdp_hooks, keep_collectives_out_of_thunder
    offload_pass.MIN_BYTES = 1  # the narrowed model's saved tensors are smaller than a real one's
    try:
        return _compare_variants()
    finally:
        (offload_pass.MIN_BYTES, torch._dynamo.config.skip_fsdp_hooks,
         graph_rewrites.keep_collectives_out_of_thunder) = saved_settings


# name, reshard_after_forward, skip_fsdp_hooks, autocast, and whether the step runs again with
# offload (the tests compare offload in the two sharding modes).
VARIANTS = (
    ("zero2", False, True, False, True),
    ("zero3", True, True, False, True),
    ("zero3_hooks_traced", True, False, False, False),
    ("zero3_autocast", True, True, True, False),
)


def offload_against_memopt(reshard: bool, autocast: bool, memopt_grads: dict[str, torch.Tensor]) -> dict:
    """The step again with offload: its loss, its gradients' difference from the memopt step's, and
    how many tensors it offloaded."""
    loss, grads, compiler = step(reshard, "memopt_offload", autocast)
    return {
        "offloaded_loss": loss,
        "max_grad_diff_offloaded_vs_memopt": max_grad_diff(memopt_grads, grads),
        "offloaded_tensors": sum(len(plan.offloaded) for plan in compiler.memory_optimization.offload_plans),
    }


def _compare_variants() -> dict:
    results = {}
    for name, reshard, skip_hooks, autocast, offload in VARIANTS:
        torch._dynamo.config.skip_fsdp_hooks = skip_hooks
        ref_loss, ref_grads, _ = step(reshard, "eager", autocast)
        plain_loss, plain_grads, plain = step(reshard, "thunder", autocast)
        counts = count_hidden_collectives()
        loss, grads, memopt = step(reshard, "memopt", autocast)
        results[name] = offload_against_memopt(reshard, autocast, grads) if offload else {}
        results[name] |= {
            "ref_loss": ref_loss,
            "plain_loss": plain_loss,
            "loss": loss,
            "max_grad_diff": max_grad_diff(ref_grads, grads),
            "max_grad_diff_vs_plain": max_grad_diff(plain_grads, grads),
            "collectives_kept_out": sum(counts),
            "saved_parameter_copies_plain": saved_parameter_copies(plain),
            "saved_parameter_copies": saved_parameter_copies(memopt),
        }
    torch._dynamo.config.skip_fsdp_hooks = True
    counts = count_hidden_collectives()
    results["functional_all_reduce"] = {
        backend: functional_collective_step(backend) for backend in ("eager", "memopt")
    }
    results["functional_all_reduce"]["collectives_kept_out"] = sum(counts)
    return results


def main(path: str) -> None:
    dist.init_process_group("gloo")
    finish(path, report())


if __name__ == "__main__":
    main(sys.argv[1])
