"""The long-run check, on the ranks: train one model for many steps on real text under one setting
and write every step's loss.

A few steps show that a backend computes the right numbers once. A missed synchronisation of
offload's side stream, an aliasing mistake of the donate pass or a stale compiled region shows only
over hundreds of steps, as a loss curve that drifts from eager's or as a NaN. So each setting (a
backend of ``backends.BACKENDS`` with its budget and options) trains the same model, from the same
weights, on the same batches:

- the text is the Python standard library's source files read as bytes (every machine has them, and
  code suits stablecode, a code model): vocabulary 256, padded as litgpt pads it
  (``padded_vocab_size``), in windows of T + 1 bytes whose order one seed fixes (``ByteBatches``);
- AdamW with a linear warm-up, then a constant or cosine learning rate, the gradients clipped to a
  total norm before each step (``Schedule``);
- the model is built, sharded and compiled by the benchmark's worker (``worker.prepare_training``);
  a perturbed setting first moves one weight one rounding step (``perturb_one_weight``): the control
  whose distance from its unperturbed twin measures the training's own chaos.

Each setting runs in fresh processes (``long_run_driver``), so that no compiled code of another
setting reaches it:

    python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.fsdp2.long_run RUN_JSON

Rank 0 appends one JSON line per step to ``steps.jsonl`` next to RUN_JSON as it goes (the driver
reads it for its progress lines): the step's loss (rank 0's batch), the learning rate it used, its
seconds, and the norm of rank 0's parameter shards after it, which tells two runs apart even where
a bf16 loss is too coarse to show their difference, and, with clipping, the gradients' norm before
it. Then ``result.json`` (``worker.RESULT_FILE``): the corpus, and what one more forward saves for
backward (bytes and storages over every device, host copies of offloaded tensors included), which
differs where two settings save, and so recompute, different tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.fsdp2 import worker
from benchmarks.fsdp2.trial import Trial
from thunder_memopt.models import DTYPES, build_model, narrow_config, training_step

BYTE_VOCAB = 256
STEPS_FILE = "steps.jsonl"
SCHEDULES = ("constant", "cosine")
# The weight a perturbation moves: in the first block's attention projection, which every litgpt
# model has.
PERTURBED_PARAMETER = "transformer.h.0.attn.qkv.weight"
# Directories of the standard library's tree that hold installed packages, not its own sources.
NOT_STDLIB = {"site-packages", "dist-packages"}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """AdamW's learning rate: ``lr * (s + 1) / (warmup_steps + 1)`` at step s of the warm-up (linear,
    ``lr`` at step ``warmup_steps``), then constant, or cosine down to ``lr * min_lr_ratio`` at the
    last step; and the total norm the gradients are clipped to before each step (0: not clipped)."""

    lr: float
    warmup_steps: int
    lr_schedule: str = "cosine"  # one of SCHEDULES
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 0.0

    def scheduler(self, optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
        from torch.optim import lr_scheduler

        after = steps - self.warmup_steps
        if self.lr_schedule == "cosine":
            main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, after - 1), eta_min=self.lr * self.min_lr_ratio)
        else:
            main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        if self.warmup_steps == 0:
            return main
        warm_up = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / (self.warmup_steps + 1),
                                         total_iters=self.warmup_steps)
        return lr_scheduler.SequentialLR(optimizer, [warm_up, main], milestones=[self.warmup_steps])


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What one setting's ranks need: the trial (model, sharding, backend and its options) and the
    training around it."""

    trial: Trial
    steps: int
    schedule: Schedule
    # torch.use_deterministic_algorithms(True): kernels that repeat their bits, so that a pair can be
    # bit-identical at all (thunder_memopt's cuDNN attention declines in this mode: its backward does
    # not repeat its bits). Not warn_only: an op with no deterministic kernel raises, and its setting
    # fails saying which.
    deterministic: bool = True
    perturbation: int | None = None  # perturb_one_weight's seed; None: the weights as built

    def to_json(self) -> dict[str, Any]:
        return {"trial": self.trial.fields(), "steps": self.steps, "schedule": dataclasses.asdict(self.schedule),
                "deterministic": self.deterministic, "perturbation": self.perturbation}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSpec:
        return cls(Trial.from_fields(data["trial"]), data["steps"], Schedule(**data["schedule"]), data["deterministic"],
                   data["perturbation"])


@dataclasses.dataclass(frozen=True)
class Perturbation:
    """Which weight ``perturb_one_weight`` moved, and its value before and after."""

    parameter: str
    index: int  # into the parameter flattened
    before: float
    after: float

    def fields(self) -> dict[str, Any]:
        return {f"perturbed_{name}": value for name, value in dataclasses.asdict(self).items()}


def perturb_one_weight(model: torch.nn.Module, seed: int) -> Perturbation:
    """Move one weight of ``PERTURBED_PARAMETER`` (drawn by ``seed``) by one rounding step of its
    dtype, away from zero (``torch.nextafter``), in place: the least change a backend that rounds
    differently makes. The same weight on every device and rank (a CPU generator draws it)."""
    weight = model.get_parameter(PERTURBED_PARAMETER).data.view(-1)
    index = int(torch.randint(weight.numel(), (1,), generator=torch.Generator().manual_seed(seed)))
    before = weight[index].to("cpu", copy=True)  # not a view: the weight changes below
    after = torch.nextafter(before, torch.tensor(float("inf"), dtype=before.dtype).copysign(before))
    weight[index] = after.to(weight.device)
    return Perturbation(PERTURBED_PARAMETER, index, before.item(), after.item())


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files (installed packages left out), in the order of their
    paths: the same files in the same order on every run of one Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py")
             if path.is_file() and not NOT_STDLIB & set(path.relative_to(root).parts)]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The standard library's sources as one byte string, and what identifies it."""

    data: bytes
    files: int
    sha256: str

    @classmethod
    def read(cls) -> Corpus:
        sources = stdlib_sources()
        data = b"".join(path.read_bytes() for path in sources)
        return cls(data, len(sources), hashlib.sha256(data).hexdigest())

    def fields(self) -> dict[str, Any]:
        return {"corpus_bytes": len(self.data), "corpus_files": self.files, "corpus_sha256": self.sha256,
                "python": sys.version.split()[0]}


class ByteBatches:
    """Non-overlapping windows of ``seq_len + 1`` bytes of the corpus, in an order drawn from
    ``seed`` (a new one each pass over the corpus): step s gives rank r the windows
    ``(s * world_size + r) * micro_batch ...`` of that order, so every setting sees the same batches."""

    def __init__(self, corpus: bytes, *, seq_len: int, micro_batch: int, world_size: int, rank: int,
                 seed: int) -> None:
        self.tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self.window = seq_len + 1
        self.windows = len(self.tokens) // self.window
        if self.windows == 0:
            raise ValueError(f"the corpus ({len(corpus)} bytes) is shorter than one window of {self.window}")
        self.micro_batch, self.world_size, self.rank, self.seed = micro_batch, world_size, rank, seed
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        """The windows' order in pass ``epoch`` over the corpus."""
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(self.windows, generator=generator)
        return self._orders[epoch]

    def batch(self, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, targets) of ``step`` on this rank: (micro_batch, seq_len) int64 each."""
        first = (step * self.world_size + self.rank) * self.micro_batch
        starts = [int(self.order(index // self.windows)[index % self.windows]) * self.window
                  for index in range(first, first + self.micro_batch)]
        rows = torch.stack([self.tokens[start:start + self.window] for start in starts]).long().to(device)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def with_byte_vocabulary(config):
    """A litgpt config with the byte vocabulary, padded by litgpt's own rule
    (``Config.__post_init__``: a multiple of ``padding_multiple``)."""
    return dataclasses.replace(config, vocab_size=BYTE_VOCAB, padded_vocab_size=None)


def byte_config(trial: Trial):
    """The trial's litgpt config (``narrow_config``) with the byte vocabulary."""
    workload = trial.workload
    return with_byte_vocabulary(narrow_config(workload.model, n_layer=workload.n_layer,
                                              n_embd=workload.n_embd if workload.narrowed else None,
                                              block_size=workload.block_size))


def clip_gradients_before_each_step(optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor],
                                    max_norm: float) -> list[float]:
    """Clip the gradients' total norm to ``max_norm`` before each of ``optimizer``'s steps (a step
    pre-hook: the training step stays the library's ``training_step``). The list gets each step's
    norm before clipping, over every rank's shards."""
    norms: list[float] = []

    def clip(*_) -> None:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
        norms.append((norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item())

    optimizer.register_step_pre_hook(clip)
    return norms


def parameters_norm(parameters: list[torch.Tensor]) -> float:
    """The 2-norm of this rank's parameter shards, accumulated in fp32 per tensor, then in fp64."""
    local = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in parameters]
    # Not torch.nn.utils.get_total_norm: it keeps the parameters' dtype, and a bf16 norm would hide
    # the small differences this norm is here to show.
    norms = torch._foreach_norm(local, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms).double()).item()


@dataclasses.dataclass(frozen=True)
class Trained:
    """A finished run: what its run row adds, and what ``measure_plan`` needs."""

    fields: dict[str, Any]
    training: worker.Training
    optimizer: torch.optim.Optimizer
    batch: tuple[torch.Tensor, torch.Tensor]  # step 0's


def train(spec: RunSpec, device: torch.device, rank: int, steps_path: Path | None) -> Trained:
    """``spec.steps`` AdamW steps; each step's row is appended to ``steps_path`` (rank 0's; None on
    the other ranks)."""
    trial = spec.trial
    corpus = Corpus.read()
    config = byte_config(trial)
    gpt = build_model(config, dtype=DTYPES[trial.numerics.dtype], seed=trial.workload.seed, device=device)
    perturbed = {} if spec.perturbation is None else perturb_one_weight(gpt, spec.perturbation).fields()
    training = worker.prepare_training(gpt, trial, device)
    parameters = list(training.parameters_owner.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=spec.schedule.lr, **{trial.numerics.optimizer: True})
    scheduler = spec.schedule.scheduler(optimizer, spec.steps)
    # Clipping at 1.0 is the common practice of pre-training recipes: a spike's step stays small.
    max_norm = spec.schedule.max_grad_norm
    grad_norms = clip_gradients_before_each_step(optimizer, parameters, max_norm) if max_norm else None
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    batches = ByteBatches(corpus.data, seq_len=trial.workload.block_size, micro_batch=trial.workload.micro_batch_size,
                          world_size=world_size, rank=rank, seed=trial.workload.seed)
    seconds = []
    for step in range(spec.steps):
        input_ids, targets = batches.batch(step, device)
        lr = scheduler.get_last_lr()[0]
        loss, step_s = worker.timed(functools.partial(training_step, training.loss, optimizer, input_ids, targets),
                                    device)
        scheduler.step()
        seconds.append(step_s)
        if steps_path is not None:
            row = {"step": step, "loss": loss.item(), "lr": lr, "step_s": step_s,
                   "params_norm": parameters_norm(parameters)}
            if grad_norms is not None:
                row["grad_norm"] = grad_norms[-1]
            with open(steps_path, "a") as steps_file:  # line by line: the driver follows it
                steps_file.write(json.dumps(row) + "\n")
    fields = {**corpus.fields(), **perturbed, "vocab_size": config.vocab_size,
              "padded_vocab_size": config.padded_vocab_size, "first_step_s": seconds[0],
              "median_step_s": statistics.median(seconds[1:] or seconds)}
    return Trained(fields, training, optimizer, batches.batch(0, device))


def measure_plan(training: worker.Training, optimizer: torch.optim.Optimizer,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
    """What one more forward saves for backward, on every device (an offloaded tensor's host copy
    counts as the tensor), parameters excluded; its backward runs and the gradients are dropped, so
    the trained weights stay as they were."""
    from thunder_memopt.measure import measure_saved

    with training.forward_parameters() as parameters:
        saved = measure_saved(training.loss, *batch, parameters=parameters)
        saved.output.backward()
    optimizer.zero_grad(set_to_none=True)
    return {"plan_saved_bytes": saved.activation_bytes, "plan_saved_storages": saved.n_storages}


def run(run_file: Path) -> int:
    """Train the setting of ``run_file``; rank 0 writes steps.jsonl and result.json next to it, a
    failing rank rank<N>.json (as the benchmark's worker does)."""
    spec = RunSpec.from_json(json.loads(run_file.read_text()))
    out_dir = run_file.parent
    if spec.deterministic:
        # cuBLAS reads it when it makes its first handle; without it, deterministic mode refuses cuBLAS.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    rank, device = worker.init_distributed(spec.trial)
    memopt_warnings = worker.recording_memopt_warnings()
    with worker.reporting_failure(out_dir, rank, phase="train"):
        trained = train(spec, device, rank, out_dir / STEPS_FILE if rank == 0 else None)
    result = {"status": "ok", **trained.fields}
    if trained.training.memopt is not None:
        result["memopt_warnings"] = memopt_warnings
    if rank == 0:
        worker.write_json(out_dir / worker.RESULT_FILE, result)  # kept if the measurement below fails
    with worker.reporting_failure(out_dir, rank, phase="plan"):
        result.update(measure_plan(trained.training, trained.optimizer, trained.batch))
    if rank == 0:
        worker.write_json(out_dir / worker.RESULT_FILE, result)
    if dist.is_initialized():
        worker.leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
