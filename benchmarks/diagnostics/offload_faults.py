"""A CUDA out-of-memory error inside a training step with offload leaves nothing behind, on a GPU.

A step that runs out of memory part way leaves offload's copies (executors/offload.py) never waited
for or reloaded; the executor's finalizers must drop them with the step's graph, so that nothing
stays pinned, held or queued and the user's next step at a smaller T runs. tests/test_offload_faults.py
checks the bookkeeping on CPU with fake CUDA events; this checks it on CUDA with a real error. A
litgpt model (a few layers at real width, bf16, thunder_memopt's executors, MemoryOptimization with
offload="budget", AdamW) runs two steps at --seq-len and two at --fail-seq-len (compile, then
measure the peak), one at --seq-len without the optimizer (the loss to repeat), then, with the
process capped (set_per_process_memory_fraction) --cap-at of the way from the small peak to the
large one, a step at --fail-seq-len that runs out of memory, what a user does then (gradients
dropped, gc.collect(), empty_cache()), and a step at --seq-len under the same cap. Checked: the
error came with copies in flight; then offload_state() is empty, the side stream goes idle, pinned
host bytes in use and device bytes allocated are back to their levels; the next step runs, its loss
equal bit for bit to the one before. The table goes to --out (markdown), with a line naming what to
change for each failed check; exit status 0 when all pass, 1 otherwise, 2 for bad flags. On one GPU
(a few minutes, most of it two compilations):

    python benchmarks/diagnostics/offload_faults.py --out benchmarks/results/offload_faults_h200.md

Without CUDA, --cpu-dry-run runs the same steps on a tiny model on CPU: offload copies to a second
CPU buffer (offload_rates given, every saved tensor offloaded), the error is raised at a copy in the
backward, and the CUDA-only checks are skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this repository's thunder_memopt
# Thunder warns at import of an executor this stack does not use; it would precede a bad flag's one line.
warnings.filterwarnings("ignore", message="transformer_engine module not found")

import thunder  # noqa: E402
import torch  # noqa: E402

import thunder_memopt.passes.offload as offload_pass  # noqa: E402
from thunder_memopt import DeviceRates, MemoryOptimization, executors  # noqa: E402
from thunder_memopt.arguments import fraction, litgpt_model_name, narrow_width, positive_int  # noqa: E402
from thunder_memopt.executors import offload as offload_executor  # noqa: E402
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch  # noqa: E402

PROG = "offload_faults.py"
MIB = 1 << 20
EMPTY = offload_executor.OffloadState(*(0 for _ in dataclasses.fields(offload_executor.OffloadState)))
# Below any leaked saved tensor at the failing T (one (T, n_embd) bf16 activation is reported beside it).
DEVICE_SLACK = 32 * MIB
IDLE_TIMEOUT_S = 10.0
# The failing T's peak over the small one's, at least: room for a cap between them that the small
# step fits under whatever the allocator's fragmentation.
PEAK_RATIO = 1.5
# The dry run's rates: copies this fast hide behind any compute.
DRY_RUN_RATES = DeviceRates(to_host=1e18, to_device=1e18, flops=600e12, memory=4e12)
DEFAULTS = {"gpu": {"n_layer": 2, "n_embd": None, "seq_len": 2048, "fail_seq_len": 65536},
            "dry_run": {"n_layer": 1, "n_embd": 64, "seq_len": 32, "fail_seq_len": 64}}


@dataclasses.dataclass
class Check:
    what: str
    measured: str
    ok: bool | None  # None: not measured here (CUDA only)
    fix: str  # what to change where it fails


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (markdown)")
    parser.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b")
    parser.add_argument("--n-layer", type=positive_int, help="transformer blocks (2; dry run 1)")
    parser.add_argument("--n-embd", type=narrow_width, help="a narrowed width (real width; dry run 64)")
    parser.add_argument("--seq-len", type=positive_int, help="T of the steps that fit (2048; dry run 32)")
    parser.add_argument("--fail-seq-len", type=positive_int, help="T of the step that fails (65536; dry run 64)")
    parser.add_argument("--activation-budget", type=fraction, default=1.0)
    parser.add_argument("--offload-budget", type=fraction, default=0.0,
                        help="share of saved bytes that may stay on the GPU (0.0: offload all it can)")
    parser.add_argument("--cap-at", type=fraction, default=0.5,
                        help="the memory cap, this share of the way from the small step's peak to the large one's")
    parser.add_argument("--cpu-dry-run", action="store_true", help="on CPU, a tiny model, the error injected")
    args = parser.parse_args(argv)
    for name, value in DEFAULTS["dry_run" if args.cpu_dry_run else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.fail_seq_len <= args.seq_len:
        parser.error(f"--fail-seq-len ({args.fail_seq_len}) must be larger than --seq-len ({args.seq_len})")
    if not 0.0 < args.cap_at < 1.0:
        parser.error(f"--cap-at must be strictly between 0 and 1, got {args.cap_at:g}")
    if not args.cpu_dry_run and not torch.cuda.is_available():
        parser.error("needs CUDA (no GPU here); --cpu-dry-run runs the steps on CPU")
    return args


def progress(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class Training:
    """The jitted model with its loss and its AdamW, and the phase its step is in."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.config = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd,
                                    block_size=args.fail_seq_len)
        gpt = build_model(self.config, device=device)
        self.memopt = MemoryOptimization(activation_budget=args.activation_budget, offload="budget",
                                         offload_budget=args.offload_budget,
                                         offload_rates=DRY_RUN_RATES if device.type == "cpu" else None)
        self.loss_of = thunder.jit(GPTWithLoss(gpt), executors=executors(), transforms=[self.memopt])
        self.optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
        self.phase = "idle"

    def step(self, seq_len: int, *, optimize: bool = True) -> torch.Tensor:
        """Forward, backward and (if ``optimize``) AdamW's step at T=``seq_len``; the loss."""
        x, y = random_batch(self.config, batch_size=1, seq_len=seq_len, device=self.device)
        self.phase = "forward"
        loss = self.loss_of(x, y)
        self.phase = "backward"
        loss.backward()
        if optimize:
            self.phase = "optimizer step"
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.phase = "idle"
        return loss.detach()

    def peak_increment(self, seq_len: int) -> int | None:
        """A step's peak of allocated bytes above those allocated before it (None on CPU)."""
        if self.device.type != "cuda":
            self.step(seq_len)
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.step(seq_len)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before


@dataclasses.dataclass
class CopyCounter:
    """Offload's copies (to the host and back, ``executors.offload._copied``), counted; at copy
    ``fail_at`` a CUDA out-of-memory error, as a reload's allocation raises one (the dry run's)."""

    copied: Callable
    copies: int = 0
    fail_at: int | None = None

    def __call__(self, t: torch.Tensor, to: object, device: torch.device) -> object:
        self.copies += 1
        if self.copies == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by --cpu-dry-run)")
        return self.copied(t, to, device)


def pinned_in_use(device: torch.device) -> int | None:
    """Pinned host bytes handed out and not given back: the caching host allocator's blocks once
    the device has finished and the cached ones are freed (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch._C._host_emptyCache()
    return torch.cuda.host_memory_stats().get("allocated_bytes.current")


def side_stream_idle_ms(device: torch.device) -> float | None:
    """Milliseconds until offload's side stream has run all it was given, polled without
    synchronizing (None on CPU; inf past ``IDLE_TIMEOUT_S``)."""
    if device.type != "cuda":
        return None
    stream, start = offload_executor._side_stream(device), time.perf_counter()
    while not stream.query():
        if time.perf_counter() - start > IDLE_TIMEOUT_S:
            return float("inf")
        time.sleep(0.01)
    return 1e3 * (time.perf_counter() - start)


def run_checks(args: argparse.Namespace) -> list[Check]:
    cuda = not args.cpu_dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    counter = CopyCounter(offload_executor._copied)
    # The dry run's tiny model saves tensors under MIN_BYTES: every one is offloaded there.
    with mock.patch.object(offload_executor, "_copied", counter), \
            mock.patch.object(offload_pass, "MIN_BYTES", offload_pass.MIN_BYTES if cuda else 1):
        progress(f"compiling at T={args.seq_len} ...")
        training = Training(args, device)
        training.step(args.seq_len)
        small_peak = training.peak_increment(args.seq_len)
        small_loss, small_state = training.step(args.seq_len), offload_executor.offload_state()
        small_allocated = torch.cuda.memory_allocated() if cuda else None
        pinned_before = pinned_in_use(device)
        progress(f"compiling at T={args.fail_seq_len} ...")
        training.step(args.fail_seq_len)
        counter.copies = 0
        large_peak = training.peak_increment(args.fail_seq_len)
        copies_per_step = counter.copies
        reference_loss = training.step(args.seq_len, optimize=False)
        plans = training.memopt.offload_plans
        offloaded = sum(len(plan.offloaded) for plan in plans)

        if cuda:
            torch.cuda.empty_cache()
            allocated_before = torch.cuda.memory_allocated()
            cap = allocated_before + small_peak + args.cap_at * (large_peak - small_peak)
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        else:
            counter.fail_at = copies_per_step * 3 // 4  # in the backward, half its reloads made
        progress(f"the step at T={args.fail_seq_len} that runs out of memory ...")
        counter.copies, error, phase, at_fault = 0, None, "none", EMPTY
        try:
            try:
                training.step(args.fail_seq_len)
            except RuntimeError as raised:  # torch.OutOfMemoryError is one
                error, phase, at_fault = raised, training.phase, offload_executor.offload_state()
            error_text = "no error" if error is None else (f"{type(error).__name__} in the {phase}: "
                                                          f"{str(error).splitlines()[0][:120]}")
            oom, copies_at_fault = isinstance(error, torch.OutOfMemoryError), counter.copies
            del error  # with it the traceback, which holds the failed step's frames
            counter.fail_at = None
            training.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            after_state = offload_executor.offload_state()
            allocated_after = torch.cuda.memory_allocated() if cuda else None
            idle_ms = side_stream_idle_ms(device)
            pinned_after = pinned_in_use(device)
            progress(f"the next step at T={args.seq_len} ...")
            try:
                next_loss, next_error = training.step(args.seq_len), None
            except RuntimeError as raised:
                next_loss, next_error = None, f"{type(raised).__name__} in the {training.phase}"
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        next_state = offload_executor.offload_state()

    def cuda_only(what: str, measured: Callable[[], str], ok: Callable[[], bool], fix: str) -> Check:
        return Check(what, measured() if cuda else "not measured (CUDA only)", ok() if cuda else None, fix)

    def mib(n: float | None) -> str:
        return "n/a" if n is None else f"{n / MIB:.1f} MiB"

    small, large, see = f"T={args.seq_len}", f"T={args.fail_seq_len}", "see executors/offload.py"
    return [
        Check("offload planned copies", f"{offloaded} saved tensors in {len(plans)} plans", offloaded > 0,
              "offload planned no copy: raise --seq-len or --n-embd (saved tensors under 1 MiB stay)"),
        Check(f"a step at {small} leaves offload's bookkeeping empty",
              f"loss {small_loss.item():.4f}; allocated {mib(small_allocated)}; {small_state}",
              small_state == EMPTY and bool(small_loss.isfinite()), f"a normal step leaves bookkeeping behind: {see}"),
        cuda_only(f"the step at {large} peaks well above the one at {small}",
                  lambda: f"{mib(large_peak)} against {mib(small_peak)}", lambda: large_peak >= PEAK_RATIO * small_peak,
                  "no room for a cap between the two steps' peaks: raise --fail-seq-len"),
        Check(f"the capped step at {large} runs out of memory", error_text, oom,
              "the step did not run out of memory: lower --cap-at (or raise --fail-seq-len)"),
        Check("offload copies were in flight at the error",
              f"{copies_at_fault} copies of {copies_per_step} a step; at the error {at_fault}",
              copies_at_fault > 0 and at_fault != EMPTY,
              "no error came: see the out-of-memory check" if phase == "none" else
              "the error came before offload's first copy: raise --cap-at" if phase == "forward"
              else "the error came after offload's copies were done: lower --cap-at"),
        Check("offload_state() is empty once the failed step is dropped", str(after_state), after_state == EMPTY,
              f"the failed step's copies outlived it, a reference to its graph survives: {see} (_forget)"),
        cuda_only("the side stream goes idle", lambda: f"after {idle_ms:.1f} ms", lambda: idle_ms < float("inf"),
                  f"copies queued by the failed step had not run {IDLE_TIMEOUT_S:g} s later: {see}"),
        cuda_only("pinned host bytes in use are back to their level before",
                  lambda: f"{mib(pinned_after)} after, {mib(pinned_before)} before",
                  lambda: None not in (pinned_after, pinned_before) and pinned_after <= pinned_before,
                  f"the failed step's host copies stay pinned, a reference to them survives: {see}"),
        cuda_only("device bytes allocated are back to their level before",
                  lambda: f"{mib(allocated_after - allocated_before)} more than {mib(allocated_before)} "
                          f"(one activation at {large}: {mib(args.fail_seq_len * training.config.n_embd * 2)})",
                  lambda: allocated_after - allocated_before <= DEVICE_SLACK,
                  f"the failed step's sources or reloads stay on the device: {see}"),
        Check(f"the next step at {small} runs, its loss finite and equal to the same step's before",
              next_error or f"{next_loss.item():.6f} against {reference_loss.item():.6f}",
              next_loss is not None and bool(next_loss.isfinite()) and torch.equal(next_loss, reference_loss),
              "the step after the error computes another loss: the failed step changed the model or its state"),
        Check("offload_state() is empty after the next step", str(next_state), next_state == EMPTY,
              f"the step after the error leaves bookkeeping behind: {see}"),
    ]


def environment() -> str:
    """Versions, the device, the date and the commit, in one line."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:  # no git
        commit = ""
    device = torch.cuda.get_device_name() if torch.cuda.is_initialized() else "CPU (dry run)"
    return (f"{device}; torch {torch.__version__}, lightning-thunder {thunder.__version__}; thunder_memopt "
            f"{commit or 'unknown'}; {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")


def report_text(args: argparse.Namespace, checks: list[Check]) -> str:
    failed = [c for c in checks if c.ok is False]
    where = " (CPU dry run)" if args.cpu_dry_run else ""
    width = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd).n_embd
    lines = [f"# Offload: a CUDA out-of-memory error inside a step leaves nothing behind{where}", "", environment(), "",
             f"{args.model_name}, n_layer {args.n_layer}, n_embd {width}, bf16, T={args.seq_len} and "
             f"T={args.fail_seq_len}; MemoryOptimization(activation_budget={args.activation_budget}, offload='budget', "
             f"offload_budget={args.offload_budget}); cap at {args.cap_at:g}. Command: `{' '.join(sys.argv)}`", "",
             "| check | measured | result |", "|---|---|---|"]
    lines += [f"| {c.what} | {c.measured} | {'skip' if c.ok is None else 'pass' if c.ok else 'FAIL'} |" for c in checks]
    lines += ["", *(f"- FAIL: {c.what}: {c.fix}" for c in failed)]
    lines.append(f"{len(failed)} of {len(checks)} checks failed." if failed else "Verdict: every check passed.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checks = run_checks(args)
    text = report_text(args, checks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, flush=True)
    return 1 if any(c.ok is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
