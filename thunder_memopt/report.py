"""The memory report: what a litgpt model saves for backward under plain Thunder and with
MemoryOptimization on the recommended executors (``thunder_memopt.executors()``: the fused loss
head; the fusion executor's regions on CUDA), and the estimated and measured peak of a training step.

Saved bytes per layer are those of the Blocks' ops in the one forward trace of the whole model,
one plan (``saved_bytes_by_layer``), so that the embedding and the head do not distort them, and
are also given in h-bytes per token per layer: bytes divided by tokens x n_embd. Everything
printed is computed from the real traces and from ``saved_tensors_hooks`` during a real forward;
nothing is typed in.

The report runs ``thunder.jit``, which cannot trace mixture-of-experts models (``torch.where`` with
a condition alone): those are refused up front, and train through ``thunderfx_backend()``.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import thunder
import torch

from thunder_memopt import executors
from thunder_memopt.arguments import device_name, fraction, litgpt_model_name, narrow_width, non_negative_int, positive_int
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx

from thunder_memopt.core.memory import SavedInventory, estimate_step, saved_for_backward
from thunder_memopt.core.trace import tensor_outs
from thunder_memopt.measure import measure_saved, peak_live_bytes
from thunder_memopt.models import DTYPES, GPTWithLoss, build_model, narrow_config, random_batch, training_step
from thunder_memopt.transform import MemoryOptimization

__all__ = ["Column", "measure_column", "saved_bytes_by_layer", "main"]

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Column:
    """One setup (plain Thunder or MemoryOptimization) measured on the model."""

    name: str
    saved_by_layer: tuple[int, ...]  # saved bytes of each Block's ops (saved_bytes_by_layer)
    inventory: SavedInventory
    estimated_peak: int  # forward + backward, activations and gradients
    peak_phase: str
    measured_peak: int  # above what was alive before the step: CUDA max allocated, or live tensor bytes on CPU
    compile_seconds: float
    schedule: tuple  # thunder_memopt.passes.schedule.ScheduleResult of the forward and backward, if it ran


def measure_column(name: str, args: argparse.Namespace, transforms_factory,
                   executor_list: Sequence | None = None) -> Column:
    """Saved bytes, by layer and in all, and peaks of the model under thunder.jit with
    ``executor_list`` (None: Thunder's defaults)."""
    device = torch.device(args.device)
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    model = build_model(cfg, dtype=DTYPES[args.dtype], device=device)
    x, y = random_batch(cfg, batch_size=args.micro_batch_size, seq_len=args.block_size, device=device)
    transforms = transforms_factory()
    jitted = thunder.jit(GPTWithLoss(model, upcast_logits=True), executors=executor_list, transforms=transforms)
    start = time.perf_counter()
    measured = measure_saved(jitted, x, y, parameters=[*model.parameters(), *model.buffers()])
    seconds = time.perf_counter() - start
    print(f"  {name}: saved {measured.activation_bytes / MiB:.1f} MiB (first call {seconds:.1f} s)", flush=True)
    loss = measured.output
    del measured
    loss.backward()
    fw, bw = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    est = estimate_step(fw, bw)
    inventory = saved_for_backward(fw)
    return Column(
        name=name,
        saved_by_layer=tuple(saved_bytes_by_layer(fw, inventory, args.n_layer)),
        inventory=inventory,
        estimated_peak=est.peak_bytes,
        peak_phase=est.peak_phase,
        measured_peak=_measured_peak(model, jitted, x, y, device),
        compile_seconds=seconds,
        schedule=tuple(r for t in transforms for r in getattr(t, "schedule_results", ())),
    )


# litgpt's parameters as thunder.jit names them: a Block's, and the final norm's and head's.
_BLOCK_PARAMETER = re.compile(r"_transformer_h_(\d+)_")
_AFTER_THE_BLOCKS = ("_transformer_ln_f_", "_lm_head_")


def saved_bytes_by_layer(forward: TraceCtx, inventory: SavedInventory, n_layer: int) -> list[int]:
    """The saved activation bytes (storages once, parameters apart) that each Block's ops make in
    one forward trace of a litgpt model, so of one recompute plan: a tensor belongs to the deepest
    Block whose parameters it derives from, unless it derives from the final norm's or the head's
    (then to none of them, as the embedding's does)."""
    depth: dict[str, int] = {}  # of each tensor made: -1, before the Blocks; n_layer, after them

    def depth_of(name: str) -> int:
        block = _BLOCK_PARAMETER.search(name)
        if block:
            return int(block.group(1))
        return n_layer if any(part in name for part in _AFTER_THE_BLOCKS) else depth.get(name, -1)

    def visit(bsyms) -> None:
        for b in bsyms:
            visit(b.subsymbols)  # a fusion region's ops, each with its own depth
            deepest = max((depth_of(a.name) for a in b.flat_proxy_args if isinstance(a, TensorProxy)), default=-1)
            for out in tensor_outs(b):
                depth.setdefault(out.name, deepest)

    visit(forward.bound_symbols)
    by_layer = [0] * n_layer
    for storage, nbytes in {t.storage: t.storage_nbytes for t in inventory.tensors if not t.is_parameter}.items():
        layer = depth.get(storage, -1)
        if 0 <= layer < n_layer:
            by_layer[layer] += nbytes
    return by_layer


def _measured_peak(model, jitted, x, y, device: torch.device) -> int:
    """Peak of one more forward+backward above what was alive before it: the CUDA allocator's on a
    GPU, the profiler's live tensor bytes on CPU."""
    model.zero_grad(set_to_none=True)
    if device.type != "cuda":
        return peak_live_bytes(lambda: jitted(x, y).backward())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    jitted(x, y).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _train_a_few_steps(args: argparse.Namespace) -> None:
    """The demo's training: a few AdamW steps under thunder.jit with MemoryOptimization and the
    recommended executors."""
    device = torch.device(args.device)
    cfg = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    model = build_model(cfg, dtype=DTYPES[args.dtype], device=device)
    transforms = [MemoryOptimization(activation_budget=args.budget)]
    jitted = thunder.jit(GPTWithLoss(model, upcast_logits=True), executors=executors(), transforms=transforms)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.train_steps):
        x, y = random_batch(cfg, batch_size=args.micro_batch_size, seq_len=args.block_size, device=device, seed=step)
        start = time.perf_counter()
        loss = training_step(jitted, optimizer, x, y)
        print(f"  step {step + 1}/{args.train_steps}: loss {loss.item():.4f} ({time.perf_counter() - start:.1f} s)", flush=True)


def _fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


def format_report(args: argparse.Namespace, columns: Sequence[Column]) -> str:
    tokens = args.micro_batch_size * args.block_size
    per_layer = [sum(c.saved_by_layer) / args.n_layer for c in columns]
    h_bytes = [p / (tokens * args.n_embd_effective) for p in per_layer]
    lines = [
        f"# Memory report: {args.model_name}, {args.n_layer} layers, n_embd {args.n_embd_effective}, "
        f"T={args.block_size}, batch {args.micro_batch_size}, {args.dtype}, {args.device}",
        "",
        "| | " + " | ".join(c.name for c in columns) + " |",
        "|---|" + "---|" * len(columns),
        "| saved activations per layer (the Blocks' ops, mean) | " + " | ".join(_fmt_bytes(int(p)) for p in per_layer) + " |",
        "| h-bytes / token / layer | " + " | ".join(f"{h:.1f}" for h in h_bytes) + " |",
        "| saved activations, whole model | " + " | ".join(_fmt_bytes(c.inventory.activation_bytes) for c in columns) + " |",
        "| estimated peak, forward+backward | "
        + " | ".join(f"{_fmt_bytes(c.estimated_peak)} ({c.peak_phase})" for c in columns)
        + " |",
        "| measured peak above the step's start (CUDA: max allocated; CPU: live tensor bytes) | " + " | ".join(_fmt_bytes(c.measured_peak) for c in columns) + " |",
        "| first call (compile + step) | " + " | ".join(f"{c.compile_seconds:.1f} s" for c in columns) + " |",
    ]
    for c in columns:
        if not c.schedule:
            continue
        lines += ["", f"## Schedule pass: estimated peak of each trace, {c.name}", ""]
        lines += ["| trace | before | after | order | peak at | source |", "|---|---|---|---|---|---|"]
        for name, r in zip(("forward", "backward"), c.schedule):
            lines.append(
                f"| {name} | {_fmt_bytes(r.peak_before)} | {_fmt_bytes(r.peak_after)} | {r.method} "
                f"| {r.peak_op} | {_short_source(r.peak_source or '?')} |"
            )
    for c in columns:
        lines += ["", f"## Saved for backward by op and source line: {c.name} (largest first)", ""]
        lines += ["| bytes | tensors | op | source |", "|---|---|---|---|"]
        for op, src, nbytes, count in c.inventory.by_source()[: args.top]:
            lines.append(f"| {_fmt_bytes(nbytes)} | {count} | {op} | {_short_source(src)} |")
    return "\n".join(lines)


def _short_source(src: str) -> str:
    parts = src.split("/")
    return "/".join(parts[-2:]) if len(parts) > 2 else src


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    has_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m thunder_memopt report", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b",
                   help="a litgpt config name")
    p.add_argument("--n-layer", type=positive_int, default=4, help="layers of the model reported on")
    p.add_argument("--n-embd", type=narrow_width, default=None,
                   help="narrow to this width, a multiple of 64 (default: 256 on CPU, real on GPU)")
    p.add_argument("--block-size", type=positive_int, default=512 if not has_gpu else 8192, help="sequence length")
    p.add_argument("--micro-batch-size", type=positive_int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--device", type=device_name, default="cuda" if has_gpu else "cpu")
    p.add_argument("--budget", type=fraction, default=1.0, help="MemoryOptimization activation_budget, in [0, 1]")
    p.add_argument("--train-steps", type=non_negative_int, default=3,
                   help="AdamW steps to train before the report (0: none)")
    p.add_argument("--top", type=positive_int, default=8, help="rows of the saved-tensor tables")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not has_gpu:
        p.error("--device cuda asked for, but torch sees no GPU")
    if args.n_embd is None and not args.device.startswith("cuda"):
        args.n_embd = 256
    from litgpt import Config

    config = Config.from_name(args.model_name)
    if config.n_expert:
        p.error(f"--model-name {args.model_name} is a mixture-of-experts model, which thunder.jit (the "
                "report's) cannot trace; train it through thunderfx_backend() or ThunderCompiler")
    args.n_embd_effective = args.n_embd or config.n_embd
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.train_steps:
        print(f"Training {args.train_steps} steps of {args.model_name} with MemoryOptimization on {args.device}", flush=True)
        _train_a_few_steps(args)
    print(f"Measuring what {args.n_layer} layers save", flush=True)
    columns = [
        measure_column("plain Thunder", args, list),
        measure_column(
            f"MemoryOptimization (budget {args.budget}), executors()",
            args,
            lambda: [MemoryOptimization(activation_budget=args.budget)],
            executors(),
        ),
    ]
    print()
    print(format_report(args, columns))
