"""Peak memory and speed of one sharded training step, per compiler backend, on litgpt models or
transformers causal LMs (``--model-source``).

What it measures: over ``--warmup`` then ``--iters`` steps of forward, cross-entropy loss, backward
and AdamW step, the peak allocated and reserved CUDA memory (rank 0 and the maximum over ranks), the
median step time and tokens/s per rank, the bytes saved for backward per layer, the first step's time
(compilation), and the last step's loss; a row per (block size, backend, budget), each in fresh
processes (``driver``). The backends are ``backends.BACKENDS``. Sharding: FSDP2 (``fully_shard``),
Thunder's own FSDP, or none.

The process you launch (``torchrun --nproc-per-node N benchmarks/benchmark_fsdp2.py ...``, or
``python benchmarks/benchmark_fsdp2.py --nproc-per-node N ...``) is the driver; under torchrun the
other ranks exit at once. Every bad flag is argparse's one-line error (exit 2) before any process
starts. Exit codes: 0 done, 3 ``--time-limit`` reached (rerun with ``--resume``), 4 no row succeeded.

Without a GPU it runs on CPU with gloo and a narrowed model (``--n-embd 256``), so CI can smoke-test
it; the memory fields are then null (there is no CPU allocator peak to report).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from benchmarks.fsdp2 import backends, driver, hf_models, search, step_model
from benchmarks.fsdp2.trial import (DISTRIBUTED_MODES, HEAD_UNITS, IN_GRAPH_LOSS_MODES, LOSS_MODES, MODEL_SOURCES,
                                    OPTIMIZERS, SHARD_MODES, TRANSFORMERS_SOURCE, Compilation, Measurement, Numerics,
                                    Sharding, Trial, Workload)
from thunder_memopt.arguments import fraction, litgpt_model_name, narrow_width, positive_float, positive_int
from thunder_memopt.models import DTYPES, narrow_config
from thunder_memopt.passes import fit
from thunder_memopt.transform import HEAD_GRADIENTS, PASSES

GPU_DEFAULT_BLOCK_SIZE = 8192
CPU_DEFAULT_BLOCK_SIZE = 256
CPU_DEFAULT_N_EMBD = 256
EXIT_INCOMPLETE = 3  # --time-limit stopped the run; rerun the same command with --resume
EXIT_NO_ROW = 4  # every row failed (error, OOM or timeout)
# Each source's --model-name check (argparse's one-line error) and default.
MODEL_NAMES = {"litgpt": (litgpt_model_name, "stablecode-completion-alpha-3b"),
               TRANSFORMERS_SOURCE: (hf_models.model_name, "Llama-3-8B")}


def _gib(text: str, what: str, forms: str) -> float:
    """``text`` as GiB, a finite number above 0; ``what`` names the flag's value in the error, and
    ``forms`` the values it takes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}: {forms}") from None
    if not (math.isfinite(value) and value > 0.0):
        raise argparse.ArgumentTypeError(f"a {what} in GiB must be a finite number above 0, got {text}")
    return value


def memory_limit_gib(text: str) -> float | str:
    """A --memory-limit value: GiB (a finite number above 0) or ``auto``."""
    if text == backends.AUTO:
        return text
    return _gib(text, "memory limit", "GiB (a number above 0) or auto")


def memory_cap_gib(text: str) -> float:
    """A --memory-cap value: GiB, a finite number above 0."""
    return _gib(text, "memory cap", "GiB (a number above 0)")


_ALLOCATOR_SETTINGS = re.compile(r"[a-z_]+:[^\s,:]+(,[a-z_]+:[^\s,:]+)*")


def allocator_settings(text: str) -> str:
    """An --allocator-settings value: ``key:value`` pairs joined by commas, as PYTORCH_CUDA_ALLOC_CONF."""
    if not _ALLOCATOR_SETTINGS.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allocator settings: key:value pairs joined by commas, as in "
            "PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True)")
    return text


# How each kind of budget flag reads its values (backends.Budgets.kind).
BUDGET_TYPES = {backends.FRACTION: fraction, backends.MEMORY: memory_limit_gib}


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: ...)" after each help, except where the default is None: there the help
    says what an unset flag does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The command line, checked: a bad value is a usage error (exit 2) here, before any work."""
    parser = argparse.ArgumentParser(prog="benchmark_fsdp2.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=_DefaultsHelpFormatter)

    model = parser.add_argument_group("model")
    model.add_argument("--model-source", choices=MODEL_SOURCES, default="litgpt",
                       help="whose model code: litgpt's GPT, or a transformers causal LM built from its config "
                            "(random weights, SDPA, use_cache=False) whose loss is model(input_ids=x, labels=x).loss")
    model.add_argument("--model-name", help="litgpt: a litgpt config name (default "
                       f"{MODEL_NAMES['litgpt'][1]}); transformers: one of {', '.join(hf_models.MODELS)} (default "
                       f"{MODEL_NAMES[TRANSFORMERS_SOURCE][1]}), or a causal-LM model type (qwen3) or config class "
                       "(Qwen3Config) at its default width")
    model.add_argument("--n-layer", type=positive_int, default=8, help="transformer blocks")
    model.add_argument("--n-embd", type=narrow_width, help="narrow to this width (vocabulary 512); if unset: "
                       f"the real width on GPU, {CPU_DEFAULT_N_EMBD} on CPU")
    model.add_argument("--block-size", type=positive_int, nargs="+", help="sequence length(s) T, a row each; if unset: "
                       f"{GPU_DEFAULT_BLOCK_SIZE} on GPU, {CPU_DEFAULT_BLOCK_SIZE} on CPU")
    model.add_argument("--micro-batch-size", type=positive_int, default=1, help="sequences per rank and step")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameters and compute")
    model.add_argument("--loss-mode", choices=LOSS_MODES, default="in-graph",
                       help="in-graph: the cross-entropy inside the compiled module, or in-graph-fp32 "
                            "there on logits.float(); after it, in eager, "
                            "with the logits held through the step as a training loop holds them: litgpt "
                            "(litgpt's chunked_cross_entropy) or outside-fp32 (cross_entropy of logits.float())")
    model.add_argument("--optimizer", choices=OPTIMIZERS, default="foreach",
                       help="AdamW's implementation, the same for every backend: foreach (its step "
                            "allocates a temporary the size of all parameters, a peak no backend can lower) or "
                            "fused (none)")
    model.add_argument("--autocast", action="store_true",
                       help="bf16 torch.autocast over parameters kept in --dtype (which must then be fp32)")
    model.add_argument("--seed", type=int, default=0,
                       help="weights and batches (rank r's batches: drawn from seed + r)")
    model.add_argument("--batches", type=positive_int, default=1, metavar="N",
                       help="the steps cycle through N random batches. With 1, every step trains on one batch, "
                            "which a model can learn by heart within the warm-up (its loss then near 0, where "
                            "rounding moves it by percents); with more batches than steps, each step's loss stays "
                            "near log(vocabulary size)")

    sharding = parser.add_argument_group("sharding")
    sharding.add_argument("--distributed-mode", choices=DISTRIBUTED_MODES, default="fsdp2")
    sharding.add_argument("--shard-mode", choices=SHARD_MODES, default="zero2",
                          help="fsdp2: reshard_after_forward False/True; thunder-fsdp: FSDPType.ZERO2/ZERO3")
    sharding.add_argument("--head-unit", choices=HEAD_UNITS, default="root",
                          help="fsdp2: root puts the final norm, the head and the in-graph loss in the root's unit "
                               "(one graph, so the head fuses with its loss); loss makes the head and the in-graph "
                               "loss a unit of their own (one graph too), whose gathered weight and gradient FSDP2 "
                               "frees right after its backward; own gives the head and the final norm units of "
                               "their own and computes the loss after the root, the layout of rows written before "
                               "2026-12-01")
    sharding.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks, when not launched by torchrun")
    sharding.add_argument("--simulate-world-size", type=positive_int, metavar="N",
                          help="fsdp2 only: one process plays rank 0 of N under torch's fake process group (rank "
                               "0's shards, full-size all-gather and reduce-scatter buffers, collectives that move "
                               "no data: losses are not checked); rows are marked simulated and get a modelled "
                               "step at --bus-bandwidth")
    sharding.add_argument("--bus-bandwidth", type=positive_float, metavar="GBPS",
                          help="with --simulate-world-size: NCCL's all-gather and reduce-scatter bus bandwidth, GB/s, "
                               f"for the modelled step (default {step_model.NVLINK_BUS_GBPS:g}, H100/H200 NVLink; give "
                               "an inter-node figure for ranks across nodes)")

    compilation = parser.add_argument_group("backends")
    compilation.add_argument("--compile", nargs="+", choices=list(backends.BACKENDS),
                             help="backends, a row each in fresh processes; "
                                  "if unset: all (under thunder-fsdp, the thunder ones that run there)")
    for backend in backends.BACKENDS.values():
        budgets = backend.budgets
        if budgets is not None:  # a memory limit's default depends on --compile: set below
            compilation.add_argument(budgets.flag, type=BUDGET_TYPES[budgets.kind], nargs="+",
                                     default=None if budgets.kind == backends.MEMORY else list(budgets.default),
                                     help=budgets.help)
    compilation.add_argument("--memopt-passes", nargs="+", default=None, choices=PASSES,
                             help="MemoryOptimization(passes=...) for thunder+memopt (default: every pass)")
    compilation.add_argument("--offload-keep", type=fraction, nargs="+", metavar="FRACTION",
                             help="thunder+memopt-offload: MemoryOptimization(offload_budget=...), the share of the "
                                  "saved bytes left on the GPU, apart from its budget (recompute's), a row each; "
                                  "default: its budget")
    compilation.add_argument("--memopt-head-gradients", choices=HEAD_GRADIENTS, default=None,
                             help="thunder+memopt and thunder+memopt-offload: MemoryOptimization(head_gradients=...), "
                                  "where the fused loss head computes its gradients (default: as the budget sets it)")
    compilation.add_argument("--memopt-over-limit", choices=fit.OVER_LIMIT, default=None,
                             help="thunder+memopt-fit: MemoryOptimization(over_limit=...), where no plan fits "
                                  "the limit: raise (the row fails before its first step) or lowest (the lowest "
                                  "plan, with a warning); default: raise")
    compilation.add_argument("--fusion", choices=sorted(backends.FUSION), default="on",
                             help="thunder+fusion and thunder+memopt: thunder_memopt.executors(fusion=...); off runs "
                                  "every op as plain Thunder does (bit-identical)")

    measure = parser.add_argument_group("measurement")
    measure.add_argument("--warmup", type=positive_int, default=2, help="steps before the peaks are reset (the first compiles)")
    measure.add_argument("--iters", type=positive_int, default=5, help="measured steps")
    measure.add_argument("--memory-cap", type=memory_cap_gib, metavar="GIB",
                         help="each rank's CUDA caching allocator may reserve at most GIB GiB (2**30 bytes): "
                              "torch.cuda.set_per_process_memory_fraction(cap / the device's total), set in the "
                              "row's fresh processes before anything is allocated, so that a step that needs more "
                              "is an OOM row, as on a card of that size (default: the whole device)")
    measure.add_argument("--allocator-settings", type=allocator_settings, metavar="KEY:VALUE[,...]",
                         help="torch's CUDA caching allocator's settings for the rows' processes, as "
                              "PYTORCH_CUDA_ALLOC_CONF takes them (expandable_segments:True), set before anything "
                              "is allocated; part of each row's key (default: torch's, or the environment's)")
    measure.add_argument("--profile", action="store_true", help="torch.profiler summary of the measured steps")
    measure.add_argument("--first-step-profile", action="store_true",
                         help="cProfile over the first step (compilation included): its functions by "
                              "cumulative time, in the row and the log")
    measure.add_argument("--memory-snapshot", metavar="PATH",
                         help="CUDA allocator snapshot of the measured steps (rank 0), one file per row")
    measure.add_argument("--loss-rtol", type=positive_float, default=0.02,
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
    output.add_argument("--time-limit", type=positive_float, help="minutes; start no trial that may not end in time")
    output.add_argument("--trial-timeout", type=positive_float, default=1800, help="seconds before a trial is stopped")

    args = parser.parse_args(argv)
    thunder_backends = [b.name for b in backends.BACKENDS.values() if b.thunder and b.thunder_fsdp]
    named = args.compile or []
    if args.compile is None:
        args.compile = thunder_backends if args.distributed_mode == "thunder-fsdp" else list(backends.BACKENDS)
    if args.distributed_mode == "thunder-fsdp" and not set(args.compile) <= set(thunder_backends):
        parser.error(f"thunder-fsdp shards inside thunder.jit: only {', '.join(thunder_backends)} run under it")
    for backend in backends.BACKENDS.values():
        if backend.budgets is not None and getattr(args, backend.budgets.dest) is None:
            # A memory limit is one machine's: every backend (--compile unset) takes none by default.
            setattr(args, backend.budgets.dest, list(backend.budgets.default) if backend.name in named else [])
    keeping = [b.name for b in backends.BACKENDS.values() if "offload_keep" in b.own_fields]
    if args.offload_keep is not None and not set(keeping) & set(args.compile):
        parser.error(f"--offload-keep applies to {', '.join(keeping)}, which --compile does not list")
    if args.autocast and DTYPES[args.dtype] != DTYPES["fp32"]:
        parser.error("--autocast casts to bf16 inside the step: keep the parameters in --dtype fp32")
    if args.head_unit != "root" and args.distributed_mode != "fsdp2":
        parser.error(f"--head-unit {args.head_unit} places FSDP2's units: use it with --distributed-mode fsdp2")
    if args.head_unit == "loss" and args.loss_mode not in IN_GRAPH_LOSS_MODES:
        parser.error(f"--head-unit loss makes the head and the in-graph loss one unit: --loss-mode {args.loss_mode} "
                     "computes the loss after the model")
    check_simulation(args, parser)
    check_model(args, parser)
    return args, parser


def check_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--model-name for --model-source, and what a transformers model does not combine with."""
    check_name, default = MODEL_NAMES[args.model_source]
    try:
        args.model_name = check_name(args.model_name or default)
    except argparse.ArgumentTypeError as error:
        parser.error(f"argument --model-name: {error}")
    if args.model_source != TRANSFORMERS_SOURCE:
        return
    if args.distributed_mode == "thunder-fsdp":
        parser.error("thunder-fsdp shards inside thunder.jit: transformers models run under fsdp2 or none (ThunderFX)")
    if args.loss_mode != "in-graph":
        parser.error(f"--loss-mode {args.loss_mode}: a transformers model computes its loss itself, from labels")
    if args.head_unit != "root":
        parser.error(f"--head-unit {args.head_unit}: a transformers model's head and loss stay in the root's unit")
    if args.simulate_world_size is not None:
        parser.error("--simulate-world-size materializes litgpt models only: use --model-source litgpt")


def check_simulation(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--simulate-world-size and --bus-bandwidth: what they combine with."""
    simulated = args.simulate_world_size
    if simulated is None:
        if args.bus_bandwidth is not None:
            parser.error("--bus-bandwidth sets the modelled step of --simulate-world-size, which is not given")
        return
    if simulated < 2:
        parser.error(f"--simulate-world-size must be at least 2 (FSDP2 skips its collectives at 1), got {simulated}")
    if args.distributed_mode != "fsdp2":
        parser.error("--simulate-world-size simulates FSDP2's ranks: use it with --distributed-mode fsdp2")
    if args.nproc_per_node > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--simulate-world-size runs one process: leave out --nproc-per-node and torchrun's ranks")
    if args.bus_bandwidth is None:
        args.bus_bandwidth = step_model.NVLINK_BUS_GBPS


def resolve_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser, cuda: bool,
                     device_bytes: int | None = None) -> None:
    """Defaults that depend on the machine: without a GPU, a narrowed model and a short sequence;
    and what needs a GPU of ``device_bytes`` (GPU 0's total memory, where known)."""
    if args.n_embd is None and not cuda:
        args.n_embd = CPU_DEFAULT_N_EMBD
    if args.block_size is None:
        args.block_size = [GPU_DEFAULT_BLOCK_SIZE if cuda else CPU_DEFAULT_BLOCK_SIZE]
    if args.model_source == TRANSFORMERS_SOURCE:
        width = hf_models.width(args.model_name, args.n_embd)
        args.resolved_n_embd, args.vocab_size = width.hidden_size, width.vocab_size
    else:
        config = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd)
        args.resolved_n_embd, args.vocab_size = config.n_embd, config.padded_vocab_size
    limits = [budgets for name in args.compile if (budgets := backends.BACKENDS[name].budgets) is not None
              and budgets.kind == backends.MEMORY and backends.AUTO in getattr(args, budgets.dest)]
    if limits and not cuda:
        parser.error(f"{limits[0].flag} {backends.AUTO} is what a CUDA device allows, and there is none: "
                     "give the limit in GiB")
    if args.memory_cap is not None:
        if not cuda:
            parser.error(f"--memory-cap {args.memory_cap:g} caps a CUDA device's memory, and there is none")
        if device_bytes is not None and args.memory_cap * backends.GIB > device_bytes:
            parser.error(f"--memory-cap {args.memory_cap:g} GiB is more than the device's "
                         f"{device_bytes / backends.GIB:.2f} GiB")
    if args.allocator_settings is not None and not cuda:
        parser.error(f"--allocator-settings {args.allocator_settings} sets a CUDA allocator, and there is none")
    if args.find_max_block_size and args.block_size[0] % args.search_granularity:
        parser.error(f"--block-size {args.block_size[0]} (the search's start) must be a multiple of "
                     "--search-granularity")


def trial_template(args: argparse.Namespace, world_size: int) -> Trial:
    """The trial with the command line's settings; backend, budget and block size filled per row."""
    return Trial(
        workload=Workload(model=args.model_name, n_layer=args.n_layer, n_embd=args.resolved_n_embd,
                          narrowed=args.n_embd is not None, block_size=args.block_size[0],
                          micro_batch_size=args.micro_batch_size, seed=args.seed, model_source=args.model_source,
                          batches=args.batches),
        numerics=Numerics(dtype=str(DTYPES[args.dtype]).removeprefix("torch."), autocast=args.autocast,
                          loss_mode=args.loss_mode, optimizer=args.optimizer),
        sharding=Sharding(distributed_mode=args.distributed_mode, shard_mode=args.shard_mode,
                          world_size=1 if args.distributed_mode == "none" else args.simulate_world_size or world_size,
                          simulated=args.simulate_world_size is not None, head_unit=args.head_unit),
        compilation=Compilation(backend=args.compile[0],
                                memopt_passes=None if args.memopt_passes is None else tuple(args.memopt_passes),
                                fusion=args.fusion, head_gradients=args.memopt_head_gradients,
                                over_limit=args.memopt_over_limit),
        measurement=Measurement(warmup=args.warmup, iters=args.iters, profile=args.profile,
                                first_step_profile=args.first_step_profile, memory_cap_gib=args.memory_cap,
                                allocator_settings=args.allocator_settings),
    )


def backend_trials(args: argparse.Namespace, template: Trial) -> list[Trial]:
    """``template`` for every backend on the command line, each of its budgets and, for a backend
    that owns ``offload_keep``, each ``--offload-keep``."""
    def keeps(name: str) -> list[float | None]:
        return (args.offload_keep or [None]) if "offload_keep" in backends.BACKENDS[name].own_fields else [None]

    return [template.replace(backend=name, budget=budget, offload_keep=keep)
            for name in args.compile for budget in backends.budgets_for(name, args) for keep in keeps(name)]


def snapshot_path(base: str | None, trial: Trial) -> str | None:
    """One memory snapshot file per row: the backend, budget and block size go into the name."""
    if base is None:
        return None
    path = Path(base)
    budget = backends.budget_in_name(trial.compilation.backend, trial.compilation.budget)
    budget = budget and f"-{budget}"
    if trial.compilation.offload_keep is not None:
        budget += f"-keep{trial.compilation.offload_keep:g}"
    name = f"{path.stem}.{trial.compilation.backend}{budget}.T{trial.workload.block_size}{path.suffix or '.pickle'}"
    return str(path.with_name(name))


def sweep_trials(args: argparse.Namespace, template: Trial) -> list[Trial]:
    """Every block size, backend and budget of the command line, in that nesting."""
    trials = []
    for block_size in args.block_size:
        for trial in backend_trials(args, template.replace(block_size=block_size)):
            trials.append(trial.replace(memory_snapshot=snapshot_path(args.memory_snapshot, trial)))
    return trials


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc_per_node))
    environment = driver.describe_environment()
    resolve_defaults(args, parser, environment["cuda"], environment["gpu_memory_bytes"])
    out = Path(args.out)
    settings = driver.DriverSettings(out=out, log_dir=Path(args.log_dir) if args.log_dir else out.with_suffix(".logs"),
                                     resume=args.resume, time_limit_min=args.time_limit,
                                     trial_timeout_s=args.trial_timeout, bus_gbps=args.bus_bandwidth)
    runner = driver.Driver(settings, {**environment, "vocab_size": args.vocab_size})
    template = trial_template(args, world_size)
    plot_path = None if args.plot == "none" else Path(args.plot) if args.plot else out.with_suffix(".png")
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        print("WARNING: matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        plot_path = None
    ranks = (f"rank 0 of {template.sharding.world_size} simulated on 1" if template.sharding.simulated
             else str(template.sharding.world_size))
    print(f"{len(args.compile)} backend(s) on {ranks} x {environment['gpu']}; rows to {out}, "
          f"logs in {settings.log_dir}", flush=True)
    try:
        if args.find_max_block_size:
            search_settings = search.SearchSettings(start=args.block_size[0], granularity=args.search_granularity,
                                                    limit=args.search_limit)
            search.search(runner, search_settings, backend_trials(args, template))
        else:
            driver.sweep(runner, sweep_trials(args, template))
    except driver.TimeLimitReached:
        driver.report(runner.rows, plot_path, args.loss_rtol)
        print(f"--time-limit of {args.time_limit:g} min reached: rerun the same command with --resume to continue",
              flush=True)
        return EXIT_INCOMPLETE
    driver.report(runner.rows, plot_path, args.loss_rtol)
    print(f"done: {len(runner.rows)} rows in {out}", flush=True)
    if not any(row.get("status") == "ok" for row in runner.rows):
        print("no row succeeded", file=sys.stderr, flush=True)
        return EXIT_NO_ROW
    return 0
