"""Inductor without dynamo: a function compiled by inductor's graph compiler, and the Triton kernels
of what it compiled awaited later.

The fusion executor's regions and the functions other executors compile through it
(``executors/fusion.py``: ``compiled_function``) are lowered here: traced with fake tensors into
inductor's ATen IR and handed to ``compile_fx_inner``, under the options that round as ATen does
(``EAGER_NUMERICS``) and fix each kernel's launch configuration (``NO_AUTOTUNING``). So that regions
compiled ahead do not each wait for their kernels in turn, the modules loaded during a batch of
lowerings leave their Triton kernels to be awaited at each region's first run
(``_kernels_deferred``, ``_PendingKernels``), compiled by inductor's pool of workers
(``start_compile_workers``). Everything here that reaches into ``torch._inductor`` is kept apart from
the executor, which decides what to fuse and when to compile.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = [
    "EAGER_NUMERICS",
    "NO_AUTOTUNING",
    "start_compile_workers",
]

# Inductor options that bring fused code closest to ATen's one-op-at-a-time rounding.
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}
# And the options that pick each kernel's launch configuration by inductor's heuristics instead of
# compiling several and timing them at the first run. A reduction's configuration fixes the order of
# its sums, so picking it by timing could change the rounding from one run (or machine) to the next;
# fixed, the fused numerics repeat. It also takes about a fifth off the regions' compilation (one
# H200: benchmarks/results/compile_time_h200.md).
NO_AUTOTUNING = {
    "deterministic": True,
    "triton.autotune_pointwise": False,
}


@contextlib.contextmanager
def _kernels_deferred(scopes: list[dict]) -> Iterator[None]:
    """Inductor's compiled modules, loaded meanwhile by this thread, return at once from their wait
    for their Triton kernels (``async_compile.wait(globals())``), their globals left in ``scopes``
    to await later. And while inductor's compile pool is still starting, their kernels are not
    compiled at load, one after another in this process, but when awaited (``_DeferredKernel``): by
    then the pool may be ready to compile them side by side. Another thread's compilations go as
    usual."""
    from torch._inductor.async_compile import AsyncCompile

    wait, triton, thread = AsyncCompile.wait, AsyncCompile.triton, threading.get_ident()
    deferred_kernels: dict[tuple, _DeferredKernel] = {}

    def deferred_wait(self, scope: dict) -> None:
        if threading.get_ident() == thread:
            scopes.append(scope)
        else:
            wait(self, scope)

    def deferred_triton(self, kernel_name: str, source_code: str, *args, **kwargs):
        if threading.get_ident() != thread or self.use_process_pool():
            return triton(self, kernel_name, source_code, *args, **kwargs)
        key = (kernel_name, source_code, args, tuple(sorted(kwargs.items())))
        if key not in deferred_kernels:
            deferred_kernels[key] = _DeferredKernel(functools.partial(triton, self, kernel_name, source_code,
                                                                      *args, **kwargs))
        return deferred_kernels[key]

    AsyncCompile.wait, AsyncCompile.triton = deferred_wait, deferred_triton
    try:
        yield
    finally:
        AsyncCompile.wait, AsyncCompile.triton = wait, triton


class _DeferredKernel:
    """A Triton kernel whose compilation starts when it is awaited: ``start`` hands it to inductor's
    compile pool if the pool is ready then (a future), else compiles it in this process."""

    def __init__(self, compile_kernel: Callable[[], object]) -> None:
        self._compile = compile_kernel
        self._started: object | None = None

    def start(self) -> None:
        if self._started is None:
            self._started = self._compile()

    def result(self) -> object:
        from torch._inductor.codecache import CodeCacheFuture

        self.start()
        started = self._started
        return started.result() if isinstance(started, (Future, CodeCacheFuture)) else started


class _PendingKernels:
    """The Triton kernels of the modules one ``compile_ahead`` loaded, compiling in inductor's pool
    while the step starts. Each region awaits its own module's kernels at its first run; any later
    compilation first awaits them all, since it may load one of these modules from inductor's cache,
    which does not run the module's wait again."""

    _outstanding: list[_PendingKernels] = []
    _lock = threading.RLock()  # a backward runs in autograd's threads

    @dataclass(frozen=True)
    class Part:
        batch: _PendingKernels
        scopes: Sequence[dict] | None  # None: every module of the batch

        def wait(self) -> float:
            """Seconds spent waiting for these modules' kernels."""
            return self.batch._wait(self.scopes)

    def __init__(self, scopes: Sequence[dict]) -> None:
        self._scopes = scopes
        # Kernels by their future's id, across waits: modules of one batch can share a future (a
        # kernel of the same source), and inductor's loaded-kernel futures build a kernel per result().
        self._kernels: dict[int, object] = {}
        self._futures: list[object] = []  # alive while ``_kernels`` is keyed by their ids
        _start_deferred(scopes)
        with self._lock:
            self._outstanding.append(self)

    def part(self, scopes: Sequence[dict]) -> Part:
        """The kernels of ``scopes``; of the whole batch if a region loaded no module of its own (it
        reuses one that another region of the batch loaded)."""
        return self.Part(self, scopes or None)

    def _wait(self, scopes: Sequence[dict] | None) -> float:
        start = time.perf_counter()
        with self._lock:
            _await_kernels(self._scopes if scopes is None else scopes, self._kernels, self._futures)
        return time.perf_counter() - start

    @classmethod
    def await_all(cls) -> None:
        with cls._lock:
            while cls._outstanding:
                cls._outstanding.pop()._wait(None)


def _start_deferred(scopes: Sequence[dict]) -> None:
    """The deferred kernels of ``scopes`` started in order: once inductor's pool is ready, the rest
    compile there side by side."""
    for scope in scopes:
        for v in scope.values():
            if isinstance(v, _DeferredKernel):
                v.start()


def _await_kernels(scopes: Sequence[dict], kernels: dict[int, object] | None = None,
                   futures: list[object] | None = None) -> None:
    """Each scope's kernel futures replaced by their kernels, as inductor's wait does, its deferred
    kernels started first (``_start_deferred``). A future shared by several scopes is awaited once
    (``kernels``, by its id, kept valid by ``futures``: both may carry over from an earlier call)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import CodeCacheFuture

    kernels = {} if kernels is None else kernels
    futures = [] if futures is None else futures
    _start_deferred(scopes)
    for scope in scopes:
        for k, v in scope.items():
            if isinstance(v, _DeferredKernel):
                scope[k] = kernels[id(v)] if id(v) in kernels else v.result()
                kernels[id(v)] = scope[k]
                futures.append(v)
        pending = {k: v for k, v in scope.items() if isinstance(v, (Future, CodeCacheFuture))}
        futures.extend(pending.values())
        for k, v in pending.items():
            if id(v) in kernels:
                scope[k] = kernels[id(v)]
        AsyncCompile().wait(scope)
        for k, v in pending.items():
            kernels[id(v)] = scope[k]


def _fake_mode() -> FakeTensorMode:
    """A fake mode as ``make_fx`` makes for itself. Its ShapeEnv (static shapes) lets inductor's FX
    graph cache serve the regions: without one, every compilation bypasses the cache ('No shape
    env'), and a second run of the same model compiles everything again."""
    return FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv(), static_shapes=True)


def _inductor_compiled(fn: Callable, fake_args: Sequence) -> Callable:
    """``fn`` traced and compiled for ``fake_args`` (fake tensors of one ``_fake_mode()``, and
    non-tensor values, which the compiled function takes as constants).

    Traced into inductor's ATen IR (``make_fx`` with inductor's decompositions, a concatenation of
    one tensor with empty ones made a contiguous copy as eagerly) and handed to inductor's graph
    compiler (``compile_fx_inner``), as ``compile_fx`` does after AOTAutograd. A region needs
    nothing of AOTAutograd: no autograd (it runs under no_grad), and a function that updates its
    inputs (``compiled_function``) is functionalized first.
    Skipping its retrace, its cache key and its joint-graph passes took the regions' compilation of
    a 2-layer stablecode from 6.85 to 4.72 s on one H200 (benchmarks/results/compile_time_h200.md)."""
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import output_node
    from torch.fx.experimental.proxy_tensor import make_fx

    fake_mode = next((a.fake_mode for a in fake_args if isinstance(a, torch.Tensor)), None) or _fake_mode()
    # The tracing context gives inductor's FX graph cache the fake mode's ShapeEnv, its key's part.
    with config.patch({**EAGER_NUMERICS, **NO_AUTOTUNING}), tracing(TracingContext(fake_mode)):
        graph = make_fx(fn, decomposition_table=_decompositions(), tracing_mode="fake")(*fake_args)
        _contiguous_single_tensor_cats(graph)
        # A region returns a list. Every output keeps the strides it has eagerly, as compile_fx has
        # inductor keep a model's.
        out = output_node(graph)
        out.meta["user_visible_output_idxs"] = [i for i, o in enumerate(out.args[0]) if isinstance(o, torch.fx.Node)]
        compiled = compile_fx_inner(graph, list(fake_args), is_inference=True)
    return lambda *args: compiled(list(args))  # it takes a list, which it empties


def _decompositions() -> dict:
    """Inductor's decompositions, but for ``cat``: see ``_contiguous_single_tensor_cats``."""
    from torch._inductor.decomposition import select_decomp_table

    return {op: f for op, f in select_decomp_table().items() if op is not torch.ops.aten.cat.default}


def _contiguous_single_tensor_cats(graph: torch.fx.GraphModule) -> None:
    """Each contiguous ``cat`` of one tensor and empty ones made a contiguous copy of that tensor.

    litgpt's rotary embedding concatenates the rotated part of each head with the rest, which is
    empty where the rotation covers the whole head (Llama's). Eagerly the result is contiguous;
    inductor takes such a cat for a ``clone`` that keeps the rotation's layout, the (B, T, H, D)
    order of the fused qkv projection (on one H200, Llama-3-8B: cuDNN then returned that layout's
    gradient to a region compiled ahead for contiguous inputs, which was compiled again at its
    first call)."""
    for node in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default):
        full = [t for t in node.args[0] if t.meta["val"].numel() != 0]
        if len(full) != 1 or not node.meta["val"].is_contiguous():
            continue
        with graph.graph.inserting_before(node):
            copy = graph.graph.call_function(torch.ops.aten.clone.default, (full[0],),
                                             {"memory_format": torch.contiguous_format})
        copy.meta.update(node.meta)
        node.replace_all_uses_with(copy)
        graph.graph.erase_node(node)
    graph.recompile()


@functools.cache
def start_compile_workers() -> None:
    """Start inductor's pool of Triton compile workers in the background, once per process.

    torch.compile's inductor backend starts it when dynamo first calls it (``maybe_warm_pool``);
    ThunderCompiler and ``thunder.jit`` never do. Without this, the pool starts only at the first
    region's compilation, and until its workers have imported torch (seconds), inductor compiles
    each kernel in this process, one after another. Nothing starts where there is no GPU: inductor
    uses the pool only for Triton."""
    if not torch.cuda.is_available():
        return
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()
