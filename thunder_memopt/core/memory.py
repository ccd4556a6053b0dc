"""The memory model of a Thunder trace, shared by every pass and by the report.

Given an execution trace (the forward or backward trace of a ``thunder.jit`` function), this module
answers three questions with small dataclasses and pure functions, in the style of
``torch/_inductor/memory.py``:

* how many bytes each tensor proxy occupies, and which proxies share one storage (views);
* when each storage is born and when it dies, and so the estimated peak of live bytes and the bound
  symbol at which it occurs;
* what the forward saves for backward: each tensor with its shape, dtype, bytes, producing op and
  source line.

Storages, not proxies, are the unit of memory: a view keeps its base alive, and saving a slice of
``qkv`` costs the whole ``qkv``. Which ops return views is decided from the op names at every level of
a bound symbol (executor symbols keep the ``ltorch``/``prims`` decomposition as subsymbols), and
``reshape`` is a view only of a contiguous input, as in PyTorch.

The model is three modules: ``core/views.py`` (which tensors are views of which, and their
strides), ``core/storages.py`` (each tensor's bytes and storage, from what the model reads of each
bound symbol) and this one (each storage's lifetime, the estimated peaks, what a forward saves).
This one re-exports the other two's names: ``thunder_memopt.core.memory`` is the model's one import
path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from thunder.core import prims
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag

from thunder_memopt.core.storages import (
    HOST_MEMORY,
    WORKSPACE_BYTES,
    KnownStorages,
    SymbolFacts,
    TensorInfo,
    _Storages,
    _storages,
    _Symbol,
    storage_nbytes,
    storage_roots,
    tensor_nbytes,
)
from thunder_memopt.core.trace import (DELETION_NAMES, received_tensors, saved_proxies, source_of, trace_inputs,
                                      unmade_cotangents)
from thunder_memopt.core.views import OUTPUT_STRIDES, dense_strides_like, simulated_strides

# Names of the model that other modules import from here, though this module does not read them.
from thunder_memopt.core.views import Strides, _reshape_strides, contiguous_strides  # noqa: F401

__all__ = [
    "TensorInfo",
    "MemoryEstimate",
    "SavedTensor",
    "SavedInventory",
    "StepEstimate",
    "SymbolFacts",
    "tensor_nbytes",
    "HOST_MEMORY",
    "WORKSPACE_BYTES",
    "OUTPUT_STRIDES",
    "dense_strides_like",
    "storage_roots",
    "storage_nbytes",
    "simulated_strides",
    "estimate_memory",
    "StorageLifetimes",
    "storage_lifetimes",
    "estimate_from_lifetimes",
    "live_bytes",
    "saved_for_backward",
    "estimate_step",
    "backward_storages",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Live bytes over a trace, at bound-symbol granularity."""

    peak_bytes: int
    peak_index: int  # index into the bound symbols (-1: the inputs alone)
    peak_op: str | None
    peak_source: str | None
    live_bytes: tuple[int, ...]  # after each bound symbol, including its outputs (not its workspace)
    input_bytes: int  # bytes of the storages the trace receives
    output_bytes: int  # bytes of the storages alive at the return

    @property
    def transient_peak_bytes(self) -> int:
        """Peak above what the trace receives."""
        return self.peak_bytes - self.input_bytes


def _last_uses(symbols: Sequence[_Symbol], root: Mapping[str, str]) -> dict[str, int]:
    """Index of the last bound symbol that reads each storage (through any of its views)."""
    last: dict[str, int] = {}
    for i, symbol in enumerate(symbols):
        for name in symbol.reads:
            storage = root.get(name)
            if storage is not None:
                last[storage] = i
    return last


def estimate_memory(
    trace: TraceCtx,
    *,
    inputs_freed: bool | None = None,
    held: Iterable[str] = (),
    known_storages: KnownStorages | None = None,
    infos: Mapping[str, TensorInfo] | None = None,
    facts: SymbolFacts | None = None,
) -> MemoryEstimate:
    """Estimate the live bytes after every bound symbol of an execution trace.

    A storage is live from the symbol that creates it to its last reader. The trace's inputs are
    live from the start; they are freed after their last use only when ``inputs_freed`` (the
    default for backward traces, whose saved tensors are released as they are consumed), and
    otherwise held by the caller until the end; storages named in ``held`` (parameters, which the
    module keeps) are never freed. Anything the return statement reads stays live.
    ``known_storages`` gives inputs the storage the trace cannot see, as (the input that names it,
    its bytes): a backward receives saved views whose storages the forward allocated. ``infos``, the
    trace's ``storage_roots`` (over its symbols less deletions), if the caller has them already.
    ``facts``: see ``SymbolFacts``.
    """
    return estimate_from_lifetimes(_lifetimes(trace, inputs_freed, held, known_storages, infos, facts))


def estimate_from_lifetimes(lifetimes: StorageLifetimes) -> MemoryEstimate:
    """``estimate_memory`` of the trace whose ``storage_lifetimes`` these are: each storage's bytes
    summed over its span, and each symbol's workspace added while it runs."""
    n, storage_bytes = len(lifetimes.bsyms), lifetimes.nbytes
    input_bytes, live = live_bytes(n, ((first, last, storage_bytes[s]) for s, (first, last) in lifetimes.spans.items()))
    peak, peak_k = input_bytes, -1
    for k, (cur, workspace) in enumerate(zip(live, lifetimes.workspace)):
        # While it runs, an op may hold more than its outputs (WORKSPACE_BYTES).
        if cur + workspace > peak:
            peak, peak_k = cur + workspace, k
    peak_bsym = lifetimes.bsyms[peak_k] if peak_k >= 0 else None
    return MemoryEstimate(
        peak_bytes=peak,
        peak_index=peak_k,
        peak_op=None if peak_bsym is None else peak_bsym.sym.name,
        peak_source=None if peak_bsym is None else source_of(peak_bsym),
        live_bytes=tuple(live),
        input_bytes=input_bytes,
        output_bytes=sum(storage_bytes[s] for s in lifetimes.returned),
    )


def live_bytes(steps: int, spans: Iterable[tuple[int, int, int]]) -> tuple[int, list[int]]:
    """(bytes live before the first step, bytes live at each of ``steps`` steps) of storages, each
    given as (first, last, bytes): live at the steps first..last, first -1 for one live from the
    start, last ``steps`` for one live to the end. The one sum of the liveness model: the estimate
    adds it up over a trace's spans, the schedule pass over each order it prices."""
    delta = [0] * (steps + 1)  # delta[k]: bytes allocated at step k; frees land at k+1
    before = 0
    for first, last, nbytes in spans:
        if first < 0:
            before += nbytes
        else:
            delta[first] += nbytes
        if last < steps:
            delta[last + 1] -= nbytes
    live, cur = [], before
    for k in range(steps):
        cur += delta[k]
        live.append(cur)
    return before, live


@dataclass(frozen=True)
class StorageLifetimes:
    """When each storage of a trace is live: the one liveness model, which ``estimate_memory`` sums
    and which a caller reads to ask what is live where (the collectives pass's diagnostic)."""

    bsyms: tuple[BoundSymbol, ...]  # the trace's bound symbols without deletions, which ``spans`` index
    storage_of: Mapping[str, str]  # tensor -> the tensor that names its storage
    nbytes: Mapping[str, int]  # storage -> bytes
    # storage -> (first, last) index of the symbols it is live at: first -1 for a storage the trace
    # receives, last len(bsyms) for one live to the end (returned, held, or an input not freed).
    spans: Mapping[str, tuple[int, int]]
    input_storages: frozenset[str]
    returned: frozenset[str]
    workspace: tuple[int, ...]  # bytes each symbol of ``bsyms`` holds while it runs (WORKSPACE_BYTES)


def storage_lifetimes(
    trace: TraceCtx,
    *,
    inputs_freed: bool | None = None,
    held: Iterable[str] = (),
    known_storages: KnownStorages | None = None,
) -> StorageLifetimes:
    """Each storage's span of liveness over the trace, with ``estimate_memory``'s arguments and rules."""
    return _lifetimes(trace, inputs_freed, held, known_storages, None, None)


def _lifetimes(
    trace: TraceCtx,
    inputs_freed: bool | None,
    held: Iterable[str],
    known_storages: KnownStorages | None,
    infos: Mapping[str, TensorInfo] | None,
    facts: SymbolFacts | None,
) -> StorageLifetimes:
    """A storage is live from the symbol that creates it to its last reader (through any of its
    views), or to its creator if nothing reads it; see ``estimate_memory`` for inputs."""
    if inputs_freed is None:
        inputs_freed = TraceTag.BACKWARD in trace.tags
    facts = SymbolFacts() if facts is None else facts
    bsyms = [b for b in trace.bound_symbols if b.sym.name not in DELETION_NAMES]
    storages = _storages(trace, bsyms, known_storages, facts) if infos is None else _Storages.of(infos)
    root, made_at = storages.root, storages.made_at
    symbols = [facts.symbol(b) for b in bsyms]
    last = _last_uses(symbols, root)
    input_storages = frozenset(root[name] for name, index in made_at.items() if index is None)
    returned = frozenset(root[name] for name in symbols[-1].reads
                         if name in root) if bsyms and bsyms[-1].sym.id == prims.PrimIDs.RETURN else frozenset()
    n = len(bsyms)
    spans: dict[str, tuple[int, int]] = {}
    for name, storage in root.items():
        k = made_at[name]
        if k is not None and storage == name:
            spans[storage] = (k, n if storage in returned else last.get(storage, k))
    held = set(held)
    for s in input_storages:
        freed = inputs_freed and s not in returned and s not in held and s in last
        spans[s] = (-1, last[s] if freed else n)
    return StorageLifetimes(bsyms=tuple(bsyms), storage_of=root, nbytes=storages.storage_bytes(known_storages),
                            spans=spans, input_storages=input_storages, returned=returned,
                            workspace=tuple(symbol.workspace for symbol in symbols))


@dataclass(frozen=True)
class SavedTensor(TensorInfo):
    """A tensor the forward returns for backward: its ``TensorInfo``, the bytes of its storage, and
    whether that storage is a parameter's."""

    storage_nbytes: int
    is_parameter: bool


@dataclass(frozen=True)
class SavedInventory:
    """What a forward trace saves for backward."""

    tensors: tuple[SavedTensor, ...]

    @property
    def activation_bytes(self) -> int:
        """Saved bytes de-duplicated by storage, parameters excluded."""
        seen: dict[str, int] = {}
        for t in self.tensors:
            if not t.is_parameter:
                seen[t.storage] = t.storage_nbytes
        return sum(seen.values())

    @property
    def parameter_bytes(self) -> int:
        return sum({t.storage: t.storage_nbytes for t in self.tensors if t.is_parameter}.values())

    def by_source(self) -> list[tuple[str, str, int, int]]:
        """(producing op, source line, bytes, count) for activations, largest first, storages once."""
        groups: dict[tuple[str, str], list[int]] = {}
        seen: set[str] = set()
        for t in self.tensors:
            if t.is_parameter or t.storage in seen:
                continue
            seen.add(t.storage)
            key = (t.producer or "input", t.source or "?")
            g = groups.setdefault(key, [0, 0])
            g[0] += t.storage_nbytes
            g[1] += 1
        rows = [(op, src, b, c) for (op, src), (b, c) in groups.items()]
        return sorted(rows, key=lambda r: -r[2])


def is_parameter(t: TensorProxy, parameter_names: Iterable[str] | None = None) -> bool:
    """Module parameters and buffers are tagged STATIC_MEMORY_LOCATION by thunder.jit."""
    if parameter_names is not None and t.name in parameter_names:
        return True
    return ProxyTag.STATIC_MEMORY_LOCATION in t.tags


def saved_for_backward(
    forward_trace: TraceCtx,
    parameter_names: Iterable[str] | None = None,
    *,
    infos: Mapping[str, TensorInfo] | None = None,
) -> SavedInventory:
    """The saved-for-backward inventory of an augmented forward trace."""
    infos = storage_roots(forward_trace) if infos is None else infos
    inputs = {t.name: t for t in trace_inputs(forward_trace)}
    params = set(parameter_names or ())
    tensors, _ = saved_proxies(forward_trace)
    out = []
    for t in tensors:
        info = infos[t.name]
        root = infos[info.storage]
        base = inputs.get(info.storage)
        param = is_parameter(t, params) or (base is not None and is_parameter(base, params))
        out.append(SavedTensor(**vars(info), storage_nbytes=root.nbytes, is_parameter=param))
    return SavedInventory(tuple(out))


@dataclass(frozen=True)
class StepEstimate:
    """Forward then backward of one training step, activations only (parameters excluded)."""

    forward: MemoryEstimate
    backward: MemoryEstimate
    saved: SavedInventory
    peak_bytes: int
    peak_phase: str  # "forward" or "backward"


def estimate_step(
    forward_trace: TraceCtx,
    backward_trace: TraceCtx,
    *,
    forward_infos: Mapping[str, TensorInfo] | None = None,
    facts: SymbolFacts | None = None,
) -> StepEstimate:
    """Peak live activation bytes over forward + backward, excluding what the caller holds.

    Forward: live bytes above its inputs (parameters and batch). Backward: it receives the saved
    tensors and the output gradients and frees them as they are consumed; its peak counts the saved
    parameters' bytes only once (they are held by the module anyway), and the forward's outputs
    stay alive until the backward begins. ``forward_infos`` is the forward's ``storage_roots``, for
    a caller pricing forwards that differ only in what they save (the ladder's rungs); ``facts``,
    see ``SymbolFacts``.
    """
    facts = SymbolFacts() if facts is None else facts
    fw = estimate_memory(forward_trace, inputs_freed=False, infos=forward_infos, facts=facts)
    saved = saved_for_backward(forward_trace, infos=forward_infos)
    storages = _saved_storages(saved, backward_trace)
    params = {storages[t.name][0] for t in saved.tensors if t.is_parameter and t.name in storages}
    bw = estimate_memory(backward_trace, inputs_freed=True, held=params, known_storages=storages, facts=facts)
    fw_peak = fw.peak_bytes - fw.input_bytes
    # The backward's inputs include saved parameters, which are not the step's allocation.
    bw_peak = bw.peak_bytes - saved.parameter_bytes
    if bw_peak > fw_peak:
        return StepEstimate(fw, bw, saved, bw_peak, "backward")
    return StepEstimate(fw, bw, saved, fw_peak, "forward")


def backward_storages(forward_trace: TraceCtx, backward_trace: TraceCtx) -> KnownStorages:
    """For ``estimate_memory(backward_trace, known_storages=...)``: the forward storage of each
    saved tensor the backward receives (see ``_saved_storages``)."""
    return _saved_storages(saved_for_backward(forward_trace), backward_trace)


def _saved_storages(saved: SavedInventory, backward_trace: TraceCtx) -> dict[str, tuple[str, int]]:
    """The forward storage of each saved tensor the backward receives, named by one of the saved
    tensors in it, with its bytes: a saved slice keeps its whole base alive, a saved expand only
    the small tensor it expands, and a tensor saved with its view is one storage. A gradient of the
    model's logits that is not made where the caller left them unused (``unmade_cotangents``) has
    no bytes."""
    received = {t.name for t in received_tensors(backward_trace)}
    named_by = {t.storage: t.storage for t in saved.tensors if t.storage in received}
    storages = {t.name: (t.name, 0) for t in unmade_cotangents(backward_trace).values()}
    for t in saved.tensors:
        if t.name in received:
            storages[t.name] = (named_by.setdefault(t.storage, t.name), t.storage_nbytes)
    return storages
