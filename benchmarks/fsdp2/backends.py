"""The benchmark's backends, one registry entry each: its name, how to build it, its budgets and
the row fields only it reads, which make its label.

Every other part of the benchmark reads the backends from ``BACKENDS``: the command line's
``--compile`` choices and budget flags, the worker's compilation, ``--resume``, the tables' order
and labels, and ``gpu_suite.sh``, which lists them with ``python -m benchmarks.fsdp2.backends``.
So a new backend is one entry here: a ``Backend`` whose ``compile`` turns the module to train into
a ``Compiled``.

Nothing here imports torch when the module is imported (the builders import it when they run): the
tables and ``gpu_suite.sh`` read the registry without it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from benchmarks.fsdp2.trial import FIELD_DEFAULTS, TRANSFORMERS_SOURCE, Trial, sharding_of

if TYPE_CHECKING:
    import argparse

    import torch

# --fusion's values: thunder_memopt.executors(fusion=...).
FUSION = {"on": True, "off": False}
# What a budget flag's values are (Budgets.kind): a fraction in [0, 1], or a memory limit in GiB
# (a number above 0, or AUTO: what the device allows, MemoryOptimization's memory_limit="auto").
FRACTION, MEMORY = "fraction", "memory"
AUTO = "auto"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Budgets:
    """A backend's budget flag: each of its values is a row of its own (one trial each), in the
    trial's ``budget``."""

    flag: str  # e.g. --memopt-budget
    default: tuple[float | str, ...]
    help: str
    # FRACTION or MEMORY. A memory limit is one machine's: with --compile left unset (every backend)
    # its backend runs only at the limits the flag gives, at ``default`` only where --compile names it.
    kind: str = FRACTION

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments."""
        return self.flag.removeprefix("--").replace("-", "_")

    def text(self, value: float | str) -> str:
        """A value as labels and progress lines show it: ``0.5``; a memory limit ``45 GiB`` or ``auto``."""
        if self.kind == MEMORY:
            return value if value == AUTO else f"{value:g} GiB"
        return f"{value:g}"

    def label(self, value: float | str) -> str:
        """What follows the backend's name in a label: ``@0.5``, or the memory limit itself."""
        return self.text(value) if self.kind == MEMORY else f"@{self.text(value)}"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A module made ready by a backend: what a step calls and what the optimizer updates, and the
    Thunder objects whose details a row reports."""

    forward: Callable  # (input_ids, targets) -> loss, or input_ids -> logits (--loss-mode other than in-graph)
    parameters_owner: torch.nn.Module  # the optimizer takes its parameters
    memopt: Any = None  # thunder+memopt's MemoryOptimization (its pass timings)
    executors: list | None = None  # the Thunder executors, in claim order
    thunderfx: Any = None  # the ThunderCompiler behind torch.compile (its subgraph_infos), where one runs


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: everything the benchmark needs to run it and to tell its rows apart."""

    name: str
    summary: str  # what runs, in one line
    # (module, trial, device) -> Compiled. The module is sharded already under fsdp2; under
    # thunder-fsdp (thunder backends only) the backend shards it.
    compile: Callable[[torch.nn.Module, Trial, torch.device], Compiled]
    before_sharding: Callable[[torch.nn.Module], None] | None = None  # applied to the model before fully_shard
    budgets: Budgets | None = None
    # The Trial options (trial.Compilation fields) that only this backend reads: --resume compares
    # them for its rows alone, and its labels show them.
    own_fields: tuple[str, ...] = ()
    thunder: bool = False  # compiles with Thunder (its rows report the executors and ThunderFX's graphs)
    thunder_fsdp: bool = True  # a thunder backend that also runs under thunder-fsdp


def checkpoint_every_block(model: torch.nn.Module) -> None:
    """Full activation checkpointing of each transformer block (non-reentrant): litgpt's Blocks, or
    a transformers model's decoder layers."""
    from litgpt import GPT
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from benchmarks.fsdp2 import hf_models

    layers = model.transformer.h if isinstance(model, GPT) else hf_models.decoder_layers(model)
    blocks = {id(layer) for layer in layers}
    apply_activation_checkpointing(model, check_fn=lambda module: id(module) in blocks)


def as_is(module: torch.nn.Module, trial: Trial, device: torch.device) -> Compiled:
    return Compiled(module, module)


def inductor(module: torch.nn.Module, trial: Trial, device: torch.device) -> Compiled:
    import torch

    return Compiled(torch.compile(module), module)


def inductor_with_budget(module: torch.nn.Module, trial: Trial, device: torch.device) -> Compiled:
    """torch.compile, every call under ``activation_memory_budget`` = the trial's budget: the
    partitioner reads it when a call compiles a graph (and the budget stays out of other code)."""
    import torch

    compiled = torch.compile(module)
    budget = trial.compilation.budget

    def forward(*args: torch.Tensor, **kwargs: torch.Tensor) -> Any:  # a transformers model takes keywords
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)

    return Compiled(forward, module)


def memory_limit(value: float | str) -> int | str:
    """MemoryOptimization's ``memory_limit`` for a limit in GiB (bytes, on any device) or ``auto``."""
    return value if value == AUTO else int(value * GIB)


def thunder_compiled(module: torch.nn.Module, trial: Trial, device: torch.device, *, memopt_executors: bool,
                     memory_optimization: bool, offload: str = "off", fit: bool = False) -> Compiled:
    """Thunder with its default executors or thunder_memopt's (``memopt_executors``), with or
    without ``MemoryOptimization`` (and its ``offload`` option; with ``fit``, the trial's budget is
    its ``memory_limit`` in GiB instead of its ``activation_budget``): ``torch.compile`` with Thunder as its
    backend (ThunderFX) under fsdp2 (FSDP2's hooks need dynamo in front) and for transformers models
    (ThunderFX is Thunder's way in for them), ``thunder.distributed.fsdp`` of ``thunder.jit`` under
    thunder-fsdp, ``thunder.jit`` for a litgpt model on one device."""
    import thunder
    import torch

    options = trial.compilation
    if memopt_executors:
        from thunder_memopt import executors as memopt_executors_of

        executors = memopt_executors_of(fusion=FUSION[options.fusion])
    else:
        executors = list(thunder.get_default_executors())
    memopt = None
    if memory_optimization:
        from thunder_memopt import MemoryOptimization

        passes = {} if options.memopt_passes is None else {"passes": options.memopt_passes}
        keep = {} if offload == "off" or options.offload_keep is None else {"offload_budget": options.offload_keep}
        head = {} if options.head_gradients is None else {"head_gradients": options.head_gradients}
        host = ({} if offload == "off" or options.host_memory_limit is None
                else {"host_memory_limit": options.host_memory_limit})
        over = {} if options.over_limit is None else {"over_limit": options.over_limit}
        plan = ({"memory_limit": memory_limit(options.budget), **over} if fit
                else {"activation_budget": options.budget})
        memopt = MemoryOptimization(offload=offload, **plan, **passes, **keep, **head, **host)
    transforms = [memopt] if memopt is not None else []
    mode = trial.sharding.distributed_mode
    if mode == "fsdp2" or trial.workload.model_source == TRANSFORMERS_SOURCE:
        if memopt is None:
            from thunder.dynamo import ThunderCompiler

            backend = compiler = ThunderCompiler(executors=executors)
        else:
            from thunder_memopt import thunderfx_backend

            backend = thunderfx_backend(memopt, executors=executors)
            compiler = backend.compiler
        return Compiled(torch.compile(module, backend=backend), module, memopt, executors, compiler)
    jitted = thunder.jit(module, transforms=transforms, executors=executors)
    if mode == "thunder-fsdp":
        # thunder 0.2.6's fsdp takes the jitted module and adds its sharding transform.
        from thunder.distributed import FSDPType, fsdp

        strategy = FSDPType.ZERO3 if trial.sharding.shard_mode == "zero3" else FSDPType.ZERO2
        sharded = fsdp(jitted, device=device, sharding_strategy=strategy)
        return Compiled(sharded, sharded, memopt, executors)
    return Compiled(jitted, module, memopt, executors)


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("eager", "the model as is", as_is),
    Backend("eager-ac", "eager with full activation checkpointing of every Block (non-reentrant, before "
                        "fully_shard): the memory floor", as_is, before_sharding=checkpoint_every_block),
    Backend("inductor", "torch.compile(model)", inductor),
    Backend("inductor-budget", "torch.compile with torch._functorch.config.activation_memory_budget = --inductor-budget",
            inductor_with_budget,
            budgets=Budgets("--inductor-budget", (0.5,),
                            "torch._functorch.config.activation_memory_budget for inductor-budget (a row each)")),
    Backend("thunder", "Thunder with its default executors", thunder=True,
            compile=functools.partial(thunder_compiled, memopt_executors=False, memory_optimization=False)),
    Backend("thunder+fusion", "Thunder with thunder_memopt.executors(fusion=--fusion), no MemoryOptimization",
            thunder=True, own_fields=("fusion",),
            compile=functools.partial(thunder_compiled, memopt_executors=True, memory_optimization=False)),
    Backend("thunder+memopt", "the recommended configuration: thunder_memopt's executors and "
                              "MemoryOptimization(activation_budget=--memopt-budget, passes=--memopt-passes)",
            thunder=True, own_fields=("memopt_passes", "fusion", "head_gradients"),
            compile=functools.partial(thunder_compiled, memopt_executors=True, memory_optimization=True),
            budgets=Budgets("--memopt-budget", (1.0,),
                            "MemoryOptimization(activation_budget=...) for thunder+memopt (a row each)")),
    Backend("thunder+memopt-offload", "the long-context setting: thunder+memopt with MemoryOptimization("
                                      "activation_budget=--offload-budget, offload='budget', "
                                      "offload_budget=--offload-keep), which copies to pinned host memory what the "
                                      "budget does not keep on the GPU; its loss head recomputes the logits in the "
                                      "backward at any budget",
            thunder=True, own_fields=("memopt_passes", "fusion", "offload_keep", "head_gradients", "host_memory_limit"),
            compile=functools.partial(thunder_compiled, memopt_executors=True, memory_optimization=True,
                                      offload="budget"),
            budgets=Budgets("--offload-budget", (0.0,),
                            "MemoryOptimization(activation_budget=..., offload='budget') for "
                            "thunder+memopt-offload (a row each)")),
    # Not under thunder-fsdp: the fit's prediction and its check against the measured peak are
    # validated under FSDP2 and on one device.
    Backend("thunder+memopt-fit", "thunder+memopt with MemoryOptimization(memory_limit=--memory-limit, "
                                  "offload='auto'): each compiled program takes the recompute rung with the least "
                                  "modelled recompute, with the offload copies that hide or without copies, whose "
                                  "predicted whole-step peak fits the limit; the step's measured peak is checked "
                                  "after the warm-up, and planned again once where it is over",
            thunder=True, thunder_fsdp=False,
            own_fields=("memopt_passes", "fusion", "head_gradients", "over_limit", "host_memory_limit"),
            compile=functools.partial(thunder_compiled, memopt_executors=True, memory_optimization=True, fit=True,
                                      offload="auto"),
            budgets=Budgets("--memory-limit", (40.0,),
                            "MemoryOptimization(memory_limit=...) for thunder+memopt-fit, in GiB (2**30 bytes, "
                            "also on CPU) or auto (what the CUDA device allows), a row each; left unset, 40 "
                            "where --compile names the backend, none where --compile is unset", kind=MEMORY)),
)}

# Every option some backend owns: a backend that does not own one ignores it.
OPTION_FIELDS = tuple(dict.fromkeys(field for backend in BACKENDS.values() for field in backend.own_fields))


def budgets_for(name: str, args: argparse.Namespace) -> list[float | str | None]:
    """The budgets of backend ``name`` on this command line: a row each; [None] for a backend without."""
    budgets = BACKENDS[name].budgets
    return [None] if budgets is None else list(getattr(args, budgets.dest))


def budget_in_name(name: str, budget: float | str | None) -> str:
    """Backend ``name``'s budget as file names hold it (``0.5``, ``45GiB``, ``auto``); "" for none."""
    return "" if budget is None else BACKENDS[name].budgets.text(budget).replace(" ", "")


def execution(row: Mapping[str, Any]) -> str | None:
    """How a row of a backend that owns ``fusion`` executed, where it is not the current default
    (the fusion executor on): ``fusion off``, or for thunder+memopt rows from before thunder_memopt's
    executors (commit 06249fb, 2026-12-01), which ran on Thunder's executors, ``fused replays`` or
    ``unfused replays`` (the fuse_replays option; rows written before commit 1eec907 of 2026-11-30,
    which added it, have none and ran unfused)."""
    if "fusion" in row:
        return None if row["fusion"] == "on" else "fusion off"
    return "unfused replays" if row.get("fuse_replays", "off") == "off" else "fused replays"


def _passes(row: Mapping[str, Any]) -> str | None:
    passes = row.get("memopt_passes")
    return "+".join(passes) if passes else None


# How each option shows in a label, where it is not the default (None: nothing to show).
def _keep(row: Mapping[str, Any]) -> str | None:
    keep = row.get("offload_keep")
    return None if keep is None else f"keep {keep:g}"


def _head_gradients(row: Mapping[str, Any]) -> str | None:
    where = row.get("head_gradients")
    return None if where is None else f"head gradients in {where}"


def _host_limit(row: Mapping[str, Any]) -> str | None:
    limit = row.get("host_memory_limit")
    return None if limit is None else f"host limit {limit} B"


def _over_limit(row: Mapping[str, Any]) -> str | None:
    over = row.get("over_limit")
    return None if over is None else f"over limit: {over}"


OPTION_TAGS: dict[str, Callable[[Mapping[str, Any]], str | None]] = {
    "memopt_passes": _passes, "fusion": execution, "offload_keep": _keep, "head_gradients": _head_gradients,
    "host_memory_limit": _host_limit, "over_limit": _over_limit}


def tags(row: Mapping[str, Any]) -> tuple[str, ...]:
    """What sets a row apart from its backend's default beyond the budget: the options it owns."""
    return tuple(tag for field in BACKENDS[row["backend"]].own_fields if (tag := OPTION_TAGS[field](row)))


def label(row: Mapping[str, Any]) -> str:
    """A row's backend as the tables name it: ``thunder+memopt @0.5 [recompute] [fusion off]``,
    ``thunder+memopt-fit 45 GiB``."""
    budgets = BACKENDS[row["backend"]].budgets
    name = row["backend"] if row.get("budget") is None else f"{row['backend']} {budgets.label(row['budget'])}"
    return name + "".join(f" [{tag}]" for tag in tags(row))


def describe_trial(trial: Trial) -> str:
    """One line for the progress output: the backend with the options it owns, the block size and setup."""
    compilation, numerics, workload, sharding = trial.compilation, trial.numerics, trial.workload, trial.sharding
    backend = BACKENDS[compilation.backend]
    own, budgets = backend.own_fields, backend.budgets
    options = ""
    if compilation.budget is not None:
        option = "memory_limit" if budgets.kind == MEMORY else "budget"
        options = f" {option}={budgets.text(compilation.budget)}"
    if "memopt_passes" in own and compilation.memopt_passes is not None:
        options += f" passes={'+'.join(compilation.memopt_passes)}"
    if "fusion" in own and compilation.fusion != "on":
        options += f" fusion={compilation.fusion}"
    if "offload_keep" in own and compilation.offload_keep is not None:
        options += f" keep={compilation.offload_keep:g}"
    if "head_gradients" in own and compilation.head_gradients is not None:
        options += f" head_gradients={compilation.head_gradients}"
    if "host_memory_limit" in own and compilation.host_memory_limit is not None:
        options += f" host_memory_limit={compilation.host_memory_limit}"
    if "over_limit" in own and compilation.over_limit is not None:
        options += f" over_limit={compilation.over_limit}"
    if numerics.autocast:
        options += " autocast"
    if numerics.loss_mode != "in-graph":
        options += f" loss={numerics.loss_mode}"
    if numerics.optimizer != FIELD_DEFAULTS["optimizer"]:
        options += f" optimizer={numerics.optimizer}"
    ranks = f"simulated world size {sharding.world_size}" if sharding.simulated else f"world size {sharding.world_size}"
    if trial.measurement.memory_cap_gib is not None:
        ranks += f", memory cap {trial.measurement.memory_cap_gib:g} GiB"
    if trial.measurement.allocator_settings is not None:
        ranks += f", allocator {trial.measurement.allocator_settings}"
    source = "transformers " if workload.model_source == TRANSFORMERS_SOURCE else ""
    return (f"{compilation.backend}{options} T={workload.block_size} ({source}{workload.model}, "
            f"{workload.n_layer} layers, {sharding_of(trial.key())}, {ranks})")


def main(argv: list[str] | None = None) -> int:
    """Print the backends' names, one a line, in the tables' order (gpu_suite.sh reads them)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp2.backends", description=main.__doc__)
    parser.add_argument("--describe", action="store_true", help="each name with what it runs")
    args = parser.parse_args(argv)
    for backend in BACKENDS.values():
        print(f"{backend.name}\t{backend.summary}" if args.describe else backend.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
