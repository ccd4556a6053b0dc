"""The fusion executor: everything but the heavy ops, compiled by inductor into one kernel per region.

Without nvFuser, Thunder runs every decomposed op alone: each cast to fp32, each multiply of a
LayerNorm, GELU or rotary embedding reads and writes a whole activation, and on an H200 that is half
of a stablecode step. This executor claims the ops that ``thunder_memopt.core.ops.fusible_name`` admits
(elementwise ops, casts, views, the norms' reductions, cat/pad, softmax and the cross-entropy's
pieces) and never matmuls, attention, embeddings, random ops, collectives or in-place ops. Each
maximal run of claimed ops becomes a region compiled by inductor, as by Thunder's ``torch_compile_ex``
but without dynamo in the call, with inductor's eager-numerics options (no elision of bf16/fp32 round
trips, correctly rounded division, no flushing of denormals), so that fused code rounds as close to
ATen's one-op-at-a-time code as inductor can.

Regions with the same ops on the same shapes (every layer's) share one compiled function, so the
first step compiles each kind of region once; ``compile_stats()`` reports how many and how long.
MemoryOptimization compiles a forward's and its backward's regions together before they first run
(``compile_ahead``), so that inductor's workers compile one region's Triton kernels while the next
region is lowered, and every compilation goes through inductor's FX graph cache, so that a second
run of the same model loads what the first compiled.

With MemoryOptimization the recompute pass works on the ops, not on the regions: the transform
takes the regions apart (``unfuse``), chooses what to save, and fuses the forward again with the
replayed ops in regions of their own, whose outputs include what the backward reads
(``fuse_with_replays``), and the backward after its replays (``refuse``). The backward then replays
those very regions, so replayed values equal the forward's bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch
from thunder.core import devices, dtypes, prims, utils
from thunder.core.codeutils import SigInfo
from thunder.core.proxies import Proxy, ProxyInterface, TensorProxy, unvariableify, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.executors.torch_compile import TorchCompileExecutor
from thunder.executors.torchex import ex as pytorch_ex
from thunder.executors.torchex import no_autocast
from thunder.executors.utils import Region
from thunder.extend import ImplInfo
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from thunder_memopt.core.memory import simulated_strides
from thunder_memopt.core.ops import fusible_name, leaf_names, moves_data
from thunder_memopt.core.trace import SavedSetChange, replace_bound_symbols, strip_deletions, tensor_args, tensor_outs

__all__ = [
    "EAGER_NUMERICS",
    "NO_AUTOTUNING",
    "COMPILED_FUNCTIONS_OF",
    "CompileStats",
    "InductorFusionExecutor",
    "compile_ahead",
    "compiled_function",
    "compile_stats",
    "reset_compile_stats",
    "start_compile_workers",
    "torch_metadata",
]

_Change = TypeVar("_Change", bound=SavedSetChange)

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


@dataclass(frozen=True)
class CompileStats:
    """The compiled functions behind every fusion region built so far in this process."""

    functions: int  # distinct compiled functions
    compiled: int  # of those, compiled (ahead, or at a first call)
    layouts_ahead: int  # input layouts compiled ahead (compile_ahead)
    layouts_at_call: int  # input layouts compiled at a first call (not compiled ahead)
    compile_seconds: float  # time of their compilation and of each layout's first run (loading its kernels)
    # Of that: inductor's lowering to code (with the wait for a layout's kernels when compiled at a
    # call), and, for layouts compiled ahead, the wait at their first runs for kernels still compiling.
    lowering_seconds: float
    kernel_wait_seconds: float


class _CompiledRegion:
    """A region's function, compiled by inductor for the strides (and non-tensor values) of the
    inputs it gets, and called without dynamo.

    ``torch.compile`` would evaluate dynamo's guards on every call: tens of microseconds a region,
    which a step of a few hundred regions turns into idle GPU time. Here the only check is the
    inputs' strides; shapes and dtypes are fixed by the region's key. A layout not compiled ahead
    (``compile_ahead``) is compiled at its first call (``_inductor_compiled``: traced with fake
    tensors, compiled by inductor's graph compiler). Both are timed."""

    def __init__(self, make_fn: Callable[[], Callable], tensor_inputs: Sequence[TensorMetadata] | None) -> None:
        self._make_fn = make_fn
        self.seconds: float | None = None
        self.lowering_seconds = self.kernel_wait_seconds = 0.0
        self.layouts_ahead = self.layouts_at_call = 0
        self._by_layout: dict[tuple, Callable] = {}
        self._not_run_yet: set[tuple] = set()  # layouts compiled ahead, whose first run is still to time
        # Layouts compiled ahead whose Triton kernels may still be compiling: awaited at the first run.
        self._kernels_of: dict[tuple, _PendingKernels.Part] = {}
        # Shapes, dtypes and devices of the inputs, for compile_ahead; None if one is not a tensor
        # (its value is known only at the call).
        self._tensor_inputs = tensor_inputs
        # Grad mode and autocast off while it runs and compiles, as torch_compile_ex runs its regions:
        # both would change what is traced.
        self._run = torch.no_grad()(no_autocast(self._run_compiled))

    @functools.cached_property
    def fn(self) -> Callable:
        """The region's function, built at its first compilation: most regions that the fusion passes
        build are replaced by later passes and never run (40 ms a region on CPU, most of the passes'
        time on a transformer Block)."""
        return self._make_fn()

    def __call__(self, *args):
        return self._run(*args)

    def _run_compiled(self, *args):
        layout = tuple(_strides(a) if isinstance(a, torch.Tensor) else ("value", a) for a in args)
        compiled = self._by_layout.get(layout)
        if compiled is not None and layout not in self._not_run_yet:
            return compiled(*args)
        start = time.perf_counter()
        if compiled is None:
            _PendingKernels.await_all()  # the compilation may load a module of theirs from the cache
            mode = _fake_mode()
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            compiled = self._by_layout[layout] = _inductor_compiled(self.fn, fake)
            self.layouts_at_call += 1
            self._add_seconds(lowering=time.perf_counter() - start)
            start = time.perf_counter()
        self._not_run_yet.discard(layout)
        if layout in self._kernels_of:
            self._add_seconds(kernel_wait=self._kernels_of.pop(layout).wait())
            start = time.perf_counter()
        out = compiled(*args)  # timed too: a first run loads its kernels
        self._add_seconds(first_run=time.perf_counter() - start)
        return out

    def _add_seconds(self, *, lowering: float = 0.0, kernel_wait: float = 0.0, first_run: float = 0.0) -> None:
        self.seconds = (self.seconds or 0.0) + lowering + kernel_wait + first_run
        self.lowering_seconds += lowering
        self.kernel_wait_seconds += kernel_wait

    def example(self, strides: Sequence[tuple[int, ...] | None]) -> tuple | None:
        """Fake inputs of the region's shapes with ``strides`` (None or another rank: contiguous), or
        None if an input is not a tensor."""
        if self._tensor_inputs is None:
            return None
        with _fake_mode():
            return tuple(
                torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if stride is not None and len(stride) == len(shape) else torch.empty(shape, dtype=dtype, device=device)
                for (shape, dtype, device), stride in zip(self._tensor_inputs, strides))


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """A tensor's strides, those of its dimensions of size 1 as 0: no element's address depends on
    them, and inductor's checks of its inputs' strides skip them (``assert_size_stride``)."""
    return tuple(stride if size > 1 else 0 for size, stride in zip(t.shape, t.stride()))


# Symbol name -> the functions (``compiled_function``) that an op of it will call, all of whose
# inputs are contiguous: compile_ahead compiles them with the regions (the fused loss head's chunk math).
COMPILED_FUNCTIONS_OF: dict[str, Callable[[BoundSymbol], Sequence[_CompiledRegion]]] = {}


def compile_ahead(traces: Sequence[TraceCtx]) -> int:
    """Compiles now the fusion regions of ``traces`` (final traces, about to run) that are not
    compiled yet, for the strides the memory model expects of their inputs
    (``memory.simulated_strides``: a view's follow its base, anything else is contiguous, and a
    backward's inputs are as its forward made them; ``traces`` in that order); returns how many it
    compiled.

    Compiled one at a time at their first calls, each region waits for inductor's workers to compile
    its Triton kernels, and in a first step that is half of the compilation time. Here each region
    is lowered while the workers compile the kernels of the regions before it, and each region
    waits for its own kernels only at its first run (``_PendingKernels``), so that the backward's
    compile while the forward runs. While the pool is still starting (it takes seconds, and the
    first step's compilation starts a few seconds after it is asked for), the kernels of the
    regions lowered meanwhile are started at the end of the batch, rather than compiled in this
    process one after another during lowering. A region whose inputs come with other strides than
    the model foresees is compiled for them at its first call, as without this."""
    pending = [[(b, fn) for b in trace.bound_symbols
                if b.sym.is_fusion and isinstance(b.sym.executor, InductorFusionExecutor)
                for fn in b._call_ctx.values() if isinstance(fn, _CompiledRegion) and fn.seconds is None]
               for trace in traces]
    # Functions that other executors' ops will call, compiled for contiguous inputs.
    regions: dict[int, tuple[_CompiledRegion, list]] = {
        id(fn): (fn, [None] * len(fn._tensor_inputs))
        for trace in traces for b in trace.bound_symbols if b.sym.name in COMPILED_FUNCTIONS_OF
        for fn in COMPILED_FUNCTIONS_OF[b.sym.name](b) if fn.seconds is None}
    if not any(pending) and not regions:
        return 0
    strides: dict[str, tuple[int, ...]] = {}
    for trace, found in zip(traces, pending):
        # A backward receives what its forward saved, with the strides the forward gave it.
        strides = simulated_strides(trace, received=strides)
        for b, fn in found:
            regions.setdefault(id(fn), (fn, [strides.get(getattr(a, "name", None)) for a in b.args]))
    # A module lowered now may be one the regions before loaded, from inductor's cache.
    _PendingKernels.await_all()
    compiled: list[tuple[_CompiledRegion, tuple, Callable, float, slice]] = []
    scopes: list[dict] = []

    def lower_each() -> None:  # under no_grad and no autocast, as the regions run
        for fn, strides in regions.values():
            example = fn.example(strides)
            if example is None:
                continue
            start, first = time.perf_counter(), len(scopes)
            function = _inductor_compiled(fn.fn, example)
            compiled.append((fn, tuple(map(_strides, example)), function, time.perf_counter() - start,
                             slice(first, len(scopes))))

    try:
        with _kernels_deferred(scopes):
            torch.no_grad()(no_autocast(lower_each))()
    except BaseException:
        # A module loaded meanwhile is cached by its source, and a later compilation of the same
        # region must find its kernels in place.
        _await_kernels(scopes)
        raise
    batch = _PendingKernels(scopes)
    for fn, layout, function, seconds, span in compiled:
        fn._by_layout[layout] = function
        fn._not_run_yet.add(layout)
        fn._kernels_of[layout] = batch.part(scopes[span])
        fn.layouts_ahead += 1
        fn._add_seconds(lowering=seconds)
    return len(compiled)


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


# Compiled functions by their region's canonical ops and their inputs' metadata, so that every layer's
# identical region (and every later compilation of the same model) reuses one.
_compiled_functions: dict[tuple, _CompiledRegion] = {}
_region_numbers = itertools.count()


def compile_stats() -> CompileStats:
    functions = list(_compiled_functions.values())
    done = [f.seconds for f in functions if f.seconds is not None]
    return CompileStats(len(functions), len(done), sum(f.layouts_ahead for f in functions),
                        sum(f.layouts_at_call for f in functions), sum(done),
                        sum(f.lowering_seconds for f in functions), sum(f.kernel_wait_seconds for f in functions))


def reset_compile_stats() -> None:
    """Forget every compiled region (the next use compiles again)."""
    _compiled_functions.clear()


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


class InductorFusionExecutor(TorchCompileExecutor):
    """A ``FusionExecutor`` that compiles regions of cheap ops with inductor.

    Args:
        name: the executor's name.
        devices: device types whose tensors it claims; inductor generates Triton for CUDA and C++ for
            CPU (the tests force CPU, where fused C++ code rounds differently from ATen's).
    """

    def __init__(self, name: Hashable, *, devices: Sequence[str] = ("cuda",)) -> None:
        super().__init__(name)
        self.devices = frozenset(devices)
        checker = functools.partial(_on_devices, self.devices)
        self._implmap = {
            op: ImplInfo(checker=checker) for op in pytorch_ex.implmap if fusible_name(_op_name(op))
        }

    def fuse(self, region: Region, fusion_counter: int) -> BoundSymbol:
        return self.region_symbol(list(region.bound_symbols), [unvariableify(x) for x in region.inputs],
                                  [unvariableify(x) for x in region.outputs])

    def region_symbol(self, bsyms: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> BoundSymbol:
        """The bound symbol of a region of ``bsyms``, compiled as one function of ``inputs``."""
        # Unique in the process, not per trace: the backward runs the forward's replay regions
        # beside its own, and a trace's call context is keyed by these names.
        name = f"MemoptFusion{next(_region_numbers)}"
        fn = _compiled(bsyms, inputs, outputs)
        sym = Symbol(name, meta=functools.partial(_outputs_like, tuple(outputs)), is_fusion=True, executor=self)
        return BoundSymbol(sym, tuple(inputs), {}, tuple(outputs), tuple(bsyms), _call_ctx={name: fn})

    def fusion_pass(self, trace: TraceCtx, apart: Callable[[BoundSymbol], bool] | None = None,
                    keep_outputs: Callable[[list[BoundSymbol]], Sequence[Proxy]] | None = None) -> TraceCtx:
        """Each run of claimed symbols as one region.

        ``apart`` keeps the symbols for which it is true in regions apart from the others (each run
        is first ordered into as few such groups as its dependencies allow); ``keep_outputs`` names,
        for a region's symbols, outputs to return besides those read after it. Runs that ATen does
        in one kernel (views and at most one op that moves data) are left to the torch executor:
        inductor would gain nothing there and cost a compilation."""
        start = time.perf_counter_ns()
        claimed = [self._claims(b) for b in trace.bound_symbols]
        if "cuda" in self.devices and any(claimed):
            start_compile_workers()
        bsyms = _grouped_apart(trace.bound_symbols, claimed, apart)
        ordered = from_trace(trace)
        ordered.bound_symbols = bsyms
        producers, consumers = utils.producers_and_consumers(ordered)
        claimed_ids = {id(b) for b, c in zip(trace.bound_symbols, claimed) if c}

        def key(b: BoundSymbol) -> Hashable:
            return None if apart is None else apart(b)

        groups: list[list[BoundSymbol]] = []
        for b in bsyms:
            if id(b) in claimed_ids and groups and id(groups[-1][0]) in claimed_ids and key(groups[-1][0]) == key(b):
                groups[-1].append(b)
            else:
                groups.append([b])
        fused: list[BoundSymbol] = []
        counter = 0
        for group in groups:
            if not (id(group[0]) in claimed_ids and _kernels(group) >= 2):
                fused.extend(group)
                continue
            region = Region(producers, consumers, group)
            if keep_outputs is not None:
                _add_outputs(region, keep_outputs(group))
            fused.append(self.fuse(region, counter))
            counter += 1
        out = from_trace(trace)
        out.bound_symbols = fused
        elapsed_ms = (time.perf_counter_ns() - start) // 1_000_000
        out.set_provenance(TraceProvenance(f"thunder_memopt fusion: {counter} inductor regions (took {elapsed_ms} ms)"))
        return out

    def _claims(self, bsym: BoundSymbol) -> bool:
        """What this executor claims, and the torch executor's lowering of it: a trace fused again
        holds the views that an earlier pass left outside regions and lowered."""
        if self.can_fuse(bsym):
            return True
        return (getattr(bsym.sym, "executor", None) is pytorch_ex and bool(bsym.subsymbols)
                and all(fusible_name(n) for n in leaf_names(bsym)) and _on_devices(self.devices, *bsym.flat_proxy_args))

    def is_own_fusion(self, bsym: BoundSymbol) -> bool:
        return bsym.sym.is_fusion and bsym.sym.executor is self

    def unfuse(self, trace: TraceCtx) -> TraceCtx:
        """The trace with this executor's regions replaced by the symbols they hold."""
        out = from_trace(trace)
        out.bound_symbols = [s for b in trace.bound_symbols for s in (b.subsymbols if self.is_own_fusion(b) else (b,))]
        out.set_provenance(TraceProvenance("thunder_memopt fusion: regions taken apart"))
        return out

    def refuse(self, trace: TraceCtx) -> TraceCtx:
        """``fusion_pass`` over a trace that holds unfused claimed symbols (after ``unfuse``), then the
        rest lowered as Thunder's ``transform_for_execution`` does (``lower_rest``)."""
        return self.lower_rest(self.fusion_pass(strip_deletions(trace)))

    def fuse_with_replays(self, forward: TraceCtx, change: _Change) -> tuple[TraceCtx, _Change]:
        """The forward (regions taken apart, ``change`` applied), fused again with the ops that the
        backward replays in regions of their own; and the change replaying those regions (and the
        replayed symbols left outside any), in forward order.

        A replay region also returns what the backward reads of it, so that the backward runs the very
        function the forward ran."""
        replayed = {o.name for b in change.replayed for o in tensor_outs(b)}

        def is_replayed(b: BoundSymbol) -> bool:
            return any(o.name in replayed for o in tensor_outs(b))

        def backward_reads(group: list[BoundSymbol]) -> list:
            # The backward's own reads, and those of replayed ops in other regions.
            inside = {id(b) for b in group}
            read = set(change.key) | {a.name for b in change.replayed if id(b) not in inside for a in tensor_args(b)}
            return [o for b in group if is_replayed(b) for o in tensor_outs(b) if o.name in read]

        grouped = self.fusion_pass(strip_deletions(forward), apart=is_replayed, keep_outputs=backward_reads)
        # Taken before the rest is lowered: lowering may drop a replayed view from the forward (a
        # ``shallow_copy`` becomes its input), which the backward still replays.
        replays = tuple(b for b in grouped.bound_symbols
                        if tensor_outs(b) and all(o.name in replayed for o in tensor_outs(b)))
        return self.lower_rest(grouped), dataclasses.replace(change, replayed=replays)

    def lower_rest(self, trace: TraceCtx) -> TraceCtx:
        """The claimed symbols a fusion pass left outside regions, given to the torch executor;
        deletions placed anew."""
        from thunder.executors.passes import _transform_for_operator_executor_execution
        from thunder.extend import get_always_executors

        lowered = _transform_for_operator_executor_execution(trace, get_always_executors())
        return replace_bound_symbols(lowered, lowered.bound_symbols, "thunder_memopt fusion: regions rebuilt")


def _kernels(group: Sequence[BoundSymbol]) -> int:
    """How many kernels the torch executor would run for ``group``: one per op that moves data
    (an op of the torch level is one ATen call, whatever prims it decomposes into)."""
    return sum(1 for b in group if moves_data(b))


def _op_name(op) -> str:
    return op if isinstance(op, str) else op.name


def _on_devices(devices: frozenset[str], *args, **kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, TensorProxy)]
    return bool(tensors) and all(t.device.type in devices for t in tensors)


def _grouped_apart(bsyms: Sequence[BoundSymbol], claimed: Sequence[bool],
                   apart: Callable[[BoundSymbol], bool] | None) -> list[BoundSymbol]:
    """``bsyms`` with each maximal run of claimed symbols reordered, dependencies kept, so that the
    symbols ``apart`` picks and the others stand in as few alternating groups as possible."""
    if apart is None:
        return list(bsyms)
    out: list[BoundSymbol] = []
    run: list[BoundSymbol] = []
    for b, c in zip(bsyms, claimed):
        if c:
            run.append(b)
            continue
        out.extend(_fewest_groups(run, [apart(r) for r in run]))
        run.clear()
        out.append(b)
    out.extend(_fewest_groups(run, [apart(r) for r in run]))
    return out


def _fewest_groups(run: Sequence[BoundSymbol], flags: Sequence[bool]) -> list[BoundSymbol]:
    """``run`` (in dependency order) ordered into groups of alternating flags: group k holds the
    symbols that k flag changes must precede. Each symbol goes to the latest group its readers in
    the run allow: a value made in an early group for a reader two groups on would be written out
    and read back, where in its reader's group it stays in registers. Both flags are tried first."""
    if not run:
        return []
    produced = {o.name: i for i, b in enumerate(run) for o in b.flat_proxy_outs if hasattr(o, "name")}
    preds = [{produced[a.name] for a in b.flat_proxy_args if getattr(a, "name", None) in produced} - {i}
             for i, b in enumerate(run)]
    readers: list[list[int]] = [[] for _ in run]
    for i, ps in enumerate(preds):
        for j in ps:
            readers[j].append(i)
    best: tuple[int, list[int]] | None = None
    for first in (flags[0], not flags[0]):
        def fits(k: int, i: int) -> bool:  # group k holds symbols of flag ``first`` when k is even
            return (k % 2 == 0) == (flags[i] == first)

        level = [0] * len(run)
        for i in range(len(run)):  # the earliest group after its inputs'
            k = max((level[j] for j in preds[i]), default=0)
            level[i] = k if fits(k, i) else k + 1
        last = max(level)
        for i in reversed(range(len(run))):  # then the latest before its readers'
            k = min((level[r] for r in readers[i]), default=last)
            level[i] = k if fits(k, i) else k - 1
        used = sorted(set(level))
        groups = 1 + sum(1 for a, b in zip(used, used[1:]) if (a - b) % 2)
        if best is None or groups < best[0]:
            best = (groups, level)
    level = best[1]
    return [run[i] for i in sorted(range(len(run)), key=lambda i: (level[i], i))]


def _add_outputs(region: Region, extra: Sequence[Proxy]) -> None:
    produced = {o.name for b in region.bound_symbols for o in b.flat_proxy_outs if hasattr(o, "name")}
    order = {o.name: i for i, b in enumerate(region.bound_symbols) for o in b.flat_proxy_outs if hasattr(o, "name")}
    outputs = {unvariableify(v).name: v for v in region.outputs}
    for p in extra:
        if p.name in produced:
            outputs.setdefault(p.name, variableify(p))
    region.outputs = utils.OrderedSet(sorted(outputs.values(), key=lambda v: order[unvariableify(v).name]))


def _outputs_like(outputs: tuple[TensorProxy, ...], *args) -> tuple[TensorProxy, ...]:
    """The fusion's meta, for checks that re-trace a trace (``check_trace``): fixed shapes."""
    return tuple(TensorProxy(like=o) if isinstance(o, TensorProxy) else o for o in outputs)


def _compiled(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> _CompiledRegion:
    key = (_canonical(region, inputs, outputs), tuple(_metadata(a) for a in inputs))
    fn = _compiled_functions.get(key)
    if fn is None:
        all_tensors = all(isinstance(p, TensorProxy) for p in inputs)
        fn = _compiled_functions[key] = _CompiledRegion(
            lambda: _region_trace(region, inputs, outputs).python_callable(include_decorators=False),
            [torch_metadata(p) for p in inputs] if all_tensors else None)
    return fn


TensorMetadata = tuple[tuple[int, ...], torch.dtype, torch.device]


def torch_metadata(t: TensorProxy | torch.Tensor) -> TensorMetadata:
    """Shape, torch dtype and torch device of a tensor or a tensor proxy."""
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype, t.device
    return tuple(t.shape), dtypes.to_torch_dtype(t.dtype), devices.to_torch_device(t.device)


def compiled_function(fn: Callable, constants: Mapping[str, Hashable],
                      tensor_inputs: Sequence[TensorMetadata]) -> _CompiledRegion:
    """``fn(*tensors, **constants)``, as a region compiled by inductor, for tensors of
    ``tensor_inputs``: one per function, constants and input metadata, shared like the regions'
    (and counted by ``compile_stats``). ``fn`` may update its tensors in place: it is functionalized
    before inductor sees it, which writes the updates into the inputs' memory."""
    key = (fn, tuple(sorted(constants.items())), tuple(tensor_inputs))
    compiled = _compiled_functions.get(key)
    if compiled is None:
        bound = functools.partial(fn, **constants)
        compiled = _compiled_functions[key] = _CompiledRegion(lambda: torch.func.functionalize(bound),
                                                              list(tensor_inputs))
    return compiled


def _metadata(p: Proxy) -> tuple:
    if isinstance(p, TensorProxy):
        return (tuple(p.shape), str(p.dtype), str(p.device))
    return (type(p).__name__,)


def _region_trace(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> TraceCtx:
    """A trace of the region alone, lowered to the torch executor, to compile. Thunder's
    ``torch_compile.make_compiled`` builds the same but compiles it itself, without a way to pass
    inductor options (EAGER_NUMERICS, NO_AUTOTUNING)."""
    from thunder.executors.passes import transform_for_execution

    trace = TraceCtx(None)
    trace.args = inputs
    trace.kwargs = {}
    trace.names = {a.name for a in inputs}
    with tracectx(trace):
        for a in inputs:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += [b.from_bsym() for b in region]
    trace.bound_symbols.append(prims.python_return.bind(outputs, output=None))
    for b in region:
        for o in (*b.flat_outs, *(o for s in b.subsymbols for o in s.flat_outs)):
            if o is not None and hasattr(o, "name"):
                trace.names.add(o.name)
    trace._siginfo = SigInfo("memopt_region")
    trace._siginfo.args = [(a.name, None) for a in inputs]
    return transform_for_execution(trace, executors_list=(pytorch_ex,))


def _canonical(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> tuple:
    """The region's ops and arguments, with proxies named by their order of appearance."""
    ids: dict[str, int] = {a.name: i for i, a in enumerate(inputs)}

    def leaf(x):
        if isinstance(x, ProxyInterface) and hasattr(x, "name"):
            return ("proxy", ids.setdefault(x.name, len(ids)))
        return repr(x)

    ops = []
    for b in region:
        flat_args, _ = tree_flatten((b.args, b.kwargs))
        flat_outs, _ = tree_flatten(b.output)
        ops.append((str(b.sym.id), tuple(map(leaf, flat_args)), tuple(map(leaf, flat_outs))))
    return tuple(ops), tuple(ids[o.name] for o in outputs)
