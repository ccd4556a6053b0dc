"""The long-run check: one model trained for many steps on real text under several backends, to
show that nothing drifts, overflows or loses a bit over hundreds of steps (issue 36).

    python benchmarks/long_run.py                  # on one GPU: the defaults below
    python benchmarks/long_run.py --steps 20       # on CPU: a narrowed model (n_embd 128, 2 layers, T=128)

Every setting trains the same weights on the same batches of the Python standard library's source
bytes (vocabulary 256, padded as litgpt pads), with the cross-entropy on fp32 logits inside the
compiled model (--loss-mode), AdamW, a linear warm-up and a constant or cosine learning rate, the
gradients clipped to a total norm (--max-grad-norm), each in fresh processes (FSDP2 with one rank
by default). It writes every step's loss per setting to --out (JSON lines), a plot, and a report
(--report), and prints a progress line every --progress-every steps. The report holds each
setting's mean loss over the last --tail-steps steps against eager's, which passes within
max(--loss-rtol, --noise-factor x the noise floor): the noise floor is the distance of the control
``eager:perturb=1``, eager started one rounding step of one weight away. It also lists any NaN or
inf step and, for the pairs that must compute the same bits (thunder+memopt-offload at budget B and
thunder+memopt at B; a setting and its repeat ``#2``), whether every step's loss and parameter norm
are equal bit for bit, else the first step where they differ. The code is
``benchmarks/fsdp2/long_run*.py``.

Exit codes: 0 every check passed; 2 a bad flag (argparse's one line, before any work); 3
--time-limit reached (rerun the same command with --resume); 4 a setting did not run to its end
(error, OOM or timeout); 5 a check failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.fsdp2, thunder_memopt

from benchmarks.fsdp2 import driver, long_run, long_run_driver, long_run_report  # noqa: E402
from benchmarks.fsdp2.trial import (IN_GRAPH_LOSS_MODES, OPTIMIZERS, SHARD_MODES, Compilation, Measurement, Numerics, Sharding,  # noqa: E402
                                    Trial, Workload)
from thunder_memopt.arguments import (fraction, litgpt_model_name, narrow_width, non_negative_float,  # noqa: E402
                                      non_negative_int, positive_float, positive_int)
from thunder_memopt.models import DTYPES, narrow_config  # noqa: E402

# eager:perturb=1, the noise floor of the tail loss; thunder+memopt@0#2, the control for bit-identity.
DEFAULT_SETTINGS = ("eager", "eager:perturb=1", "inductor", "thunder+memopt@1", "thunder+memopt@0", "thunder+memopt-offload@0",
                    "thunder+memopt-offload@1", "thunder+memopt@0#2")
if "head_gradients" in long_run_driver.SETTABLE:
    # The twin of offload at 1.0, whose loss head also computes its gradients in the backward:
    # where MemoryOptimization has the option.
    DEFAULT_SETTINGS += ("thunder+memopt@1:head_gradients=backward",)
# Offload's twins in the very same programs: at a host limit of 1 byte no copy is made, and each saved
# tensor the plan offloads stays on the device (long_run_driver.COPIES_KEPT).
DEFAULT_SETTINGS += ("thunder+memopt-offload@0:host_memory_limit=1", "thunder+memopt-offload@1:host_memory_limit=1")
# Without inductor: its C++ backend fails to compile this bf16 model on torch 2.11 (a conflicting
# declaration in the code it generates).
CPU_SETTINGS = tuple(spec for spec in DEFAULT_SETTINGS if spec != "inductor")
GPU_DEFAULTS = {"n_layer": 8, "block_size": 4096, "steps": 500}
CPU_DEFAULTS = {"n_embd": 128, "n_layer": 2, "block_size": 128, "steps": 20}
DEFAULT_TAIL = 50
EXIT_INCOMPLETE, EXIT_SETTING_FAILED, EXIT_CHECK_FAILED = 3, 4, 5


def setting(text: str) -> long_run_driver.Setting:
    try:
        return long_run_driver.parse_setting(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The command line, checked apart from what depends on the machine (``resolve_defaults``)."""
    parser = argparse.ArgumentParser(prog="long_run.py", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model and data")
    model.add_argument("--model-name", type=litgpt_model_name, default="stablecode-completion-alpha-3b",
                       help="a litgpt config name (default: %(default)s)")
    model.add_argument("--n-layer", type=positive_int, help="transformer blocks (default: 8 on GPU, 2 on CPU)")
    model.add_argument("--n-embd", type=narrow_width, help="narrow to this width; default: the real width on GPU, "
                       f"{CPU_DEFAULTS['n_embd']} on CPU")
    model.add_argument("--block-size", type=positive_int,
                       help=f"sequence length T (default: {GPU_DEFAULTS['block_size']} on GPU, "
                            f"{CPU_DEFAULTS['block_size']} on CPU)")
    model.add_argument("--micro-batch-size", type=positive_int, default=1,
                       help="sequences per rank and step (default: %(default)s)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                       help="parameters and compute (default: %(default)s)")
    model.add_argument("--loss-mode", choices=IN_GRAPH_LOSS_MODES, default="in-graph-fp32",
                       help="the cross-entropy inside the compiled model, on logits.float() (in-graph-fp32, the "
                            "default) or on the model's dtype (in-graph). MemoryOptimization's fused head computes "
                            "the fp32 loss of the model-dtype logits in either case, so in-graph-fp32 gives eager "
                            "the same loss and compares like with like")
    model.add_argument("--seed", type=int, default=0,
                       help="the weights and the order of the batches (default: %(default)s)")

    training = parser.add_argument_group("training")
    training.add_argument("--steps", type=positive_int, help=f"default: {GPU_DEFAULTS['steps']} on GPU, "
                          f"{CPU_DEFAULTS['steps']} on CPU")
    training.add_argument("--lr", type=positive_float, default=3e-4,
                          help="AdamW's peak learning rate (default: %(default)s)")
    training.add_argument("--warmup-steps", type=non_negative_int, help="linear warm-up (default: a tenth of --steps)")
    training.add_argument("--lr-schedule", choices=long_run.SCHEDULES, default="cosine",
                          help="after the warm-up (default: %(default)s)")
    training.add_argument("--min-lr-ratio", type=fraction, default=0.1,
                          help="cosine: the last step's share of --lr (default: %(default)s)")
    training.add_argument("--max-grad-norm", type=non_negative_float, default=1.0,
                          help="clip the gradients' total norm to this before each step; 0: no clipping "
                               "(default: %(default)s)")
    training.add_argument("--optimizer", choices=OPTIMIZERS, default="foreach",
                          help="AdamW's implementation (default: %(default)s)")

    settings = parser.add_argument_group("settings")
    settings.add_argument("--settings", type=setting, nargs="+", metavar="SPEC",
                          help=f"{long_run_driver.SPEC}: a backend of benchmarks/fsdp2/backends.py, its budget, "
                               "trial fields it sets (seed=1, fusion=off, offload_keep=0.5), perturb=SEED (one "
                               "starting weight one rounding step away; eager:perturb=N is the noise floor's "
                               "control) and its run (#2: a repeat, the control for bit-identity); default: "
                               f"{' '.join(DEFAULT_SETTINGS)} (on CPU without inductor)")
    settings.add_argument("--identical", type=setting, nargs=2, action="append", metavar=("SPEC", "SPEC"),
                          help="two listed settings that must compute the same bits (repeatable); default: each "
                               "thunder+memopt-offload setting with thunder+memopt at its budget, each repeat "
                               "with its first run")
    settings.add_argument("--fusion", choices=("on", "off"), default="on",
                          help="thunder_memopt.executors(fusion=...) for the thunder+memopt settings "
                               "(default: %(default)s)")
    settings.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                          help="torch.use_deterministic_algorithms(True) on every rank, so that settings can "
                               "repeat their bits: on CUDA some kernels otherwise accumulate with atomics; attention "
                               "takes flash, not cuDNN, and an op with no deterministic kernel fails its "
                               "setting (default: on)")
    settings.add_argument("--distributed-mode", choices=("fsdp2", "none"), default="fsdp2",
                          help="FSDP2 (fully_shard) or one device (default: %(default)s)")
    settings.add_argument("--shard-mode", choices=SHARD_MODES, default="zero2",
                          help="fsdp2: reshard_after_forward False/True (default: %(default)s)")
    settings.add_argument("--nproc-per-node", type=positive_int, default=1, help="ranks (fsdp2; default: %(default)s)")

    checks = parser.add_argument_group("checks and output")
    checks.add_argument("--tail-steps", type=positive_int, help=f"steps whose mean loss is compared with eager's "
                        f"(default: {DEFAULT_TAIL}, or all steps if fewer)")
    checks.add_argument("--loss-rtol", type=positive_float, default=0.01,
                        help="the least tolerance of that mean's relative difference from eager's (default: "
                             "%(default)s)")
    checks.add_argument("--noise-factor", type=positive_float, default=1.5,
                        help="the tolerance is max(--loss-rtol, this x the noise floor: the relative difference "
                             "of the perturbed control eager:perturb=N from eager), --loss-rtol alone without "
                             "the control (default: %(default)s)")
    checks.add_argument("--progress-every", type=positive_int, default=50,
                        help="a progress line every N steps (default: %(default)s)")
    checks.add_argument("--out", default="long_run.jsonl", help="JSON lines, appended to (default: %(default)s)")
    checks.add_argument("--plot", help="PNG path (default: --out with .png), or 'none'")
    checks.add_argument("--report", help="markdown path (default: --out with .md)")
    checks.add_argument("--log-dir", help="a log per setting (default: --out with .logs)")
    checks.add_argument("--resume", action="store_true", help="take settings whose run is in --out from there")
    checks.add_argument("--time-limit", type=positive_float, help="minutes; start no setting that may not end in time")
    checks.add_argument("--setting-timeout", type=positive_float, default=1800,
                        help="seconds before a setting is stopped (default: %(default)s)")

    args = parser.parse_args(argv)
    if args.distributed_mode == "none" and args.nproc_per_node > 1:
        parser.error("--distributed-mode none runs one process: leave out --nproc-per-node")
    return args, parser


def resolve_defaults(args: argparse.Namespace, parser: argparse.ArgumentParser, cuda: bool) -> None:
    """Defaults that depend on the machine (without a GPU, a narrowed model and no inductor), then
    their checks."""
    defaults = GPU_DEFAULTS if cuda else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup-steps {args.warmup_steps} leaves none of --steps {args.steps} after the warm-up")
    if args.tail_steps is None:
        args.tail_steps = min(DEFAULT_TAIL, args.steps)
    if args.tail_steps > args.steps:
        parser.error(f"--tail-steps {args.tail_steps} exceeds --steps {args.steps}")
    if args.settings is None:
        args.settings = [long_run_driver.parse_setting(spec) for spec in (DEFAULT_SETTINGS if cuda else CPU_SETTINGS)]
    if len({s.label for s in args.settings}) < len(args.settings):
        parser.error("--settings lists a setting twice: give a repeat its run number (SPEC#2)")
    listed = {s.label for s in args.settings}
    for pair in args.identical or ():
        missing = [s.label for s in pair if s.label not in listed]
        if missing:
            parser.error(f"--identical names {', '.join(missing)}, which --settings does not list")


def template_trial(args: argparse.Namespace) -> Trial:
    """The trial every setting starts from; the setting fills in its backend, budget and fields."""
    width = narrow_config(args.model_name, n_layer=args.n_layer, n_embd=args.n_embd).n_embd
    return Trial(
        workload=Workload(model=args.model_name, n_layer=args.n_layer, n_embd=width, narrowed=args.n_embd is not None,
                          block_size=args.block_size, micro_batch_size=args.micro_batch_size, seed=args.seed),
        numerics=Numerics(dtype=str(DTYPES[args.dtype]).removeprefix("torch."), loss_mode=args.loss_mode,
                          optimizer=args.optimizer),
        sharding=Sharding(distributed_mode=args.distributed_mode, shard_mode=args.shard_mode,
                          world_size=1 if args.distributed_mode == "none" else args.nproc_per_node),
        compilation=Compilation(backend="eager", fusion=args.fusion),
        measurement=Measurement(warmup=0, iters=args.steps),
    )


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    environment = driver.describe_environment()
    resolve_defaults(args, parser, environment["cuda"])
    out = Path(args.out)
    runner = driver.Driver(driver.DriverSettings(out=out, log_dir=Path(args.log_dir) if args.log_dir else
                                                 out.with_suffix(".logs"), resume=args.resume,
                                                 time_limit_min=args.time_limit, trial_timeout_s=args.setting_timeout),
                           environment)
    plot_path = None if args.plot == "none" else Path(args.plot) if args.plot else out.with_suffix(".png")
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        print("WARNING: matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        plot_path = None
    template = template_trial(args)
    training = long_run_driver.Training(args.steps, long_run.Schedule(args.lr, args.warmup_steps, args.lr_schedule,
                                                                      args.min_lr_ratio, args.max_grad_norm),
                                        args.progress_every,
                                        args.deterministic)
    pairs = [tuple(pair) for pair in args.identical] if args.identical else long_run_driver.twin_pairs(args.settings)
    print(f"{len(args.settings)} setting(s), {args.steps} steps each, on {environment['gpu']}; rows to {out}, "
          f"logs in {runner.log_dir}", flush=True)
    try:
        runs, steps = long_run_driver.run_settings(runner, template, args.settings, training)
    except driver.TimeLimitReached:
        print(f"--time-limit of {args.time_limit:g} min reached: rerun the same command with --resume to continue",
              flush=True)
        return EXIT_INCOMPLETE
    labels = {s.label for s in args.settings}
    control = long_run_driver.noise_control(args.settings)
    verdict = long_run_report.analyse(runs, steps, [(a.label, b.label) for a, b in pairs],
                                      reference=long_run_driver.REFERENCE if long_run_driver.REFERENCE in labels
                                      else None, expected_steps=args.steps, tail=args.tail_steps, rtol=args.loss_rtol,
                                      control=control.label if control else None, noise_factor=args.noise_factor)
    context = runner.context()
    title = (f"{args.model_name}, {args.n_layer} layers, n_embd {template.workload.n_embd}, T={args.block_size}, "
             f"{args.steps} steps, {args.lr_schedule} lr {args.lr:g}, "
             f"{f'gradients clipped to norm {args.max_grad_norm:g}' if args.max_grad_norm else 'no clipping'}; "
             f"{environment['gpu']}, {context['date']}, "
             f"{environment['memopt_commit']}")
    text = long_run_report.markdown(verdict)
    print(text, flush=True)
    report_path = Path(args.report) if args.report else out.with_suffix(".md")
    report_path.write_text(f"# Long run: {title}\n\n`{context['command']}`\n\n{text}\n")
    long_run_driver.append_summary(runner, verdict.to_json())
    if plot_path is not None:
        long_run_report.plot(runs, steps, verdict.reference, plot_path, title)
        print(f"plot: {plot_path}", flush=True)
    print(f"report: {report_path}; rows: {out}", flush=True)
    if any(run["status"] != "ok" for run in runs):
        return EXIT_SETTING_FAILED
    return 0 if verdict.passed else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
