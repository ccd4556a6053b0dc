"""Peak memory and speed of one sharded training step, per compiler backend, on litgpt models.

What it measures: over ``--warmup`` then ``--iters`` steps of forward, cross-entropy loss, backward
and AdamW step, the peak allocated and reserved CUDA memory (rank 0 and the maximum over ranks), the
median step time and tokens/s/GPU, the bytes saved for backward per layer, the first step's time
(compilation), and the last step's loss. Backends: ``eager``, ``eager-ac`` (full activation
checkpointing of every Block, the memory floor), ``inductor``, ``inductor-budget`` (inductor with
``activation_memory_budget``), ``thunder`` (Thunder's default executors), ``thunder+fusion``
(thunder_memopt's fusion and cuDNN attention executors, no MemoryOptimization) and ``thunder+memopt``
(the recommended configuration: those executors and ``MemoryOptimization``). Sharding: FSDP2 (``fully_shard``), Thunder's own FSDP, or none.

Why a driver and workers: a backend's compiled code, allocator cache and peak statistics must not
leak into the next backend's numbers, so every row runs in fresh processes. The process you launch
(``torchrun --nproc-per-node N benchmark_fsdp2.py ...``, or ``python benchmark_fsdp2.py
--nproc-per-node N ...``) is the driver: rank 0 launches, for every (block size, backend, budget),
a new ``torch.distributed.run --standalone --nproc-per-node N`` of this file in worker mode, waits
for it, and appends one JSON line to ``--out``; the other launched ranks exit at once. Out-of-memory,
errors and hangs end that row (``OOM``/``error``/``timeout``), never the run.

Without a GPU it runs on CPU with gloo and a narrowed model (``--n-embd 256``), so CI can smoke-test
it; the memory fields are then null (there is no CPU allocator peak to report).

    torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp2.py --n-layer 8 --block-size 8192 \\
        --shard-mode zero2 --compile eager eager-ac inductor inductor-budget thunder thunder+memopt \\
        --out benchmarks/results/stablecode_8l.jsonl

See benchmarks/README.md for the committed runs and benchmarks/make_table.py for tables and plots.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import hashlib
import importlib.metadata
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# NVLink multicast must stay off on the GPU host (NCCL's NVLS and symmetric memory's multicast). Set
# before any process group exists; every worker this driver launches inherits them.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402  (after the NCCL environment above)
import torch.distributed as dist  # noqa: E402

import make_table  # noqa: E402  (benchmarks/ is sys.path[0] when this file runs as a script)
from thunder_memopt.arguments import fraction, litgpt_model_name, narrow_width, positive_int  # noqa: E402
from thunder_memopt.transform import PASSES  # noqa: E402

BACKENDS = make_table.BACKENDS
THUNDER_BACKENDS = ("thunder", "thunder+fusion", "thunder+memopt")
# Backends that run thunder_memopt's executors (thunder_memopt.executors()).
EXECUTOR_BACKENDS = ("thunder+fusion", "thunder+memopt")
DISTRIBUTED_MODES = ("fsdp2", "thunder-fsdp", "none")
FUSION = {"on": True, "off": False}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
# Small, so that a handful of steps moves every backend's weights alike and the losses stay comparable.
LEARNING_RATE = 1e-4
GPU_DEFAULT_BLOCK_SIZE = 8192
CPU_DEFAULT_BLOCK_SIZE = 256
CPU_DEFAULT_N_EMBD = 256
MEMORY_FIELDS = ("peak_alloc_rank0", "peak_reserved_rank0", "peak_alloc_max", "peak_reserved_max")
MEMORY_HISTORY_ENTRIES = 100_000
PROFILE_TOP_OPS = 10
PROFILE_NAME_CHARS = make_table.KERNEL_NAME_CHARS
COPY_KERNEL = "copy_kernel"  # in the names of ATen's copy kernels: direct_copy_kernel_cuda, bfloat16_copy_kernel_cuda
# Statuses that a rerun with --resume takes from --out instead of measuring again.
FINAL_STATUSES = ("ok", "OOM")
LOSS_MODES = ("in-graph", "litgpt", "outside-fp32")
MEMOPT_ONLY_FIELDS = ("memopt_passes", "fusion")  # Trial fields that change only thunder_memopt's backends
EXIT_INCOMPLETE = 3  # --time-limit stopped the run; rerun the same command with --resume
EXIT_NO_ROW = 4  # every row failed (error, OOM or timeout)
STOP_GRACE_S = 30
ERROR_MESSAGE_CHARS = 2000  # compile errors quote whole commands; the log has the rest
# Variables that torchrun sets for the driver's own ranks; the nested torchrun sets its own.
TORCHRUN_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                           "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                           "MASTER_ADDR", "MASTER_PORT")
# Querying the GPU creates a CUDA context; done in a child so the long-lived driver holds no GPU memory.
ENVIRONMENT_PROBE = (
    "import json, torch; cuda = torch.cuda.is_available(); "
    "print(json.dumps({'cuda': cuda, 'gpu': torch.cuda.get_device_name(0) if cuda else 'cpu'}))"
)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One training run in one fresh set of processes: everything a worker needs to know."""

    model: str
    n_layer: int
    n_embd: int  # the width built
    narrowed: bool  # n_embd came from --n-embd (narrow_config then also shrinks the vocabulary)
    block_size: int
    micro_batch_size: int
    dtype: str
    distributed_mode: str
    shard_mode: str
    world_size: int
    backend: str
    budget: float | None
    warmup: int
    iters: int
    seed: int
    search: bool = False  # a --find-max-block-size probe: only whether it fits matters
    memopt_passes: tuple[str, ...] | None = None  # thunder+memopt: MemoryOptimization(passes=...); None: all
    fusion: str = "on"  # thunder+fusion, thunder+memopt: thunder_memopt.executors(fusion=...): on or off
    autocast: bool = False  # bf16 torch.autocast over parameters kept in ``dtype``
    loss_mode: str = "in-graph"  # where and how the cross-entropy runs: one of LOSS_MODES
    profile: bool = False
    memory_snapshot: str | None = None

    def describe(self) -> str:
        budget = "" if self.budget is None else f" budget={self.budget:g}"
        if self.memopt_passes is not None:
            budget += f" passes={'+'.join(self.memopt_passes)}"
        if self.backend in EXECUTOR_BACKENDS and self.fusion != "on":
            budget += f" fusion={self.fusion}"
        if self.autocast:
            budget += " autocast"
        if self.loss_mode != "in-graph":
            budget += f" loss={self.loss_mode}"
        sharding = make_table.sharding_of(dataclasses.asdict(self))
        return (f"{self.backend}{budget} T={self.block_size} "
                f"({self.model}, {self.n_layer} layers, {sharding}, world size {self.world_size})")

    def resume_key(self) -> dict:
        """The fields that make two runs the same measurement."""
        key = dataclasses.asdict(self)
        for diagnostics_only in ("profile", "memory_snapshot"):
            del key[diagnostics_only]
        return key


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name])


# ----------------------------------------------------------------------------------------------
# Worker: one trial, on every rank of a fresh torchrun.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Training:
    """A model made ready for one backend and sharding: what a step calls and what it updates."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, targets) -> loss
    parameters_owner: torch.nn.Module
    fsdp_root: torch.nn.Module | None  # the fully_shard root under fsdp2
    reshard_after_forward: bool
    autocast_device: str | None = None  # bf16 autocast on this device type around the forward
    memopt: Any = None  # the MemoryOptimization instance of thunder+memopt (its pass timings)
    executors: list | None = None  # the Thunder executors, for the thunder backends

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_device is None:
            return contextlib.nullcontext()
        return torch.autocast(self.autocast_device, dtype=torch.bfloat16)

    @contextlib.contextmanager
    def forward_parameters(self) -> Iterator[list[torch.Tensor]]:
        """The parameters as a forward sees them, in storages that stay put during the forward.

        measure_saved tells parameters from activations by storage address. FSDP2 all-gathers each
        module's parameters into storages that it frees after that module's forward (zero3), where
        activations can then be allocated; so all are gathered up front and kept for the forward.
        """
        if self.fsdp_root is None:
            yield list(self.parameters_owner.parameters())
            return
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_root.set_reshard_after_forward(False)
        for module in self.fsdp_root.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
        try:
            yield list(self.fsdp_root.parameters())
        finally:
            self.fsdp_root.set_reshard_after_forward(self.reshard_after_forward)


def checkpoint_every_block(gpt: torch.nn.Module) -> None:
    """Full activation checkpointing of each transformer Block (non-reentrant)."""
    from litgpt.model import Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(gpt, check_fn=lambda module: isinstance(module, Block))


class HeadWithLoss(torch.nn.Module):
    """GPTWithLoss with the head moved out of the GPT's forward, next to the loss.

    Under torch.compile every FSDP2 unit (each Block) breaks the graph, and a graph break inside a
    call splits its caller's frame too: the head would end the GPT's last graph and the loss start
    another, and no compiler could fuse the two. Here they are one graph, for every backend alike.
    (Only without final soft-capping, which litgpt applies after its head.)
    """

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.head = gpt.lm_head
        gpt.lm_head = torch.nn.Identity()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from thunder_memopt.models import next_token_loss

        return next_token_loss(self.head(self.gpt(input_ids)), targets)


def shard_with_fsdp2(gpt: torch.nn.Module, root: torch.nn.Module, trial: Trial) -> None:
    """fully_shard each Block of ``gpt`` and its embedding, then ``root`` (``gpt``, or GPTWithLoss
    around it for the in-graph loss), whose unit holds the final norm, the head and the loss.

    The head and the loss share the root's unit so that they compile in one graph (each FSDP2 unit
    is a graph of its own under torch.compile), where a compiler can fuse the head with its
    cross-entropy (thunder_memopt's loss_head pass). Under zero2 this leaves the peak as it was:
    every unit stays gathered from its forward to its backward, and the head's forward and backward
    sit on either side of the peak.

    The model is built in ``trial.dtype``, and the policy computes and reduces in that dtype, which
    for bf16 makes it a no-op cast (the reference numbers: bf16 model + MixedPrecisionPolicy(bf16)).
    Under ``--autocast`` the policy casts nothing: the parameters are gathered in their own dtype and
    autocast's casts of them run inside the compiled graphs.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = torch_dtype(trial.dtype)
    policy = MixedPrecisionPolicy() if trial.autocast else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    options = {
        "mp_policy": policy,
        "reshard_after_forward": trial.shard_mode == "zero3",
    }
    for block in gpt.transformer.h:
        fully_shard(block, **options)
    fully_shard(gpt.transformer.wte, **options)
    fully_shard(root, **options)


def memory_optimization(trial: Trial):
    from thunder_memopt import MemoryOptimization

    options = {"activation_budget": trial.budget}
    if trial.memopt_passes is not None:
        options["passes"] = trial.memopt_passes
    return MemoryOptimization(**options)


def thunder_executors(trial: Trial) -> list:
    """The executors of a thunder backend: Thunder's defaults, or thunder_memopt's in front of them."""
    import thunder

    if trial.backend in EXECUTOR_BACKENDS:
        from thunder_memopt import executors

        return executors(fusion=FUSION[trial.fusion])
    return list(thunder.get_default_executors())


def thunder_fsdp(module: torch.nn.Module, trial: Trial, device: torch.device, transforms: list,
                 executors: list) -> torch.nn.Module:
    """Thunder's FSDP. thunder 0.2.6's ``fsdp`` takes the jitted module and adds its sharding transform."""
    import thunder
    from thunder.distributed import FSDPType, fsdp

    strategy = FSDPType.ZERO3 if trial.shard_mode == "zero3" else FSDPType.ZERO2
    jitted = thunder.jit(module, transforms=transforms, executors=executors)
    return fsdp(jitted, device=device, sharding_strategy=strategy)


def compile_for_backend(module: torch.nn.Module, trial: Trial, memopt, executors: list | None) -> Callable:
    """``module`` compiled by ``trial.backend`` (under FSDP2 or on one device)."""
    if trial.backend in ("eager", "eager-ac"):
        return module
    if trial.backend in ("inductor", "inductor-budget"):
        if trial.backend == "inductor-budget":
            torch._functorch.config.activation_memory_budget = trial.budget
        return torch.compile(module)
    transforms = [memopt] if memopt is not None else []
    if trial.distributed_mode == "fsdp2":
        # FSDP2's hooks need dynamo in front: torch.compile with Thunder as the backend.
        if memopt is None:
            from thunder.dynamo import ThunderCompiler

            return torch.compile(module, backend=ThunderCompiler(executors=executors))
        from thunder_memopt import thunderfx_backend

        return torch.compile(module, backend=thunderfx_backend(memopt, executors=executors))
    import thunder

    return thunder.jit(module, transforms=transforms, executors=executors)


def prepare_training(gpt: torch.nn.Module, trial: Trial, device: torch.device) -> Training:
    zero3 = trial.shard_mode == "zero3"
    if trial.backend == "eager-ac":
        checkpoint_every_block(gpt)  # before fully_shard, so FSDP2 wraps the checkpointed blocks
    from thunder_memopt.models import GPTWithLoss

    if trial.loss_mode != "in-graph":
        module = gpt
    elif trial.distributed_mode == "fsdp2" and gpt.config.final_logit_softcapping is None:
        module = HeadWithLoss(gpt)
    else:
        module = GPTWithLoss(gpt)
    if trial.distributed_mode == "fsdp2":
        shard_with_fsdp2(gpt, module, trial)
    autocast_device = device.type if trial.autocast else None
    memopt = memory_optimization(trial) if trial.backend == "thunder+memopt" else None
    executors = thunder_executors(trial) if trial.backend in THUNDER_BACKENDS else None
    if trial.distributed_mode == "thunder-fsdp":
        sharded = thunder_fsdp(module, trial, device, [memopt] if memopt is not None else [], executors)
        return Training(with_loss(sharded, trial.loss_mode), sharded, fsdp_root=None, reshard_after_forward=zero3,
                        autocast_device=autocast_device, memopt=memopt, executors=executors)
    fsdp_root = module if trial.distributed_mode == "fsdp2" else None
    compiled = compile_for_backend(module, trial, memopt, executors)
    return Training(with_loss(compiled, trial.loss_mode), module, fsdp_root=fsdp_root, reshard_after_forward=zero3,
                    autocast_device=autocast_device, memopt=memopt, executors=executors)


def with_loss(compiled: Callable, loss_mode: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(input_ids, targets) -> loss. ``in-graph``: ``compiled`` is GPTWithLoss and returns the loss.
    Otherwise ``compiled`` returns the logits and the loss is computed after it, in eager, as a
    litgpt training loop does; the logits stay alive until the loss is dropped, as the loop's
    variable does through backward and the optimizer step."""
    if loss_mode == "in-graph":
        return compiled
    from litgpt.utils import chunked_cross_entropy

    from thunder_memopt.models import next_token_loss

    def forward(input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = compiled(input_ids)
        if loss_mode == "litgpt":
            value = chunked_cross_entropy(logits, targets)
        else:  # outside-fp32
            value = next_token_loss(logits, targets, upcast_logits=True)
        value.logits = logits
        return value

    return forward


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    synchronize(device)
    start = time.perf_counter()
    loss = step()
    synchronize(device)
    return loss, time.perf_counter() - start


def train_step(training: Training, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    with training.autocast():
        loss = training.forward(input_ids, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def peak_memory(device: torch.device) -> dict:
    """Peak allocated/reserved bytes of this rank (rank 0's row) and their maximum over ranks."""
    if device.type != "cuda":
        return dict.fromkeys(MEMORY_FIELDS)
    local = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    peaks = torch.tensor(local, dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    return dict(zip(MEMORY_FIELDS, [*local, *peaks.tolist()]))


def reservable_bytes(device: torch.device) -> int | None:
    """The most PyTorch's allocator could hold on any rank: free device memory plus what it holds,
    so the CUDA context and NCCL's buffers are left out. The minimum over ranks."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    reservable = torch.tensor([free + torch.cuda.memory_reserved(device)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(reservable, op=dist.ReduceOp.MIN)
    return int(reservable.item())


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals (kernels on several streams)."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def profile_summary(profiler: torch.profiler.profile, wall_s: float) -> dict:
    """Top kernels by GPU time, top ops by self CPU time (ms over the measured steps), GPU busy fraction."""
    from torch.autograd import DeviceType

    def top(events: list, microseconds: Callable) -> list:
        ranked = sorted(events, key=microseconds, reverse=True)[:PROFILE_TOP_OPS]
        return [[e.key[:PROFILE_NAME_CHARS], microseconds(e) / 1e3, e.count] for e in ranked]

    averages = profiler.key_averages()
    kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
    kernel_spans = [(e.time_range.start, e.time_range.end) for e in profiler.events()
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    return {
        "top_gpu_ms": top(kernels, lambda e: e.device_time_total),
        # Casts and layout copies (direct_copy_kernel, bfloat16_copy_kernel...), which fusion removes.
        "copy_kernel_ms": sum(e.device_time_total for e in kernels if COPY_KERNEL in e.key) / 1e3,
        "copy_kernel_calls": sum(e.count for e in kernels if COPY_KERNEL in e.key),
        "top_cpu_ms": top([e for e in averages if e.device_type == DeviceType.CPU], lambda e: e.self_cpu_time_total),
        "gpu_busy_fraction": union_length(kernel_spans) / (wall_s * 1e6) if kernel_spans else None,
    }


@contextlib.contextmanager
def recording_memory_history(path: str | None, device: torch.device) -> Iterator[None]:
    """Record the CUDA allocator's history and dump a snapshot (for pytorch.org/memory_viz) to ``path``."""
    if path is None or device.type != "cuda":
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(path)
        torch.cuda.memory._record_memory_history(enabled=None)


def profiler_for(trial: Trial, device: torch.device) -> contextlib.AbstractContextManager:
    if not trial.profile:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


class TrainingSession:
    """The model, optimizer and batch of one trial on one rank."""

    def __init__(self, trial: Trial, device: torch.device, rank: int) -> None:
        from thunder_memopt.models import build_model, narrow_config, random_batch

        self.trial, self.device, self.rank = trial, device, rank
        self.config = narrow_config(trial.model, n_layer=trial.n_layer, n_embd=trial.n_embd if trial.narrowed else None,
                                    block_size=trial.block_size)
        gpt = build_model(self.config, dtype=torch_dtype(trial.dtype), device=device, seed=trial.seed)
        self.training = prepare_training(gpt, trial, device)
        self.optimizer = torch.optim.AdamW(self.training.parameters_owner.parameters(), lr=LEARNING_RATE)
        if device.type == "cuda":
            # build_model makes fp32 weights and then casts them: give that cache back, so that reserved
            # memory shows what training needs.
            torch.cuda.empty_cache()
        # Same seed in every backend: same weights and batch, so the losses must agree.
        self.input_ids, self.targets = random_batch(self.config, batch_size=trial.micro_batch_size,
                                                    seq_len=trial.block_size, device=device, seed=trial.seed + rank)

    def run_steps(self) -> dict:
        trial, device = self.trial, self.device
        step = functools.partial(train_step, self.training, self.optimizer, self.input_ids, self.targets)
        _, first_step_s = timed(step, device)  # includes compilation
        for _ in range(trial.warmup - 1):
            timed(step, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        snapshot = trial.memory_snapshot if self.rank == 0 else None
        step_seconds = []
        with recording_memory_history(snapshot, device), profiler_for(trial, device) as profiler:
            for _ in range(trial.iters):
                loss, seconds = timed(step, device)
                step_seconds.append(seconds)
        median_s = statistics.median(step_seconds)
        result = {
            **peak_memory(device),
            "reservable_bytes": reservable_bytes(device),
            "step_ms": median_s * 1e3,
            "step_ms_all": [s * 1e3 for s in step_seconds],
            "tokens_per_s_per_gpu": trial.micro_batch_size * trial.block_size / median_s,
            "first_step_s": first_step_s,
            "compile_s": first_step_s - median_s,
            "loss": loss.item(),
        }
        if profiler is not None:
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            result["profile"] = profile_summary(profiler, sum(step_seconds))
        if snapshot is not None and device.type == "cuda":
            result["memory_snapshot"] = snapshot
        return result

    def measure_saved_activations(self) -> dict:
        """Bytes saved for backward by one more forward (storages, parameters excluded), per layer.

        It covers the whole model, embedding, head and loss included. Block inputs that a checkpoint
        wrapper holds (eager-ac) are invisible to saved-tensor hooks; under thunder-fsdp zero2 the
        all-gathered weights saved for backward are counted as activations.
        """
        from thunder_memopt.measure import measure_saved

        with self.training.forward_parameters() as parameters:
            saved = measure_saved(self.training.forward, self.input_ids, self.targets, parameters=parameters)
            saved.output.backward()
        self.optimizer.zero_grad(set_to_none=True)
        n_layer, tokens = self.config.n_layer, self.trial.micro_batch_size * self.trial.block_size
        return {
            "saved_bytes_per_layer": saved.activation_bytes / n_layer,
            "saved_storages": saved.n_storages,
            "saved_h_bytes": saved.activation_bytes / (tokens * self.config.n_embd * n_layer),
        }


def init_distributed(trial: Trial) -> tuple[int, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if trial.distributed_mode == "none":
        return 0, device
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), device


def is_out_of_memory(error: BaseException) -> bool:
    # Fusers and collectives can re-raise an allocator failure as a RuntimeError.
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


@contextlib.contextmanager
def reporting_failure(out_dir: Path, rank: int, phase: str) -> Iterator[None]:
    """On an exception, write this rank's status for the driver and exit at once.

    A rank that failed mid-collective cannot tear the process group down (its peers wait in the
    collective), so it leaves with os._exit; torchrun then stops the other ranks.
    """
    try:
        yield
    except Exception as error:
        traceback.print_exc()
        status = "OOM" if is_out_of_memory(error) else "error"
        message = f"{type(error).__name__}: {error}"[:ERROR_MESSAGE_CHARS]
        write_json(out_dir / f"rank{rank}.json", {"status": status, "error": message, "phase": phase})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def recording_memopt_warnings() -> list[str]:
    """A list that collects the distinct warnings thunder_memopt issues (e.g. a pass left a trace as it was)."""
    messages: list[str] = []
    show = warnings.showwarning

    def show_and_record(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith("thunder_memopt") and text not in messages:
            messages.append(text)
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = show_and_record
    return messages


def worker_main(trial_file: Path) -> int:
    """Run the trial in ``trial_file``; rank 0 writes result.json next to it, failing ranks rank<N>.json."""
    trial = Trial(**json.loads(trial_file.read_text()))
    out_dir = trial_file.parent
    rank, device = init_distributed(trial)
    memopt_warnings = recording_memopt_warnings()
    with reporting_failure(out_dir, rank, phase="train"):
        session = TrainingSession(trial, device, rank)
        result = {"status": "ok", **session.run_steps()}
    if trial.backend == "thunder+memopt":
        result["memopt_warnings"] = memopt_warnings
        result["memopt_pass_s"] = session.training.memopt.pass_seconds
    if session.training.executors is not None:
        result["executors"] = [ex.name for ex in session.training.executors]
    if trial.backend in EXECUTOR_BACKENDS:
        from thunder_memopt.executors import compile_stats

        stats = compile_stats()
        result["fusion_functions"], result["fusion_compile_s"] = stats.functions, stats.compile_seconds
    if rank == 0:
        write_json(out_dir / "result.json", result)  # kept if the measurement below fails
    if not trial.search:
        with reporting_failure(out_dir, rank, phase="saved-activations"):
            result.update(session.measure_saved_activations())
        if rank == 0:
            write_json(out_dir / "result.json", result)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# Driver: trials one after another, each in fresh processes; rows to --out.
# ----------------------------------------------------------------------------------------------


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def git_tree_hash(directory: Path) -> str:
    """The git tree object id of a directory of .py files (subpackages included), computed from the
    files themselves: ``git rev-parse COMMIT:thunder_memopt`` names the commit whose package a row
    ran, even where the copy that ran it has stale or no git metadata."""
    entries = []
    for path in directory.iterdir():
        if path.is_file() and path.suffix == ".py":
            content = path.read_bytes()
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).digest()
            entries.append((path.name.encode(), b"100644 " + path.name.encode() + b"\0" + blob))
        elif path.is_dir() and any(path.rglob("*.py")):
            tree = bytes.fromhex(git_tree_hash(path))
            # git orders a tree's entries by name, a directory's name as if it ended in "/".
            entries.append((path.name.encode() + b"/", b"40000 " + path.name.encode() + b"\0" + tree))
    body = b"".join(entry for _, entry in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def describe_environment() -> dict:
    probe = subprocess.run([sys.executable, "-c", ENVIRONMENT_PROBE], capture_output=True, text=True, check=True)
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {
        "cuda": found["cuda"],
        "gpu": found["gpu"],
        "torch": importlib.metadata.version("torch"),
        "thunder": importlib.metadata.version("lightning-thunder"),
        "litgpt": importlib.metadata.version("litgpt"),
        "memopt_commit": commit.stdout.strip() or None,
        "memopt_tree": git_tree_hash(repo / "thunder_memopt"),
    }


def worker_environment(compile_cache: Path | None) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if name not in TORCHRUN_RANK_VARIABLES and not name.startswith("TORCHELASTIC_")}
    env["PYTHONUNBUFFERED"] = "1"
    if compile_cache is not None:
        # Cold compile caches, so that first-step times compare across rows and runs.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(compile_cache / "triton")
    return env


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this driver started for one trial."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=STOP_GRACE_S)
            return


def run_process(command: list[str], env: dict[str, str], log, timeout_s: float) -> int | None:
    """Run ``command`` in its own process group; its exit code, or None if it ran out of time."""
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            stop_process_group(process)


def log_tail(log_path: Path, lines: int = 5) -> str:
    return " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-lines:])


def trial_outcome(work_dir: Path, exit_code: int | None, timeout_s: float, log_path: Path) -> dict:
    """The worker's result, or a status that says why there is none."""
    result = read_json(work_dir / "result.json")
    failures = [read_json(path) for path in sorted(work_dir.glob("rank*.json"))]
    training_failures = [failure for failure in failures if failure["phase"] == "train"]
    if result is not None and not training_failures:
        for failure in failures:  # the saved-activation measurement, after the steps
            result["saved_error"] = f"{failure['status']}: {failure['error']}"
        return result
    if training_failures:
        first = next((f for f in training_failures if f["status"] == "OOM"), training_failures[0])
        return {"status": first["status"], "error": first["error"]}
    if exit_code is None:
        return {"status": "timeout", "error": f"stopped after {timeout_s:.0f} s"}
    return {"status": "error", "error": f"exit code {exit_code}: {log_tail(log_path)}"}


def launch_trial(trial: Trial, log_path: Path, timeout_s: float) -> dict:
    """Run ``trial`` under a fresh ``torch.distributed.run`` and return its outcome."""
    with tempfile.TemporaryDirectory(prefix="benchmark_fsdp2_") as work:
        work_dir = Path(work)
        trial_file = work_dir / "trial.json"
        write_json(trial_file, dataclasses.asdict(trial))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={trial.world_size}", str(Path(__file__).resolve()), "--worker", str(trial_file)]
        # Search probes share the compile caches: there, only whether a size fits matters.
        env = worker_environment(None if trial.search else work_dir)
        with open(log_path, "w") as log:
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            exit_code = run_process(command, env, log, timeout_s)
        return trial_outcome(work_dir, exit_code, timeout_s, log_path)


def same_measurement(row: dict, key: dict) -> bool:
    """Whether ``row`` measured what ``key`` describes. A field added after the row was written takes
    the value that rows had before (make_table.FIELD_DEFAULTS); the MemoryOptimization options count
    only for thunder+memopt, so --resume keeps, say, an eager row written before they existed."""
    ignored = () if key.get("backend") in EXECUTOR_BACKENDS else MEMOPT_ONLY_FIELDS
    return all(make_table.field_value(row, field) == value
               for field, value in key.items() if field not in ignored)


class TimeLimitReached(Exception):
    """Not enough of --time-limit is left for another trial."""


class Driver:
    """Runs trials in fresh processes, appends their rows to --out and keeps this run's rows."""

    def __init__(self, args: argparse.Namespace, environment: dict) -> None:
        self.args = args
        self.environment = environment
        self.out = Path(args.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.log_dir = Path(args.log_dir) if args.log_dir else self.out.with_suffix(".logs")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.earlier_rows = make_table.load_rows([self.out]) if args.resume and self.out.exists() else []
        self.deadline = time.monotonic() + args.time_limit * 60 if args.time_limit else None
        self.longest_trial_s = 0.0
        self.trials = 0
        self.rows: list[dict] = []

    def earlier_row(self, key: dict) -> dict | None:
        """With --resume, the last row of --out that measured ``key`` (a run row only if ok or OOM)."""
        matches = [row for row in self.earlier_rows
                   if row.get("status", "ok") in FINAL_STATUSES and same_measurement(row, key)]
        return matches[-1] if matches else None

    def trial_timeout(self) -> tuple[float, bool]:
        """Seconds the next trial may take, and whether --time-limit (not --trial-timeout) sets them."""
        if self.deadline is None:
            return self.args.trial_timeout, False
        left = self.deadline - time.monotonic()
        if left < max(self.longest_trial_s, 1.0):
            raise TimeLimitReached
        return min(left, self.args.trial_timeout), left < self.args.trial_timeout

    def context(self) -> dict:
        """What every row says about where, when and how it was measured."""
        return {**self.environment, "vocab_size": self.args.vocab_size,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": shlex.join(sys.argv)}

    def record(self, key: dict, row: dict) -> None:
        """Append ``row`` to --out, unless --resume found one with the same key there already."""
        earlier = self.earlier_row(key)
        if earlier is not None:
            self.rows.append(earlier)
            return
        with open(self.out, "a") as out:
            out.write(json.dumps(row) + "\n")
        self.rows.append(row)

    def run(self, trial: Trial) -> dict:
        self.trials += 1
        key = {"row_type": "run", **trial.resume_key()}
        earlier = self.earlier_row(key)
        if earlier is not None:
            print(f"[{self.trials}] {trial.describe()}: {earlier['status']} in {self.out} (--resume)", flush=True)
            self.rows.append(earlier)
            return earlier
        timeout_s, limited_by_deadline = self.trial_timeout()
        print(f"[{self.trials}] {trial.describe()} ...", flush=True)
        budget = "" if trial.budget is None else f"@{trial.budget:g}"
        log_path = self.log_dir / f"{time.strftime('%Y%m%d-%H%M%S')}_{trial.backend}{budget}_T{trial.block_size}.log"
        started = time.monotonic()
        outcome = launch_trial(trial, log_path, timeout_s)
        elapsed = time.monotonic() - started
        if outcome["status"] == "timeout" and limited_by_deadline:
            raise TimeLimitReached
        self.longest_trial_s = max(self.longest_trial_s, elapsed)
        row = {**key, **self.context(), "log": str(log_path), "wall_s": elapsed,
               **dict.fromkeys(MEMORY_FIELDS), **outcome}
        self.record(key, row)
        print(f"    -> {make_table.describe_row(row)} [{elapsed:.0f} s, log {log_path}]", flush=True)
        return row


def budgets_for(backend: str, args: argparse.Namespace) -> list[float | None]:
    return {"inductor-budget": args.inductor_budget, "thunder+memopt": args.memopt_budget}.get(backend, [None])


def trial_template(args: argparse.Namespace, world_size: int) -> Trial:
    """The trial with the command line's settings; backend, budget and block size filled per row."""
    return Trial(model=args.model_name, n_layer=args.n_layer, n_embd=args.resolved_n_embd,
                 narrowed=args.n_embd is not None,
                 block_size=args.block_size[0], micro_batch_size=args.micro_batch_size, dtype=DTYPES[args.dtype],
                 distributed_mode=args.distributed_mode, shard_mode=args.shard_mode,
                 world_size=1 if args.distributed_mode == "none" else world_size, backend=args.compile[0], budget=None,
                 warmup=args.warmup, iters=args.iters, seed=args.seed, profile=args.profile,
                 memopt_passes=None if args.memopt_passes is None else tuple(args.memopt_passes),
                 fusion=args.fusion, autocast=args.autocast, loss_mode=args.loss_mode)


def snapshot_path(base: str | None, trial: Trial) -> str | None:
    """One memory snapshot file per row: the backend, budget and block size go into the name."""
    if base is None:
        return None
    path = Path(base)
    budget = "" if trial.budget is None else f"-{trial.budget:g}"
    return str(path.with_name(f"{path.stem}.{trial.backend}{budget}.T{trial.block_size}{path.suffix or '.pickle'}"))


def sweep(driver: Driver, args: argparse.Namespace, template: Trial) -> None:
    for block_size in args.block_size:
        for backend in args.compile:
            for budget in budgets_for(backend, args):
                trial = dataclasses.replace(template, backend=backend, budget=budget, block_size=block_size)
                driver.run(dataclasses.replace(trial, memory_snapshot=snapshot_path(args.memory_snapshot, trial)))


class SearchAborted(Exception):
    """A probe failed for a reason other than memory; a larger block size would not tell more."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.block_size = block_size


@dataclasses.dataclass
class ProbeMemory:
    """What the probes of one search have reported: each fitting block size's peak reserved bytes,
    and the most the allocator could hold (``reservable_bytes``), once a probe has told it."""

    peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    capacity: int | None = None


def find_max_block_size(fits: Callable[[int], bool], start: int, granularity: int, limit: int,
                        memory: ProbeMemory | None = None) -> tuple[int | None, int | None]:
    """The largest multiple of ``granularity`` that fits, and the smallest probed one that does not.

    Doubles from ``start`` while it fits (up to ``limit``), halves while it does not, then narrows
    the gap between the two to ``granularity``; each probe is one call of ``fits``. ``start`` must
    be a multiple of ``granularity``. Given ``memory``, which ``fits`` fills as it probes, the search
    aims at where the line through the two largest fitting probes' peaks reaches the capacity, since
    peak memory grows about linearly with T: the doubling jumps to 1, 2, 4... granules past that
    point, and the narrowing probes the point itself. If the device runs out before the line says
    (fragmentation, compile-time buffers), it steps down from there by 1, 2, 4... granules.
    """
    fitting, failing, past = None, None, granularity
    size = start
    while fitting is None or failing is None:
        if fits(size):
            fitting = size
            if failing is not None or size * 2 > limit:
                break
            reach = _where_peak_reaches(memory, fitting, granularity) if memory else None
            if reach is not None and size < reach + past < 2 * size:
                # Past where the line says memory ends; further past each time it fits (a line that
                # falls short), so that a pessimistic line cannot make the search crawl.
                size, past = reach + past, 2 * past
            else:
                size *= 2
        else:
            failing = size
            if fitting is not None or size == granularity:
                break
            size = max(granularity, size // 2 // granularity * granularity)
    aim, back_off = True, 0
    while fitting is not None and failing is not None and failing - fitting > granularity:
        middle = fitting + (failing - fitting) // 2 // granularity * granularity
        reach = _where_peak_reaches(memory, fitting, granularity) if aim and memory else None
        if back_off:
            probe = max(failing - back_off, middle)
        elif reach is not None:
            probe = min(max(reach, fitting + granularity), failing - granularity)
        else:
            probe = middle
        if fits(probe):
            fitting = probe
            # Past one aimed guess or a step down, bisect: a line that fell short would only crawl.
            aim, back_off = False, 0
        else:
            failing = probe
            if back_off:
                back_off *= 2
            elif reach is not None:  # the line is optimistic: step down from here
                aim, back_off = False, granularity
    return fitting, failing


def _where_peak_reaches(memory: ProbeMemory, fitting: int, granularity: int) -> int | None:
    """The block size (a multiple of ``granularity``) where the line through the two largest fitting
    probes' peaks, up to ``fitting``, reaches the capacity; None without it or two such probes."""
    capacity = memory.capacity
    known = sorted((t, p) for t, p in memory.peaks.items() if t <= fitting)
    if capacity is None or len(known) < 2:
        return None
    (t0, p0), (t1, p1) = known[-2:]
    if p1 <= p0:
        return None
    return int(t1 + (capacity - p1) * (t1 - t0) / (p1 - p0)) // granularity * granularity


def search(driver: Driver, args: argparse.Namespace, template: Trial) -> None:
    """--find-max-block-size for every backend and budget; one summary row each."""
    for backend in args.compile:
        for budget in budgets_for(backend, args):
            probe = dataclasses.replace(template, backend=backend, budget=budget, search=True, profile=False)
            statuses: dict[int, str] = {}
            memory = ProbeMemory()

            def fits(block_size: int) -> bool:
                row = driver.run(dataclasses.replace(probe, block_size=block_size))
                status = statuses[block_size] = row["status"]
                if status == "ok" and row.get("peak_reserved_max") is not None:
                    memory.peaks[block_size] = row["peak_reserved_max"]
                if row.get("reservable_bytes") and memory.capacity is None:
                    memory.capacity = row["reservable_bytes"]
                if status not in FINAL_STATUSES:
                    raise SearchAborted(block_size)
                return status == "ok"

            try:
                largest, smallest_failing = find_max_block_size(fits, args.block_size[0], args.search_granularity,
                                                                args.search_limit, memory)
            except SearchAborted as aborted:
                fitting = [size for size, status in statuses.items() if status == "ok"]
                largest, smallest_failing = max(fitting, default=None), aborted.block_size
            key = {"row_type": "max_block_size", **probe.resume_key(), "granularity": args.search_granularity,
                   "search_limit": args.search_limit}
            del key["block_size"]
            summary = {**key, **driver.context(),
                       "max_block_size": largest, "first_failing_block_size": smallest_failing,
                       "failure_status": statuses.get(smallest_failing), "probes": len(statuses)}
            failed = ("none failed" if smallest_failing is None
                      else f"{smallest_failing} failed ({summary['failure_status']})")
            print(f"longest T that fits, {make_table.backend_label(summary)}: {largest}; {failed}", flush=True)
            driver.record(key, summary)


def warn_on_loss_disagreement(rows: list[dict], rtol: float) -> None:
    """A WARNING line for each row whose loss differs from its group's (eager's, else first) loss."""
    groups: dict[tuple, list[dict]] = {}
    for row in make_table.measured_rows(rows):
        if row.get("loss") is not None:
            groups.setdefault(make_table.config_of(row, with_block_size=True), []).append(row)
    for group in groups.values():
        reference = next((row for row in group if row["backend"] == "eager"), group[0])
        for row in group:
            difference = abs(row["loss"] - reference["loss"]) / abs(reference["loss"])
            if difference > rtol:
                print(f"WARNING: loss of {make_table.backend_label(row)} at T={row['block_size']} "
                      f"is {row['loss']:.5f}, "
                      f"{make_table.backend_label(reference)}'s is {reference['loss']:.5f} "
                      f"(relative difference {difference:.2e} > {rtol:g})", flush=True)


def report(driver: Driver, args: argparse.Namespace) -> None:
    if driver.rows:
        print(make_table.markdown(driver.rows), flush=True)
    warn_on_loss_disagreement(driver.rows, args.loss_rtol)
    if args.plot != "none" and make_table.measured_rows(driver.rows):
        plot_path = Path(args.plot) if args.plot else driver.out.with_suffix(".png")
        make_table.plot(driver.rows, plot_path)
        print(f"plot: {plot_path}", flush=True)


def driver_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 drives; the trials start their own ranks
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc_per_node))
    environment = describe_environment()
    resolve_defaults(args, parser, environment["cuda"])
    driver = Driver(args, environment)
    template = trial_template(args, world_size)
    print(f"{len(args.compile)} backend(s) on {template.world_size} x {environment['gpu']}; rows to {driver.out}, "
          f"logs in {driver.log_dir}", flush=True)
    try:
        (search if args.find_max_block_size else sweep)(driver, args, template)
    except TimeLimitReached:
        report(driver, args)
        print(f"--time-limit of {args.time_limit:g} min reached: rerun the same command with --resume to continue",
              flush=True)
        return EXIT_INCOMPLETE
    report(driver, args)
    print(f"done: {len(driver.rows)} rows in {driver.out}", flush=True)
    if not any(row.get("status") == "ok" for row in driver.rows):
        print("no row succeeded", file=sys.stderr, flush=True)
        return EXIT_NO_ROW
    return 0


def resolve_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser, cuda: bool) -> None:
    """Defaults that depend on the machine: without a GPU, a narrowed model and a short sequence."""
    from thunder_memopt.models import narrow_config

    if args.n_embd is None and not cuda:
        args.n_embd = CPU_DEFAULT_N_EMBD
    if args.block_size is None:
        args.block_size = [GPU_DEFAULT_BLOCK_SIZE if cuda else CPU_DEFAULT_BLOCK_SIZE]
    config = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd)
    args.resolved_n_embd, args.vocab_size = config.n_embd, config.padded_vocab_size
    if args.find_max_block_size and args.block_size[0] % args.search_granularity:
        parser.error(f"--block-size {args.block_size[0]} (the search's start) must be a multiple of "
                     "--search-granularity")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # set by the driver only

    model = parser.add_argument_group("model")
    model.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b",
                       help="a litgpt config name")
    model.add_argument("--n-layer", type=positive_int, default=8, help="transformer blocks")
    model.add_argument("--n-embd", type=narrow_width, help="narrow to this width (vocabulary 512); if unset: "
                       f"the real width on GPU, {CPU_DEFAULT_N_EMBD} on CPU")
    model.add_argument("--block-size", type=positive_int, nargs="+", help="sequence length(s) T, a row each; if unset: "
                       f"{GPU_DEFAULT_BLOCK_SIZE} on GPU, {CPU_DEFAULT_BLOCK_SIZE} on CPU")
    model.add_argument("--micro-batch-size", type=positive_int, default=1, help="sequences per rank and step")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameters and compute")
    model.add_argument("--loss-mode", choices=LOSS_MODES, default="in-graph",
                       help="in-graph: the cross-entropy inside the compiled module (default); after it, in eager, "
                            "with the logits held through the step as a training loop holds them: litgpt "
                            "(litgpt's chunked_cross_entropy) or outside-fp32 (cross_entropy of logits.float())")
    model.add_argument("--autocast", action="store_true",
                       help="bf16 torch.autocast over parameters kept in --dtype (which must then be fp32)")
    model.add_argument("--seed", type=int, default=0, help="weights and batch (rank r's batch: seed + r)")

    sharding = parser.add_argument_group("sharding")
    sharding.add_argument("--distributed-mode", choices=DISTRIBUTED_MODES, default="fsdp2")
    sharding.add_argument("--shard-mode", choices=("zero2", "zero3"), default="zero2",
                          help="fsdp2: reshard_after_forward False/True; thunder-fsdp: FSDPType.ZERO2/ZERO3")
    sharding.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks, when not launched by torchrun")

    backends = parser.add_argument_group("backends")
    backends.add_argument("--compile", nargs="+", choices=BACKENDS,
                          help="backends, a row each in fresh processes; "
                               "if unset: all (the thunder ones under thunder-fsdp)")
    backends.add_argument("--inductor-budget", type=fraction, nargs="+", default=[0.5],
                          help="torch._functorch.config.activation_memory_budget for inductor-budget (a row each)")
    backends.add_argument("--memopt-passes", nargs="+", default=None, choices=PASSES,
                          help="MemoryOptimization(passes=...) for thunder+memopt (default: every pass)")
    backends.add_argument("--fusion", choices=sorted(FUSION), default="on",
                          help="thunder+fusion and thunder+memopt: thunder_memopt.executors(fusion=...); off runs every "
                               "op as plain Thunder does (bit-identical)")
    backends.add_argument("--memopt-budget", type=fraction, nargs="+", default=[1.0],
                          help="MemoryOptimization(activation_budget=...) for thunder+memopt (a row each)")

    measure = parser.add_argument_group("measurement")
    measure.add_argument("--warmup", type=positive_int, default=2, help="steps before the peaks are reset (the first compiles)")
    measure.add_argument("--iters", type=positive_int, default=5, help="measured steps")
    measure.add_argument("--profile", action="store_true", help="torch.profiler summary of the measured steps")
    measure.add_argument("--memory-snapshot", metavar="PATH",
                         help="CUDA allocator snapshot of the measured steps (rank 0), one file per row")
    measure.add_argument("--loss-rtol", type=float, default=0.02,
                         help="losses further apart than this (relative) get a WARNING; 0.02 is a few bf16 epsilons")

    search_group = parser.add_argument_group("longest sequence that fits")
    search_group.add_argument("--find-max-block-size", action="store_true",
                              help="per backend, double from the first --block-size, then narrow (aimed on a GPU)")
    search_group.add_argument("--search-granularity", type=positive_int, default=1024, help="narrow down to this many tokens")
    search_group.add_argument("--search-limit", type=positive_int, default=262144, help="largest block size probed")

    output = parser.add_argument_group("output and running")
    output.add_argument("--out", default="benchmark_fsdp2.jsonl", help="JSON lines file, appended to")
    output.add_argument("--plot", help="PNG path (default: --out with .png), or 'none'")
    output.add_argument("--log-dir", help="worker logs (default: --out with .logs)")
    output.add_argument("--resume", action="store_true", help="take ok/OOM rows of identical trials from --out")
    output.add_argument("--time-limit", type=float, help="minutes; start no trial that may not end in time")
    output.add_argument("--trial-timeout", type=float, default=1800, help="seconds before a trial is stopped")

    args = parser.parse_args(argv)
    if args.compile is None:
        args.compile = list(THUNDER_BACKENDS if args.distributed_mode == "thunder-fsdp" else BACKENDS)
    if args.distributed_mode == "thunder-fsdp" and not set(args.compile) <= set(THUNDER_BACKENDS):
        parser.error("thunder-fsdp shards inside thunder.jit: only the thunder backends can run under it")
    if args.autocast and DTYPES[args.dtype] != "float32":
        parser.error("--autocast casts to bf16 inside the step: keep the parameters in --dtype fp32")
    return args, parser


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    if args.worker is not None:
        return worker_main(args.worker)
    return driver_main(args, parser)


if __name__ == "__main__":
    sys.exit(main())
