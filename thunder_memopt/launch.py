"""Run an unmodified Thunder program with the plugin:

    python -m thunder_memopt.launch [OPTIONS] SCRIPT [ARGS...]
    torchrun --nproc-per-node 8 -m thunder_memopt.launch [OPTIONS] SCRIPT [ARGS...]

Every ``thunder.dynamo.ThunderCompiler`` and ``thunder.jit`` the program makes gets a
``MemoryOptimization`` first among its transforms and thunder_memopt's executors (those of
``executors()``) in front of its executors (``with_plugin``); one that already has a
MemoryOptimization is left as the program made it. OPTIONS are MemoryOptimization's and
``executors()``' keywords, as flags (``--activation-budget 0.5``) or environment variables
(``THUNDER_MEMOPT_ACTIVATION_BUDGET=0.5``; a flag wins over the variable), checked before the program
starts (argparse's one-line errors) and printed once on stderr (by rank 0 under torchrun). SCRIPT
runs as ``__main__`` (runpy) with ``sys.argv`` ``[SCRIPT, *ARGS]``, as ``python SCRIPT ARGS`` runs it.
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import thunder
from thunder.dynamo import ThunderCompiler

from thunder_memopt import arguments
from thunder_memopt.executors import executors as memopt_executors
from thunder_memopt.executors.offload import check_host_memory_limit
from thunder_memopt.options import PluginOptions
from thunder_memopt.passes import fit
from thunder_memopt.transform import HEAD_GRADIENTS, MemoryOptimization

__all__ = ["ENV_PREFIX", "FLAGS", "main", "parse", "with_plugin", "enable"]

PROG = "python -m thunder_memopt.launch"
ENV_PREFIX = "THUNDER_MEMOPT_"


def _choice(*values: str) -> Callable[[str], str]:
    def choice(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return text
    return choice


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1")


def _pass_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _host_memory_limit(text: str) -> int | str:
    """bytes (an integer, or with KiB, MiB, GiB, TiB) or auto."""
    try:
        value = arguments._memory_value(text)
        check_host_memory_limit(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host memory limit (bytes, 64GiB or auto)") from None
    return value


# Each option the launcher takes: how its text is read, and what it sets. MemoryOptimization's
# offload_rates (a DeviceRates) has no text form: offload measures the rates on the GPU.
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "activation_budget": (arguments.fraction, "in [0, 1]: 1.0 recomputes cheap ops only, lower values more"),
    "memory_limit": (arguments.memory_limit, "the memory the step may take: bytes (40GiB), a fraction of the "
                                             "GPU's (0.9) or auto, instead of --activation-budget"),
    "optimizer_states": (arguments.non_negative_int, "with --memory-limit: the optimizer's tensors per parameter "
                                                     "(AdamW: 2)"),
    "over_limit": (_choice(*fit.OVER_LIMIT), "with --memory-limit, a limit no plan fits: raise (a one-line "
                                             "error before the first step) or lowest (the lowest plan, a warning)"),
    "cap_allocator": (_boolean, "with --memory-limit, true or false: cap torch's caching allocator at the limit, "
                                "so reserved memory stays under it (default: true)"),
    "offload": (_choice("off", "auto", "budget"), "saved tensors to pinned host memory: off, auto or budget"),
    "offload_budget": (arguments.fraction, "with --offload budget: the share of saved bytes left on the GPU"),
    "host_memory_limit": (_host_memory_limit, "the pinned host memory offload may hold: bytes (64GiB) or auto"),
    "head_gradients": (_choice(*HEAD_GRADIENTS), "where the fused loss head computes its gradients"),
    "passes": (_pass_names, "the passes that run, comma-separated"),
    "prefetch": (arguments.non_negative_int, "all-gathers issued ahead (thunder fsdp)"),
    "zero3": (_boolean, "true or false: save shards and re-gather in backward (default: detected)"),
    "fusion": (_boolean, "true or false: the inductor fusion executor"),
    "cudnn_attention": (_boolean, "true or false: cuDNN attention (default: as --fusion)"),
    "loss_head": (_boolean, "true or false: the fused loss head (default: as --fusion)"),
}


def _env_name(option: str) -> str:
    return ENV_PREFIX + option.upper()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Run a Thunder program with MemoryOptimization and thunder_memopt's executors in "
                               "every ThunderCompiler and thunder.jit it makes.")
    for option, (kind, text) in FLAGS.items():
        p.add_argument("--" + option.replace("_", "-"), dest=option, type=kind, default=None,
                       help=f"{text} (or {_env_name(option)})")
    p.add_argument("script", help="the program, run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")
    return p


def parse(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[PluginOptions, str, list[str]]:
    """The options (flags over ``environ``'s variables), the script and its arguments; argparse's
    error (exit 2) for a bad value, a flag before the script that is not an option, a missing
    script, or options that MemoryOptimization refuses."""
    p = _parser()
    namespace = p.parse_args(argv)
    given: dict[str, Any] = {}
    for option, (kind, _) in FLAGS.items():
        text = environ.get(_env_name(option))
        if text is not None:
            try:
                given[option] = kind(text)
            except argparse.ArgumentTypeError as e:
                p.error(f"{_env_name(option)}: {e}")
    given.update({option: value for option, value in vars(namespace).items() if option in FLAGS and value is not None})
    if not os.path.isfile(namespace.script):
        p.error(f"{namespace.script}: no such file")
    plugin = PluginOptions.of(given, PROG)
    try:
        MemoryOptimization(**plugin.memory)
    except (TypeError, ValueError) as e:
        p.error(str(e))
    return plugin, namespace.script, list(namespace.args)


def _unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Variables named like an option that none is (a misspelt one is not read)."""
    known = {_env_name(option) for option in FLAGS}
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def _name(executor) -> str:
    return executor if isinstance(executor, str) else executor.name


def with_plugin(options: Mapping[str, Any], plugin: PluginOptions) -> dict[str, Any]:
    """ThunderCompiler's or thunder.jit's keyword options with a new MemoryOptimization of ``plugin``
    first among the transforms and thunder_memopt's executors in front of the executors (given:
    those; none: Thunder's defaults). Options whose transforms already hold a MemoryOptimization
    come back as they are."""
    transforms = list(options.get("transforms") or ())
    if any(isinstance(t, MemoryOptimization) for t in transforms):
        return dict(options)
    chosen = memopt_executors(**plugin.executors)
    given = options.get("executors")
    if given is not None:
        defaults = {e.name for e in thunder.get_default_executors()}
        ours = [e for e in chosen if e.name not in defaults]
        chosen = [*ours, *(e for e in given if _name(e) not in {o.name for o in ours})]
    return {**options, "transforms": [plugin.memory_optimization(PROG), *transforms], "executors": chosen}


def enable(plugin: PluginOptions) -> None:
    """From now on, in this process, every ThunderCompiler and thunder.jit takes ``with_plugin``'s
    options. ThunderCompiler's ``__init__`` is patched in its class, so that a name imported before
    is patched too; ``thunder.jit`` where it is looked up (ThunderCompiler looks it up at each call)."""
    compiler_init, jit = ThunderCompiler.__init__, thunder.jit

    @functools.wraps(compiler_init)
    def __init__(self, **thunder_options):
        compiler_init(self, **with_plugin(thunder_options, plugin))

    @functools.wraps(jit)
    def jit_with_plugin(fn, /, **options):
        return jit(fn, **with_plugin(options, plugin))

    ThunderCompiler.__init__ = __init__
    thunder.jit = jit_with_plugin


def _describe(plugin: PluginOptions, script: str) -> str:
    memopt = plugin.memory_optimization(PROG)
    defaults = {e.name for e in thunder.get_default_executors()}
    ours = [e.name for e in memopt_executors(**plugin.executors) if e.name not in defaults]
    return (f"thunder_memopt.launch: {script} with {memopt!r} first among the transforms and the executors "
            f"{ours} in front, in every ThunderCompiler and thunder.jit")


def main(argv: Sequence[str] | None = None) -> None:
    plugin, script, args = parse(sys.argv[1:] if argv is None else argv, os.environ)
    if os.environ.get("RANK", "0") == "0":
        print(_describe(plugin, script), file=sys.stderr, flush=True)
        for name in _unknown_variables(os.environ):
            print(f"thunder_memopt.launch: {name} is not an option's variable, not read", file=sys.stderr, flush=True)
    enable(plugin)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it first
    try:
        runpy.run_path(script, run_name="__main__")
    except fit.MemoryLimitError as e:  # the refusal is its one line, not a traceback through the compile
        sys.exit(f"{PROG}: {e}")


if __name__ == "__main__":
    main()
