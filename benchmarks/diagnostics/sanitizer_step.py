"""One offloaded training step and one step with the donate pass under PyTorch's CUDA sanitizer,
which reports any access to a tensor on one stream that is not ordered after another stream's
access to it (issue 36, item 3).

Offload copies saved tensors to pinned host memory on a side stream and back while the GPU
computes; the donate pass has fusion regions write their outputs into inputs that die there. A
missed wait would race. Each case is one step (forward, backward, AdamW step) of stablecode at its
real width under the benchmark's backend (``benchmarks/fsdp2/backends.py``, built by its worker:
``worker.prepare_training``), each in a fresh torchrun of one rank:

- ``offload``: thunder+memopt-offload at ``--offload-budget`` (0.0: every saved tensor it can
  offload; the donate pass runs too, around the copies);
- ``donate``: thunder+memopt at budget 1.0 (the donate pass, no offload);

under ``thunder.jit`` (``--distributed-mode none``) and FSDP2 with one rank (``fsdp2``: one
compiled pair serves every Block, so the reloads of one Block's backward are prefetched during
another's). A first step compiles with the sanitizer off; the sanitizer checks the second. Dynamo
runs no compiled code under a dispatch mode that does not ignore compile internals, so the
sanitizer's mode is marked as one that does: the fsdp2 cases run their compiled programs checked,
not eagerly. A case is CLEAN only where its pass acted in the checked step: reloads for offload,
region outputs written into their inputs for donate. ``set_``, which points a tensor at a
storage and launches no kernel, passes unchecked, as the sanitizer passes ``record_stream`` itself.

The sanitizer sees what goes through PyTorch's dispatcher (copies, matmuls, attention, the
optimizer, allocations). Inductor's Triton kernels, which the fusion regions launch directly, it
does not see; so here each region call is reported to it as a kernel that reads the region's
inputs and writes its outputs, donated inputs among them. Run on one GPU:

    TORCH_CUDA_SANITIZER=1 python benchmarks/diagnostics/sanitizer_step.py --out benchmarks/results/sanitizer_h200.md

It writes the verdict of each case, the counts that show the check had something to check
(kernels seen, regions, offloaded tensors, reloads, donated outputs) and the sanitizer's output to
--out; exit status 0 when every case is clean, 1 otherwise, 2 for bad flags or without CUDA.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.cuda._sanitizer as csan
from torch.utils import _pytree

# Off until the checked step: TORCH_CUDA_SANITIZER=1 enables it when torch is imported, and on a
# machine without CUDA its first op would fail before this script could say it needs CUDA; the
# compilation of the first step need not run under it.
SANITIZER_FROM_ENVIRONMENT = csan.cuda_sanitizer.enabled
if csan.cuda_sanitizer.enabled:
    csan.cuda_sanitizer.disable()

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# Thunder warns at import of an executor this stack does not use; here it would precede the one line
# that a machine without CUDA gets.
warnings.filterwarnings("ignore", message="transformer_engine module not found")

from benchmarks.fsdp2 import driver, worker  # noqa: E402
from benchmarks.fsdp2.trial import Compilation, Measurement, Numerics, Sharding, Trial, Workload  # noqa: E402
from thunder_memopt.arguments import fraction, litgpt_model_name, positive_int  # noqa: E402

PROG = "sanitizer_step.py"
CASES = {"offload": "thunder+memopt-offload", "donate": "thunder+memopt"}
TIMEOUT_S = 1200
SANITIZER_LOGGER = "torch.cuda._sanitizer"
# Ops that point a tensor at memory and launch no kernel. The sanitizer skips record_stream so
# itself; set_ it would count as a write of the storage on the current stream (offload makes its
# reloaded tensors over the buffers its side stream fills).
NO_KERNEL = frozenset(getattr(torch.ops.aten.set_, overload) for overload in torch.ops.aten.set_.overloads())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the verdict and the sanitizer's output (markdown); required")
    parser.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    parser.add_argument("--n-layer", type=positive_int, default=2, help="transformer blocks (real width)")
    parser.add_argument("--block-size", type=positive_int, default=2048, help="sequence length T")
    parser.add_argument("--offload-budget", type=fraction, default=0.0,
                        help="the offload case's activation_budget (MemoryOptimization's)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--distributed-mode", nargs="+", choices=("none", "fsdp2"), default=["none", "fsdp2"])
    parser.add_argument("--log-dir", type=Path, help="a log per case (default: --out with .logs)")
    parser.add_argument("payload", nargs="?", help=argparse.SUPPRESS)  # a case's JSON, on its rank
    args = parser.parse_args(argv)
    if args.payload is None and args.out is None:
        parser.error("the following arguments are required: --out")
    return args


def case_trial(case: str, mode: str, args: argparse.Namespace) -> Trial:
    """The benchmark's trial of one case: its backend, budget and sharding, bf16, one rank."""
    from thunder_memopt.models import narrow_config

    budget = args.offload_budget if case == "offload" else 1.0
    width = narrow_config(args.model_name, n_layer=args.n_layer).n_embd
    return Trial(Workload(model=args.model_name, n_layer=args.n_layer, n_embd=width, narrowed=False,
                          block_size=args.block_size, micro_batch_size=1, seed=0),
                 Numerics(dtype="bfloat16"), Sharding(distributed_mode=mode, shard_mode="zero2", world_size=1),
                 Compilation(backend=CASES[case], budget=budget), Measurement(warmup=1, iters=1))


@dataclasses.dataclass
class Seen:
    """What the sanitizer checked during one step."""

    kernels: int = 0
    by_stream: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    regions: int = 0
    donated_writes: int = 0  # region outputs written into one of the region's inputs
    unlaunched: int = 0  # set_ calls, passed through unchecked (NO_KERNEL)


def report_region_accesses(seen: Seen) -> contextlib.AbstractContextManager:
    """Each fusion region call reported to the sanitizer as one kernel on the current stream that
    reads the region's tensor inputs and writes its outputs (a donated input, which the region
    returns, is both). An input a region updates without returning it is reported as read only:
    the loss head's fp32 accumulators, which it makes itself and only the compute stream touches."""
    from thunder_memopt.executors import fusion

    handler = csan.cuda_sanitizer.dispatch.event_handler
    call = fusion._CompiledRegion.__call__

    def checked_call(region, *args):
        out = call(region, *args)
        if csan.cuda_sanitizer.enabled:
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_cuda]
            outputs = [o for o in _pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.is_cuda]
            written = {t.data_ptr() for t in outputs}
            seen.donated_writes += len(written & {t.data_ptr() for t in inputs})
            aliases = collections.defaultdict(list)
            for index, t in enumerate(inputs):
                aliases[t.data_ptr()].append(f"region input {index}")
            for index, t in enumerate(outputs):
                aliases[t.data_ptr()].append(f"region output {index}")
            seen.regions += 1
            errors = handler._handle_kernel_launch(torch.cuda.current_stream().cuda_stream,
                                                   {t.data_ptr() for t in inputs} - written, written, written,
                                                   "thunder_memopt fusion region (inductor's Triton kernels)",
                                                   dict(aliases))
            if errors:
                for error in errors:
                    print(error, file=sys.stderr)
                raise csan.CUDASanitizerErrors(errors)
        return out

    return _patched(fusion._CompiledRegion, "__call__", checked_call)


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def sanitized(seen: Seen, output: io.StringIO) -> Iterator[None]:
    """The sanitizer on, every kernel launch it checks counted, its reports and log lines into
    ``output``."""
    handler = csan.cuda_sanitizer.dispatch.event_handler
    launch = handler._handle_kernel_launch

    def counted(stream, *rest):
        seen.kernels += 1
        seen.by_stream[stream] += 1
        return launch(stream, *rest)

    log = logging.getLogger(SANITIZER_LOGGER)
    lines = logging.StreamHandler(output)
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    dispatch = csan.CUDASanitizerDispatchMode.__torch_dispatch__

    def checked_unless_no_kernel(mode, func, types, args=(), kwargs=None):
        if func in NO_KERNEL:
            seen.unlaunched += 1
            return func(*args, **(kwargs or {}))
        return dispatch(mode, func, types, args, kwargs)

    # Dynamo runs no compiled code under a dispatch mode unless the mode says it ignores compile
    # internals: without this, torch.compile'd steps (distributed mode fsdp2) would run eagerly here.
    with (_patched(csan.CUDASanitizerDispatchMode, "ignore_compile_internals", classmethod(lambda cls: True)),
          _patched(csan.CUDASanitizerDispatchMode, "__torch_dispatch__", checked_unless_no_kernel)):
        csan.cuda_sanitizer.enable()
        try:
            with _patched(handler, "_handle_kernel_launch", counted), contextlib.redirect_stderr(output):
                yield
        finally:
            csan.cuda_sanitizer.disable()
            log.removeHandler(lines)


def run_case(payload_file: Path) -> int:
    """On the rank: compile with a first step, then one step under the sanitizer; result.json."""
    from thunder_memopt.executors import offload as offload_executor
    from thunder_memopt.models import DTYPES, build_model, narrow_config, random_batch, training_step

    payload = json.loads(payload_file.read_text())
    trial = Trial.from_fields(payload["trial"])
    out_dir = payload_file.parent
    rank, device = worker.init_distributed(trial)
    memopt_warnings = worker.recording_memopt_warnings()
    with worker.reporting_failure(out_dir, rank, phase="train"):
        workload = trial.workload
        config = narrow_config(workload.model, n_layer=workload.n_layer, block_size=workload.block_size)
        gpt = build_model(config, dtype=DTYPES[trial.numerics.dtype], device=device)
        training = worker.prepare_training(gpt, trial, device)
        optimizer = torch.optim.AdamW(training.parameters_owner.parameters(), lr=1e-4, foreach=True)
        batch = random_batch(config, batch_size=1, seq_len=workload.block_size, device=device)
        training_step(training.loss, optimizer, *batch)  # compiles, unchecked
        torch.cuda.synchronize(device)
        seen, output, errors = Seen(), io.StringIO(), None
        with report_region_accesses(seen), offload_executor.activity_recorded() as activity:
            try:
                with sanitized(seen, output):
                    training_step(training.loss, optimizer, *batch)
                    torch.cuda.synchronize(device)
            except csan.CUDASanitizerErrors as found:
                errors = len(found.errors)
    memopt = training.memopt
    busiest = max(seen.by_stream.values(), default=0)  # the compute stream's launches
    result = {"status": "ok", "clean": errors is None, "errors": errors or 0, "kernels": seen.kernels,
              "streams": len(seen.by_stream), "side_stream_kernels": seen.kernels - busiest,
              "regions": seen.regions, "donated_writes": seen.donated_writes, "unlaunched": seen.unlaunched, "reloads": activity.reloads, "reloads_prefetched": activity.prefetched,
              "offloaded_tensors": sum(len(plan.offloaded) for plan in memopt.offload_plans),
              "donated_outputs": memopt.donated_outputs, "memopt_warnings": memopt_warnings,
              "sanitizer_output": output.getvalue()}
    if rank == 0:
        worker.write_json(out_dir / worker.RESULT_FILE, result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def case_state(case: str, outcome: dict) -> str:
    """CLEAN only where the sanitizer checked kernels and the case's pass acted in the checked step:
    reloads of offloaded tensors, or fusion regions that wrote outputs into their inputs."""
    if outcome.get("status") != "ok":
        return outcome.get("status", "error").upper()
    if not outcome["clean"]:
        return "UNSYNCHRONIZED ACCESS"
    acted = "reloads" if case == "offload" else "donated_writes"
    if outcome["kernels"] == 0 or outcome[acted] == 0:
        return f"NOT CHECKED (kernels seen: {outcome['kernels']}, {acted} in the checked step: {outcome[acted]})"
    return "CLEAN"


def verdict_text(outcomes: list[tuple[str, str, dict, Path]], environment: dict) -> tuple[str, bool]:
    """The markdown of every case's outcome, and whether all were clean."""
    lines = [f"# CUDA sanitizer: one training step per case ({environment['gpu']})", "",
             f"torch {environment['torch']}, lightning-thunder {environment['thunder']}, "
             f"litgpt {environment['litgpt']}, thunder_memopt {environment['memopt_commit']} "
             f"(tree {environment['memopt_tree'][:8]}); "
             f"TORCH_CUDA_SANITIZER {'set' if SANITIZER_FROM_ENVIRONMENT else 'not set (the script enabled it)'}. "
             f"Command: `{' '.join(sys.argv)}`", ""]
    all_clean = True
    for case, mode, outcome, log in outcomes:
        state = case_state(case, outcome)
        all_clean &= state == "CLEAN"
        lines += [f"## {case}, distributed mode {mode}: {state}", "", f"- log: `{log}`"]
        if outcome.get("status") != "ok":
            lines += [f"- {outcome.get('error')}", ""]
            continue
        lines += [f"- the sanitizer checked {outcome['kernels']} kernel launches on {outcome['streams']} streams "
                  f"({outcome['side_stream_kernels']} off the busiest), {outcome['regions']} of them fusion regions "
                  "reported by this script; {outcome['unlaunched']} set_ calls passed unchecked (no kernel)",
                  f"- errors reported: {outcome['errors']}",
                  f"- offloaded tensors: {outcome['offloaded_tensors']}, reloads in the checked step: "
                  f"{outcome['reloads']} ({outcome['reloads_prefetched']} prefetched); donated outputs: "
                  f"{outcome['donated_outputs']}, written into their inputs in the checked step: "
                  f"{outcome['donated_writes']}",
                  f"- thunder_memopt warnings: {outcome['memopt_warnings'] or 'none'}", "",
                  "Sanitizer output:", "", "```", outcome["sanitizer_output"].rstrip() or "(nothing)", "```", ""]
    lines.append(f"Verdict: {'CLEAN' if all_clean else 'NOT CLEAN'}")
    return "\n".join(lines) + "\n", all_clean


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.payload is not None:
        return run_case(Path(args.payload))
    if not torch.cuda.is_available():
        print(f"{PROG}: error: needs CUDA (the sanitizer checks the order of CUDA streams); no GPU here",
              file=sys.stderr)
        return 2
    environment = driver.describe_environment()
    log_dir = args.log_dir or args.out.with_suffix(".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for mode in args.distributed_mode:
        for case in args.cases:
            log = log_dir / f"{case}_{mode}.log"
            print(f"{case}, distributed mode {mode} ... (log {log})", flush=True)
            trial = case_trial(case, mode, args)
            outcome = driver.launch_worker("benchmarks.diagnostics.sanitizer_step", {"trial": trial.fields()}, 1,
                                           log, TIMEOUT_S)
            print(f"    -> {outcome.get('status')}, clean: {outcome.get('clean')}", flush=True)
            outcomes.append((case, mode, outcome, log))
    text, clean = verdict_text(outcomes, environment)
    args.out.write_text(text)
    print(text, flush=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
