"""Fusion regions compiled side by side in inductor's worker processes, ahead of this process.

Inductor lowers a graph to code in the calling process, in Python, one graph after another: on an
H200 host 0.2 to 1.8 s a fusion region, and in a first step under FSDP2 that was most of what
thunder+memopt took over plain Thunder (issue 13: 8.7 of 18.3 s). Its pool of compile workers
(``AsyncCompile.process_pool``) compiles only Triton kernels. Here each region's ATen graph goes to
that pool, where one worker compiles it with this process's inductor and functorch configuration
and leaves the result in inductor's caches on disk (AOTAutograd's, the FX graph cache, Triton's);
this process then compiles the same graph, pickled the same way, and finds it there. What runs is
therefore what this process would have compiled itself: a worker that fails, or whose result this
process does not find, costs only the time it took.

The workers never use the GPU, so that none of them holds device memory: they make their fake
tensors without the CUDA context that fake CUDA tensors otherwise create (``init_gpu_context``),
and build Triton kernels into Triton's cache without loading them, as inductor's own workers do
(``warm_cache_only``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import wait

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = ["compile_graph", "compile_in_workers", "fake_mode", "portable_graph", "start_compile_workers",
           "workers_available"]

# The environment a worker compiles under, as inductor hands it to its Triton jobs: where its caches are.
_CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# How long to wait for the workers before compiling here regardless (a region takes seconds).
_WAIT_SECONDS = 300.0
# A fake tensor's input: shape, strides, dtype, device.
InputMeta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


@functools.cache
def start_compile_workers() -> None:
    """Start inductor's pool of compile workers in the background, once per process.

    torch.compile's inductor backend starts it when dynamo first calls it (``maybe_warm_pool``);
    ThunderCompiler and ``thunder.jit`` never do. Without this, the pool starts only at the first
    region's compilation, and until its workers have imported torch (seconds), inductor compiles
    each kernel in this process, one after another. Nothing starts where there is no GPU: inductor
    uses the pool only for Triton there."""
    if not torch.cuda.is_available():
        return
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def fake_mode() -> FakeTensorMode:
    """A fake mode as ``make_fx`` makes for itself. Its ShapeEnv (static shapes) lets inductor's FX
    graph cache serve the regions: without one, every compilation bypasses the cache ('No shape
    env'), and a second run of the same model compiles everything again."""
    return FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)


def workers_available() -> bool:
    """Whether regions can be compiled in workers: a pool of more than one worker, and an FX graph
    cache for them to hand their results over in."""
    from torch._inductor import config
    from torch._inductor.async_compile import get_compile_threads

    return get_compile_threads() > 1 and config.fx_graph_cache and not config.force_disable_caches


def portable_graph(fn: Callable, fake_args: Sequence) -> bytes:
    """``fn`` traced to an ATen graph for ``fake_args``, pickled: a worker and this process compile
    the very graph that unpickles from these bytes, so that both compute the same cache keys."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return pickle.dumps(make_fx(fn, tracing_mode="fake")(*fake_args))


def compile_graph(graph: bytes, fake_args: Sequence, options: dict) -> Callable:
    """The graph of ``portable_graph`` compiled by inductor for ``fake_args`` with ``options``."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(pickle.loads(graph), list(fake_args), config_patches=options)


def compile_in_workers(graphs: Sequence[tuple[bytes, Sequence[torch.Tensor]]], options: dict) -> list[bool]:
    """Compile each ``(graph, fake_args)`` (as ``compile_graph``) in inductor's workers, side by side,
    and wait for them; returns which a worker compiled. A failure is one warning, once per process:
    this process compiles the graph anyway."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    configs = {"inductor": inductor_config.save_config_portable(),
               "functorch": functorch_config.save_config_portable()}
    env = {k: os.environ[k] for k in _CACHE_ENV if k in os.environ}
    pool = AsyncCompile.process_pool()
    futures = [pool.submit(_compile_in_worker, graph, tuple(map(_input_meta, fake_args)), options, configs, env)
               for graph, fake_args in graphs]
    wait(futures, timeout=_WAIT_SECONDS)
    compiled = [f.done() and f.exception() is None for f in futures]
    if not all(compiled):
        failure = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
        reason = f"{type(failure).__name__}: {failure}" if failure else f"not done in {_WAIT_SECONDS:.0f} s"
        _warn_once(f"thunder_memopt: {compiled.count(False)} of {len(futures)} fusion regions not compiled "
                   f"in inductor's workers, compiled in this process instead ({reason.splitlines()[0]})")
    return compiled


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message)


def _input_meta(t: torch.Tensor) -> InputMeta:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def _compile_in_worker(graph: bytes, inputs: Sequence[InputMeta], options: dict, configs: dict,
                       env: dict[str, str]) -> float:
    """Runs in a worker: ``compile_graph`` under the caller's configuration, caches and grad mode
    (no grad, no autocast, as the regions compile), the GPU untouched; returns the seconds taken."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    start = time.perf_counter()
    os.environ.update(env)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(configs["inductor"]))
        stack.enter_context(functorch_config.patch(configs["functorch"]))
        # One process: a worker compiles its Triton kernels itself, not in a pool of its own.
        stack.enter_context(inductor_config.patch(compile_threads=1))
        stack.enter_context(_gpu_untouched())
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cuda", enabled=False))
        stack.enter_context(torch.autocast("cpu", enabled=False))
        mode = fake_mode()
        with mode:
            fake_args = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                         for shape, stride, dtype, device in inputs]
        compile_graph(graph, fake_args, options)
    return time.perf_counter() - start


@contextlib.contextmanager
def _gpu_untouched() -> Iterator[None]:
    """No CUDA context: fake CUDA tensors without the real tensor that ``init_gpu_context`` makes,
    and Triton kernels compiled into Triton's cache without being loaded."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from torch._subclasses import fake_tensor

    init_gpu_context, precompile = fake_tensor.init_gpu_context, CachingAutotuner.precompile

    def cache_only(self, warm_cache_only=False, *args, **kwargs):
        return precompile(self, True, *args, **kwargs)

    fake_tensor.init_gpu_context = lambda device: None
    CachingAutotuner.precompile = cache_only
    try:
        yield
    finally:
        fake_tensor.init_gpu_context, CachingAutotuner.precompile = init_gpu_context, precompile
