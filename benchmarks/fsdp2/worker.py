"""One trial on every rank of a fresh torchrun: build the model, shard it, compile it with the
trial's backend, train ``warmup`` + ``iters`` steps and measure them: device and host memory,
step times, saved bytes.

    python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.fsdp2.worker TRIAL_JSON

The driver writes TRIAL_JSON (``Trial.fields()``) and launches this in fresh processes, so that no
compiled code, allocator cache or peak statistic of another trial reaches this one. Rank 0 writes
the measurements to ``result.json`` next to the trial file; a rank that fails writes its status
(``OOM`` or ``error``), message and phase to ``rank<N>.json`` and exits at once, since its peers may
be waiting in a collective that would never end (torchrun then stops them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import resource
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from benchmarks.fsdp2 import compile_rows, fit_rows, hf_models, profiling, simulation, step_model
from benchmarks.fsdp2.backends import BACKENDS, Compiled
from benchmarks.fsdp2.trial import IN_GRAPH_LOSS_MODES, TRANSFORMERS_SOURCE, MemoryPeaks, SavedActivations, StepTimes, Trial
from thunder_memopt.models import (DTYPES, GPTWithLoss, HeadWithLoss, build_model, narrow_config, next_token_loss,
                                   random_batches, training_step)
from thunder_memopt.executors import offload as offload_executor
from thunder_memopt.passes.fit import FitCheck

# Small, so that a handful of steps moves every backend's weights alike and the losses stay comparable.
LEARNING_RATE = 1e-4
ERROR_MESSAGE_CHARS = 2000  # compile errors quote whole commands; the log has the rest
RESULT_FILE = "result.json"
FAILURE_FILES = "rank*.json"  # rank<N>.json


def failure_file(rank: int) -> str:
    return f"rank{rank}.json"


@dataclasses.dataclass(frozen=True)
class Training:
    """A model made ready for one backend and sharding: what a step calls and what it updates."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input_ids, targets) -> loss
    parameters_owner: torch.nn.Module
    fsdp_root: torch.nn.Module | None  # the fully_shard root under fsdp2
    reshard_after_forward: bool
    autocast_device: str | None = None  # bf16 autocast on this device type around the forward
    memopt: object = None  # the MemoryOptimization instance of thunder+memopt (its pass timings)
    executors: list | None = None  # the Thunder executors, for the thunder backends
    thunderfx: object = None  # the ThunderCompiler, for the thunder backends under torch.compile

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training step's forward: under bf16 autocast with --autocast."""
        if self.autocast_device is None:
            return self.forward(input_ids, targets)
        with torch.autocast(self.autocast_device, dtype=torch.bfloat16):
            return self.forward(input_ids, targets)

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


def shard_with_fsdp2(gpt: torch.nn.Module, root: torch.nn.Module, trial: Trial) -> torch.nn.Module:
    """fully_shard each Block of ``gpt`` and its embedding, then the root; returns the root.

    With ``head_unit`` root (the default) the root is ``root`` (``gpt``, or HeadWithLoss around it
    for the in-graph loss), whose unit holds the final norm, the head and the loss, so that they
    compile in one graph (each FSDP2 unit is a graph of its own under torch.compile), where a
    compiler can fuse the head with its cross-entropy (thunder_memopt's loss_head pass). The root's
    unit is resharded and reduce-scattered only when the whole backward ends, so the head's gathered
    weight and its unsharded gradient stay through every Block's backward. With ``head_unit`` loss
    the head and the loss (HeadWithLoss's ``loss_head``) are a unit of their own, one graph too,
    whose input requires grad, so FSDP2 frees both right after the head's backward. With
    ``head_unit`` own the head and the final norm are units of their own and the root is ``gpt``,
    the loss after it: the layout of rows written before 2026-12-01 (trial.HEAD_IN_ROOT_SINCE), to
    compare with them.

    The model is built in ``trial.numerics.dtype``, and the policy computes and reduces in that
    dtype, which for bf16 makes it a no-op cast (the reference numbers: bf16 model +
    MixedPrecisionPolicy(bf16)). Under ``--autocast`` the policy casts nothing: the parameters are
    gathered in their own dtype and autocast's casts of them run inside the compiled graphs.
    """
    head_unit = trial.sharding.head_unit
    units = [*gpt.transformer.h, gpt.transformer.wte]
    if head_unit == "own":
        units += [gpt.lm_head, gpt.transformer.ln_f]
    elif head_unit == "loss":
        if not isinstance(root, HeadWithLoss):  # prepare_training keeps the head in the GPT where it must
            raise ValueError("--head-unit loss: the model's final logits are soft-capped after its head, so the "
                             "head cannot be a unit with the loss; use --head-unit root")
        units.append(root.loss_head)
    return fully_shard_units(units, gpt if head_unit == "own" else root, trial)


def fully_shard_units(units: list[torch.nn.Module], root: torch.nn.Module, trial: Trial) -> torch.nn.Module:
    """fully_shard each of ``units``, then ``root``, in the trial's shard mode and dtype; returns the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = DTYPES[trial.numerics.dtype]
    policy = (MixedPrecisionPolicy() if trial.numerics.autocast
              else MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype))
    options = {"mp_policy": policy, "reshard_after_forward": trial.sharding.shard_mode == "zero3"}
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(root, **options)
    return root


def prepare_training(gpt: torch.nn.Module, trial: Trial, device: torch.device) -> Training:
    """``gpt`` (a litgpt GPT, or a transformers causal LM) with its loss, sharded by
    ``trial.sharding`` and compiled by ``trial``'s backend."""
    backend = BACKENDS[trial.compilation.backend]
    distributed_mode, loss_mode = trial.sharding.distributed_mode, trial.numerics.loss_mode
    if backend.before_sharding is not None:
        backend.before_sharding(gpt)  # before fully_shard, so FSDP2 wraps what it changed
    if trial.workload.model_source == TRANSFORMERS_SOURCE:
        # The model is compiled whole and computes its own loss; FSDP2's units: each decoder layer, the root.
        fsdp_root = (fully_shard_units(hf_models.decoder_layers(gpt), gpt, trial) if distributed_mode == "fsdp2"
                     else None)
        compiled = backend.compile(gpt, trial, device)
        return training_of(compiled, hf_models.loss_from_labels(compiled.forward), fsdp_root, trial, device)
    head_with_loss = trial.sharding.head_unit != "own" and gpt.config.final_logit_softcapping is None
    upcast_logits = loss_mode == "in-graph-fp32"
    if loss_mode not in IN_GRAPH_LOSS_MODES:
        module = gpt
    elif distributed_mode == "fsdp2" and head_with_loss:
        module = HeadWithLoss(gpt, upcast_logits=upcast_logits)
    else:
        module = GPTWithLoss(gpt, upcast_logits=upcast_logits)
    fsdp_root = shard_with_fsdp2(gpt, module, trial) if distributed_mode == "fsdp2" else None
    if trial.sharding.simulated:  # built on the meta device: rank 0's shards get memory now
        simulation.materialize_shards(module, device, trial.workload.seed)
    compiled = backend.compile(module, trial, device)
    return training_of(compiled, with_loss(compiled.forward, loss_mode), fsdp_root, trial, device)


def training_of(compiled: Compiled, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                fsdp_root: torch.nn.Module | None, trial: Trial, device: torch.device) -> Training:
    """The Training of a backend's ``compiled`` module, whose step calls ``forward``."""
    return Training(forward, compiled.parameters_owner, fsdp_root=fsdp_root,
                    reshard_after_forward=trial.sharding.shard_mode == "zero3",
                    autocast_device=device.type if trial.numerics.autocast else None,
                    memopt=compiled.memopt, executors=compiled.executors, thunderfx=compiled.thunderfx)


def with_loss(compiled: Callable, loss_mode: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(input_ids, targets) -> loss. In IN_GRAPH_LOSS_MODES ``compiled`` is GPTWithLoss (or
    HeadWithLoss) and returns the loss.
    Otherwise ``compiled`` returns the logits and the loss is computed after it, in eager, as a
    litgpt training loop does; the logits stay alive until the loss is dropped, as the loop's
    variable does through backward and the optimizer step."""
    if loss_mode in IN_GRAPH_LOSS_MODES:
        return compiled
    from litgpt.utils import chunked_cross_entropy

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


def over_ranks(values: list[int], device: torch.device, op: dist.ReduceOp.RedOpType) -> list[int]:
    """``values`` reduced elementwise over the ranks by ``op`` (MAX, MIN); as they are on one process."""
    if not dist.is_initialized():
        return list(values)
    reduced = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(reduced, op=op)
    return reduced.tolist()


def memory_peaks(device: torch.device) -> MemoryPeaks:
    """This rank's peaks (rank 0's row) and their maximum over ranks: on CUDA, the allocator's
    allocated and reserved bytes and the pinned host allocator's, since their reset after warm-up;
    and this process's peak resident set."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if device.type != "cuda":
        (rss_max,) = over_ranks([rss], device, dist.ReduceOp.MAX)
        return MemoryPeaks(host_rss_peak_rank0=rss, host_rss_peak_max=rss_max)
    # The pinned allocator's blocks (cached ones too); the key is absent until it has allocated.
    pinned = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0)
    alloc, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    alloc_max, reserved_max, rss_max, pinned_max = over_ranks([alloc, reserved, rss, pinned], device,
                                                              dist.ReduceOp.MAX)
    return MemoryPeaks(alloc, reserved, alloc_max, reserved_max, rss, rss_max, pinned, pinned_max)


def reservable_bytes(device: torch.device) -> int | None:
    """The most PyTorch's allocator could hold on any rank: free device memory plus what it holds,
    so the CUDA context and NCCL's buffers are left out. The minimum over ranks."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    (reservable,) = over_ranks([free + torch.cuda.memory_reserved(device)], device, dist.ReduceOp.MIN)
    return reservable


class TrainingSession:
    """The model, optimizer and batch of one trial on one rank."""

    def __init__(self, trial: Trial, device: torch.device, rank: int) -> None:
        self.trial, self.device, self.rank = trial, device, rank
        workload = trial.workload
        self.config, model = build_trial_model(trial, device)
        self.training = prepare_training(model, trial, device)
        self.optimizer = torch.optim.AdamW(self.training.parameters_owner.parameters(), lr=LEARNING_RATE,
                                           **{trial.numerics.optimizer: True})  # foreach=True or fused=True
        if device.type == "cuda":
            # build_model makes fp32 weights and then casts them: give that cache back, so that reserved
            # memory shows what training needs.
            torch.cuda.empty_cache()
        # Same seed in every backend: same weights and batches, so the losses must agree.
        self.batches = random_batches(self.config, count=workload.batches, batch_size=workload.micro_batch_size,
                                      seq_len=workload.block_size, device=device, seed=workload.seed + rank)

    def run_steps(self) -> dict:
        """Warm-up steps (the first compiles; thunder+memopt-fit's last one checked against its plan, and
        one more where the check plans again), then the measured steps: their peaks, times and loss."""
        measurement, device = self.trial.measurement, self.device
        batches = itertools.cycle(self.batches)
        losses: list[torch.Tensor] = []  # every step's, read once at the end (no host sync per step)

        def step() -> torch.Tensor:
            loss = training_step(self.training.loss, self.optimizer, *next(batches))
            losses.append(loss.detach())
            return loss

        memopt = self.training.memopt
        # thunder+memopt-fit on CUDA checks the last warm-up step's peak, on its own: reset before each.
        fit_check = memopt is not None and memopt.memory_limit is not None and device.type == "cuda"
        with profiling.first_step_profiler(measurement.first_step_profile and self.rank == 0) as first_profiler:
            if fit_check:
                torch.cuda.reset_peak_memory_stats(device)
            _, first_step_s = timed(step, device)  # includes compilation
        for _ in range(measurement.warmup - 1):
            if fit_check:
                torch.cuda.reset_peak_memory_stats(device)
            timed(step, device)
        fit_checks = self.check_fit(step, self.allocator_peak) if fit_check else []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.reset_peak_host_memory_stats()
        snapshot = measurement.memory_snapshot if self.rank == 0 else None
        step_seconds = []
        recorder = simulation.TimelineRecorder(device) if self.trial.sharding.simulated else None
        with (profiling.recording_memory_history(snapshot, device),
              profiling.profiler_for(measurement.profile, device) as profiler,
              offload_executor.activity_recorded() as offload_activity,
              recorder.recording(self.optimizer) if recorder else contextlib.nullcontext()):
            measured_step = step if recorder is None else functools.partial(recorder.step, step)
            for _ in range(measurement.iters):
                loss, seconds = timed(measured_step, device)
                step_seconds.append(seconds)
        median_s = statistics.median(step_seconds)
        tokens = self.trial.workload.micro_batch_size * self.trial.workload.block_size
        times = StepTimes(step_ms=median_s * 1e3, step_ms_all=[s * 1e3 for s in step_seconds],
                          tokens_per_s_per_gpu=tokens / median_s, first_step_s=first_step_s,
                          compile_s=first_step_s - median_s, loss=loss.item(),
                          step_losses=[value.item() for value in losses])
        result = {**dataclasses.asdict(memory_peaks(device)),
                  "reservable_bytes": reservable_bytes(device), **dataclasses.asdict(times)}
        if memopt is not None and memopt.memory_limit is not None:
            result.update(fit_rows.fit_fields(memopt.fit_report, fit_checks))
        if memopt is not None and memopt.offload_plans:
            # Per step: how long the compute stream stood still for offload's copies (CUDA only), and
            # how many reloads a prefetch had started before they were asked for.
            result["offload_wait_ms"] = {kind: ms / measurement.iters for kind, ms in offload_activity.wait_ms.items()}
            result["offload_reloads"] = offload_activity.reloads / measurement.iters
            result["offload_reloads_prefetched"] = offload_activity.prefetched / measurement.iters
        if profiler is not None:
            profiling.print_table(profiler, device)
            result["profile"] = profiling.profile_summary(profiler, sum(step_seconds))
        if first_profiler is not None:
            result["first_step_profile"] = profiling.first_step_summary(first_profiler)
        if snapshot is not None and device.type == "cuda":
            result["memory_snapshot"] = snapshot
        if recorder is not None:
            result.update(self.simulation_fields(simulation.median_timeline(recorder.timelines())))
        return result

    def check_fit(self, step: Callable[[], torch.Tensor], peak: Callable[[], int]) -> list[FitCheck]:
        """thunder+memopt-fit after the warm-up: the step's peak since its reset (``peak``) against the
        plan (``MemoryOptimization.check_fit``). Where a check plans again, one more step compiles the
        second plan, and it is checked too. Every rank takes the same path, since that step runs
        collectives: ``peak`` is the maximum over ranks, and any rank's second plan runs the step on all."""
        memopt = self.training.memopt
        checks = [memopt.check_fit(peak())]
        (replan,) = over_ranks([int(checks[0].replan)], self.device, dist.ReduceOp.MAX)
        if replan:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            timed(step, self.device)
            checks.append(memopt.check_fit(peak()))
        return checks

    def allocator_peak(self) -> int:
        """The CUDA allocator's peak allocated bytes since its reset, the maximum over ranks."""
        (peak,) = over_ranks([torch.cuda.max_memory_allocated(self.device)], self.device, dist.ReduceOp.MAX)
        return peak

    def simulation_fields(self, timeline: step_model.Timeline) -> dict[str, Any]:
        """A simulated row's measured timeline (the driver models its step from it), each unit's
        compute, and the parameters whose shards are uneven (rank 0's, the largest, is measured)."""
        uneven = simulation.uneven_parameters(self.training.parameters_owner, self.trial.sharding.world_size)
        return {"sim_timeline": timeline.to_json(),
                "sim_unit_ms": {unit: [round(ms, 4) for ms in times]
                                for unit, times in step_model.unit_compute_ms(timeline).items()},
                "sim_uneven_parameters": uneven}

    def measure_saved_activations(self) -> SavedActivations:
        """Bytes saved for backward by one more forward (storages, parameters excluded), per layer.

        It covers the whole model, embedding, head and loss included. Block inputs that a checkpoint
        wrapper holds (eager-ac) are invisible to saved-tensor hooks; under thunder-fsdp zero2 the
        all-gathered weights saved for backward are counted as activations.
        """
        from thunder_memopt.measure import measure_saved

        with self.training.forward_parameters() as parameters:
            saved = measure_saved(self.training.forward, *self.batches[0], parameters=parameters,
                                  device=self.device)
            saved.output.backward()
        self.optimizer.zero_grad(set_to_none=True)
        workload = self.trial.workload
        tokens = workload.micro_batch_size * workload.block_size
        return SavedActivations(saved_bytes_per_layer=saved.activation_bytes / workload.n_layer,
                                saved_storages=saved.n_storages,
                                saved_h_bytes=saved.activation_bytes / (tokens * workload.n_embd * workload.n_layer))


def build_trial_model(trial: Trial, device: torch.device) -> tuple[Any, torch.nn.Module]:
    """The trial's config (litgpt's or transformers') and its model, with the seed's weights."""
    workload, dtype = trial.workload, DTYPES[trial.numerics.dtype]
    n_embd = workload.n_embd if workload.narrowed else None
    if workload.model_source == TRANSFORMERS_SOURCE:
        config = hf_models.config(workload.model, n_layer=workload.n_layer, n_embd=n_embd,
                                  block_size=workload.block_size)
        return config, hf_models.build(workload.model, config, dtype=dtype, device=device, seed=workload.seed)
    config = narrow_config(workload.model, n_layer=workload.n_layer, n_embd=n_embd, block_size=workload.block_size)
    # Simulated ranks hold 1/N of a model that may not fit one device: built on meta, then sharded.
    return config, build_model(config, dtype=dtype, seed=workload.seed,
                               device="meta" if trial.sharding.simulated else device)


def cap_device_memory(cap_gib: float | None, device: torch.device) -> int | None:
    """--memory-cap: torch's caching allocator on the CUDA ``device`` may reserve at most ``cap_gib``
    GiB (``set_per_process_memory_fraction`` of the device's total); past it an allocation frees the
    cached blocks and retries, then raises torch.OutOfMemoryError, as on a card of that size. The
    CUDA context's and NCCL's memory are outside the cap. The cap in bytes, or None."""
    if cap_gib is None:
        return None
    cap, total = int(cap_gib * 2**30), torch.cuda.get_device_properties(device).total_memory
    if cap > total:
        raise ValueError(f"--memory-cap {cap_gib:g} GiB is more than the device's {total / 2**30:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap


def init_distributed(trial: Trial) -> tuple[int, torch.device]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # Before anything is allocated: the settings apply to the segments made after them.
        if trial.measurement.allocator_settings is not None:
            torch.cuda.memory._set_allocator_settings(trial.measurement.allocator_settings)
        cap_device_memory(trial.measurement.memory_cap_gib, device)
    else:
        device = torch.device("cpu")
    if trial.sharding.distributed_mode == "none":
        return 0, device
    if trial.sharding.simulated:
        simulation.init_fake_process_group(trial.sharding.world_size)
    elif device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), device


def is_out_of_memory(error: BaseException) -> bool:
    # Fusers and collectives can re-raise an allocator failure as a RuntimeError.
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def one_line(message: str) -> str:
    """A failure's message as the row's one line: its lines joined with " | "."""
    return " | ".join(line.strip() for line in message.splitlines() if line.strip())


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def leave(code: int) -> NoReturn:
    """Exit at once, with the output flushed, and without the interpreter's finalization."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_process_group() -> NoReturn:
    """The end of a rank that ran distributed: the process group torn down, then ``leave(0)``.
    gloo's worker threads can still free a finished collective's tensors while the interpreter
    shuts down, and taking the GIL then aborts the process ("terminate called without an active
    exception", pytorch/pytorch#190489) after its results are written."""
    dist.destroy_process_group()
    leave(0)


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
        message = one_line(f"{type(error).__name__}: {error}")[:ERROR_MESSAGE_CHARS]
        write_json(out_dir / failure_file(rank), {"status": status, "error": message, "phase": phase})
        leave(1)


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


def run(trial_file: Path) -> int:
    """Run the trial in ``trial_file``; rank 0 writes result.json next to it, failing ranks rank<N>.json."""
    trial = Trial.from_fields(json.loads(trial_file.read_text()))
    out_dir = trial_file.parent
    rank, device = init_distributed(trial)
    memopt_warnings = recording_memopt_warnings()
    with reporting_failure(out_dir, rank, phase="train"):
        session = TrainingSession(trial, device, rank)
        result = {"status": "ok", **session.run_steps()}
    training = session.training
    if training.memopt is not None:
        result["memopt_warnings"] = memopt_warnings
        result["memopt_pass_s"] = training.memopt.pass_seconds
        result["memopt_donated_outputs"] = training.memopt.donated_outputs
        if training.memopt.offload_plans:
            result.update(compile_rows.offload_fields(training.memopt.offload_plans))
    if training.executors is not None:
        result["executors"] = [ex.name for ex in training.executors]
    if training.thunderfx is not None:
        result["thunderfx"] = compile_rows.thunderfx_summary(training.thunderfx)
    if "fusion" in BACKENDS[trial.compilation.backend].own_fields:  # runs thunder_memopt's executors
        from thunder_memopt.executors import compile_stats

        stats = compile_stats()
        result["fusion_functions"], result["fusion_compile_s"] = stats.functions, stats.compile_seconds
        # Input layouts compiled ahead of their first calls (MemoryOptimization) and at them.
        result["fusion_layouts_ahead"], result["fusion_layouts_at_call"] = stats.layouts_ahead, stats.layouts_at_call
        # Of fusion_compile_s: inductor's lowering, and the waits for kernels compiled ahead, at first runs.
        result["fusion_lowering_s"], result["fusion_kernel_wait_s"] = stats.lowering_seconds, stats.kernel_wait_seconds
    if rank == 0:
        write_json(out_dir / RESULT_FILE, result)  # kept if the measurement below fails
    if not trial.measurement.search:
        with reporting_failure(out_dir, rank, phase="saved-activations"):
            result.update(dataclasses.asdict(session.measure_saved_activations()))
        if rank == 0:
            write_json(out_dir / RESULT_FILE, result)
    if dist.is_initialized():
        leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
