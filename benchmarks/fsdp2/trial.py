"""The benchmark's row schema: what one trial runs, what it measures, and how a row reads back.

A row of ``--out`` is one flat JSON object: the trial's fields (``Trial.key``), the driver's context
(where, when, by which command), and the worker's measurements (``MemoryPeaks``,
``StepTimes``, ``SavedActivations``, the profile). Rows stay flat so that every committed
``benchmarks/results/*.jsonl`` keeps reading, and the tables and ``--resume`` read fields added since
a row was written as the value rows had before (``field_value``). In memory a trial is grouped by
what each part decides, so that no function takes 22 loose fields: the workload, its numerics, the
sharding, the compilation and the measurement.

Nothing here imports torch: the tables read rows without it.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Where the loss runs: in the compiled module on the logits in the model's dtype (in-graph) or upcast
# (in-graph-fp32), or after it, in eager (IN_GRAPH_LOSS_MODES holds the first two).
LOSS_MODES = ("in-graph", "in-graph-fp32", "litgpt", "outside-fp32")
IN_GRAPH_LOSS_MODES = ("in-graph", "in-graph-fp32")
# AdamW's implementations: foreach (torch's default on CUDA) allocates, in its step, a temporary the size
# of all parameters (the square root of the second moments); fused (torchtitan's default) none.
OPTIMIZERS = ("foreach", "fused")
DISTRIBUTED_MODES = ("fsdp2", "thunder-fsdp", "none")
# Whose model code a trial trains: litgpt's GPT, or a transformers causal LM (benchmarks/fsdp2/hf_models.py).
TRANSFORMERS_SOURCE = "transformers"
MODEL_SOURCES = ("litgpt", TRANSFORMERS_SOURCE)
SHARD_MODES = ("zero2", "zero3")
# fsdp2's units for the head: the final norm, the head and the in-graph loss in the root's unit
# (root); the head and the in-graph loss a unit of their own, models.LossHead (loss), which FSDP2
# reshards and reduce-scatters right after its backward; or the head and the final norm each a unit
# of their own and the loss after the GPT's root unit (own), the benchmark's layout until commit
# a818edf: rows written before it ran own.
HEAD_UNITS = ("root", "loss", "own")
HEAD_IN_ROOT_SINCE = "2026-12-01T11:09:31+00:00"
# row_type: a measured run (a --find-max-block-size probe too), or a search's summary.
RUN_ROW = "run"
SEARCH_ROW = "max_block_size"
# Statuses that measuring again would not change: --resume takes such rows from --out, and a search
# probe that ends otherwise stops its search.
FINAL_STATUSES = ("ok", "OOM")
# Fields added later: rows written before them had these values.
FIELD_DEFAULTS = {"autocast": False, "loss_mode": "in-graph", "optimizer": "foreach", "simulated": False,
                  "model_source": "litgpt", "batches": 1}
# The profiler's kernel names run to hundreds of characters of templates: a row keeps this many.
KERNEL_NAME_CHARS = 90


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is trained: the model, its width, the sequence and the batch."""

    model: str  # a litgpt config name, or a name of hf_models.MODELS (model_source transformers)
    n_layer: int
    n_embd: int  # the width built
    narrowed: bool  # n_embd came from --n-embd (narrow_config then also shrinks the vocabulary)
    block_size: int
    micro_batch_size: int
    seed: int  # weights and batches (rank r's batches: drawn from seed + r)
    model_source: str = "litgpt"  # one of MODEL_SOURCES
    batches: int = 1  # the steps cycle through this many random batches


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How the step computes: the parameters' dtype, autocast over them, where the loss runs, and
    the optimizer's implementation."""

    dtype: str  # torch's name: bfloat16, float16, float32
    autocast: bool = False  # bf16 torch.autocast over parameters kept in ``dtype``
    loss_mode: str = "in-graph"  # one of LOSS_MODES
    optimizer: str = "foreach"  # AdamW's implementation, one of OPTIMIZERS


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How the model is sharded, over how many ranks. ``simulated``: one process plays rank 0 of
    ``world_size`` under the fake process group (``--simulate-world-size``, ``simulation.py``)."""

    distributed_mode: str  # one of DISTRIBUTED_MODES
    shard_mode: str  # one of SHARD_MODES
    world_size: int
    simulated: bool = False
    head_unit: str = "root"  # one of HEAD_UNITS (fsdp2)

    @property
    def processes(self) -> int:
        """The ranks the driver launches: one when simulated."""
        return 1 if self.simulated else self.world_size


@dataclasses.dataclass(frozen=True)
class Compilation:
    """The backend (a name in backends.BACKENDS) and its options. A backend reads only the options
    it owns (``Backend.own_fields``); the others are carried as the command line gave them."""

    backend: str
    # The value of the backend's budget flag, for backends that have one: a fraction, or for
    # thunder+memopt-fit the memory limit in GiB or "auto" (backends.Budgets.kind).
    budget: float | str | None = None
    memopt_passes: tuple[str, ...] | None = None  # thunder+memopt: MemoryOptimization(passes=...); None: all
    fusion: str = "on"  # thunder_memopt.executors(fusion=...): on or off (backends.FUSION)
    # thunder+memopt-offload: MemoryOptimization(offload_budget=...); None: its budget.
    offload_keep: float | None = None
    # thunder+memopt and -offload: MemoryOptimization(head_gradients=...); None: as the budget sets it.
    head_gradients: str | None = None
    # thunder+memopt-offload: MemoryOptimization(host_memory_limit=...) in bytes; None: "auto". At 1 no
    # copy is made: every saved tensor the plan offloads stays on the device, in the same program.
    host_memory_limit: int | None = None
    # thunder+memopt-fit: MemoryOptimization(over_limit=...), a limit no plan fits raises ("raise") or
    # takes the lowest plan ("lowest"); None: its default, "raise" (rows written before the option
    # existed took the lowest plan).
    over_limit: str | None = None


@dataclasses.dataclass(frozen=True)
class Measurement:
    """How many steps are timed, and what else is recorded about them."""

    warmup: int
    iters: int
    search: bool = False  # a --find-max-block-size probe: only whether it fits matters
    profile: bool = False
    memory_snapshot: str | None = None  # rank 0's allocator snapshot goes to this path
    first_step_profile: bool = False  # cProfile over the first step (compilation included)
    # --memory-cap: torch's caching allocator may reserve at most this many GiB on each rank's device
    # (torch.cuda.set_per_process_memory_fraction, set before anything is allocated), so that a step
    # that needs more fails as on a card of that size; None: the whole device.
    memory_cap_gib: float | None = None
    # --allocator-settings: torch's caching allocator's settings for the row's processes, in
    # PYTORCH_CUDA_ALLOC_CONF's form ("expandable_segments:True"), set before anything is allocated;
    # None: torch's defaults (or the environment's PYTORCH_CUDA_ALLOC_CONF).
    allocator_settings: str | None = None


# Fields that record more about a measurement without changing it: not part of a row's key (a row's
# "profile", "memory_snapshot" and "first_step_profile" hold what they produced).
DIAGNOSTICS_FIELDS = ("profile", "memory_snapshot", "first_step_profile")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One training run in one fresh set of processes: everything a worker needs to know."""

    workload: Workload
    numerics: Numerics
    sharding: Sharding
    compilation: Compilation
    measurement: Measurement

    def fields(self) -> dict[str, Any]:
        """Every field, flat, by the names rows use (the worker's trial file)."""
        return {name: value for group in _groups(self) for name, value in dataclasses.asdict(group).items()}

    def key(self) -> dict[str, Any]:
        """The fields that make two runs the same measurement, as a row holds them."""
        return {name: value for name, value in self.fields().items() if name not in DIAGNOSTICS_FIELDS}

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Trial:
        """The trial that ``values`` (``fields()``, or a row) describes. A field missing from it takes
        FIELD_DEFAULTS's value, else its default: rows written before the field existed. Other keys
        (a row's context and measurements) are ignored. So thunder+memopt rows from before
        thunder_memopt's executors read as ``fusion="on"``, which they did not run: --resume compares
        rows themselves (``driver.same_measurement``), which tells them apart."""
        groups = {}
        for group_name, group_type in _GROUP_TYPES.items():
            given = {}
            for field in dataclasses.fields(group_type):
                if field.name in values or field.name in FIELD_DEFAULTS or field.name == "head_unit":
                    given[field.name] = field_value(values, field.name)
            if given.get("memopt_passes") is not None:
                given["memopt_passes"] = tuple(given["memopt_passes"])  # a JSON list
            groups[group_name] = group_type(**given)
        return cls(**groups)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Trial:
        """The trial a row measured (its diagnostics off: a row's profile is the profiler's summary)."""
        return cls.from_fields({name: value for name, value in row.items() if name not in DIAGNOSTICS_FIELDS})

    def replace(self, **changes: Any) -> Trial:
        """This trial with the named fields (flat names, as in a row) changed."""
        by_group: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name not in _GROUP_OF:
                raise TypeError(f"Trial has no field {name!r}")
            by_group.setdefault(_GROUP_OF[name], {})[name] = value
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **fields)
                                            for group, fields in by_group.items()})


def _groups(trial: Trial) -> tuple:
    return tuple(getattr(trial, name) for name in _GROUP_TYPES)


_GROUP_TYPES: dict[str, type] = typing.get_type_hints(Trial)
_GROUP_OF = {field.name: group for group, group_type in _GROUP_TYPES.items() for field in dataclasses.fields(group_type)}


# What a worker measured: each record's fields are row fields.


@dataclasses.dataclass(frozen=True)
class MemoryPeaks:
    """The memory peaks of a trial, in bytes, each rank 0's and the maximum over ranks.

    ``peak_alloc_*``, ``peak_reserved_*``: the CUDA allocator's peak allocated and reserved bytes
    over the measured steps; None on CPU, where there is no allocator peak to report.
    ``host_rss_peak_*``: the peak resident set size of each rank's process over its whole life
    (``getrusage(RUSAGE_SELF).ru_maxrss``, which the kernel cannot reset: the model's build and the
    compilation are in it; inductor's compile workers and torchrun's launcher, other processes, are
    not). ``host_pinned_peak_*``: on CUDA, the peak bytes held by torch's pinned host allocator over
    the measured steps (``torch.cuda.host_memory_stats()``, its cached blocks included), where
    activation offload keeps its copies; None on CPU. Rows written before the host fields read them
    as None: not measured.
    """

    peak_alloc_rank0: int | None = None
    peak_reserved_rank0: int | None = None
    peak_alloc_max: int | None = None
    peak_reserved_max: int | None = None
    host_rss_peak_rank0: int | None = None
    host_rss_peak_max: int | None = None
    host_pinned_peak_rank0: int | None = None
    host_pinned_peak_max: int | None = None


HOST_MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(MemoryPeaks) if f.name.startswith("host_"))
MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(MemoryPeaks) if f.name not in HOST_MEMORY_FIELDS)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """The measured steps' times (rank 0, synchronized), the last step's loss and every step's."""

    step_ms: float  # the median
    step_ms_all: list[float]
    tokens_per_s_per_gpu: float
    first_step_s: float  # includes compilation
    compile_s: float  # first step less the median step
    loss: float
    # Every step's loss in order, warm-ups included: step 3's is the third (thunder+memopt-fit's
    # extra warm-up, where its check plans again, is one of them).
    step_losses: list[float]


@dataclasses.dataclass(frozen=True)
class SavedActivations:
    """Bytes saved for backward by one more forward: storages once, parameters excluded, whole model."""

    saved_bytes_per_layer: float
    saved_storages: int
    saved_h_bytes: float  # bytes / (tokens x n_embd x n_layer)


def field_value(row: Mapping[str, Any], field: str) -> Any:
    """``row[field]``, or for a row written before the field existed, the value it then had."""
    if field in row:
        return row[field]
    if field == "head_unit":  # dated: the layout changed before the field existed
        return "own" if row.get("date", HEAD_IN_ROOT_SINCE) < HEAD_IN_ROOT_SINCE else "root"
    return FIELD_DEFAULTS.get(field)


def sharding_of(row: Mapping[str, Any]) -> str:
    mode = row["distributed_mode"]
    return mode if mode == "none" else f"{mode} {row['shard_mode']}"


def load_rows(paths: Iterable[Path]) -> list[dict]:
    """Every row of the JSON lines files, in order."""
    rows = []
    for path in paths:
        rows.extend(json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return rows
