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

This module holds the executor, its regions' compiled functions and their cache (``compile_ahead``,
``compile_stats``, ``compiled_function``); ``fusion_regions`` what makes a region on the trace's side
(its symbols' order, its outputs, its trace and key), and ``inductor_compile`` the compilation by
inductor and the wait for its Triton kernels. Their names used elsewhere are importable from here.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from thunder.core import devices, dtypes, utils
from thunder.core.proxies import Proxy, TensorProxy, unvariableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.executors.torch_compile import TorchCompileExecutor
from thunder.executors.torchex import ex as pytorch_ex
from thunder.executors.torchex import no_autocast
from thunder.executors.utils import Region
from thunder.extend import ImplInfo

from thunder_memopt.core.memory import simulated_strides
from thunder_memopt.core.ops import fusible_name, leaf_names
from thunder_memopt.core.trace import SavedSetChange, replace_bound_symbols, strip_deletions, tensor_args, tensor_outs
from thunder_memopt.executors.fusion_regions import (
    _add_outputs,
    _canonical,
    _grouped_apart,
    _kernels,
    _metadata,
    _outputs_like,
    _region_trace,
)
from thunder_memopt.executors.inductor_compile import (
    EAGER_NUMERICS,
    NO_AUTOTUNING,
    _await_kernels,
    _fake_mode,
    _inductor_compiled,
    _kernels_deferred,
    _PendingKernels,
    start_compile_workers,
)

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
        """The trace with this executor's regions replaced by the symbols they hold, each value made
        once. Thunder's rematerialization copies a region's cheap producers into the regions that read
        them, under the same names (Gemma-2's position ids, once a causal mask no longer reads them):
        taken apart, a copy would be a second producer of a name, and regions rebuilt around the two
        would read the name from the one that keeps it internal. A copy computes what its first
        occurrence computed, from the same inputs, so only the first is kept."""
        out = from_trace(trace)
        made: set[str] = set()
        bsyms: list[BoundSymbol] = []
        for b in trace.bound_symbols:
            for s in b.subsymbols if self.is_own_fusion(b) else (b,):
                names = [o.name for o in s.flat_proxy_outs]
                if self.is_own_fusion(b) and names and made.issuperset(names):
                    continue
                made.update(names)
                bsyms.append(s)
        out.bound_symbols = bsyms
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


def _op_name(op) -> str:
    return op if isinstance(op, str) else op.name


def _on_devices(devices: frozenset[str], *args, **kwargs) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, TensorProxy)]
    return bool(tensors) and all(t.device.type in devices for t in tensors)


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
