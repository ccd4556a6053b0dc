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
"""

from __future__ import annotations

import math

from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from thunder.core import prims
from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag
from thunder.executors.torch_compile import TorchCompileExecutor

from thunder_memopt.core.trace import (
    DELETION_NAMES,
    is_bookkeeping,
    received_tensors,
    saved_proxies,
    source_of,
    tensor_args,
    tensor_outs,
    trace_inputs,
)

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


# In-place ops return (an alias of) the argument at this position.
_INPLACE_TARGET = {"copy_": 1}
# Leaf ops that return a view of their first argument, by symbol id: a torch-level op of a prim's
# name (``torch.transpose(t, 1, 2)``) has another signature, and is read through its decomposition.
# Strides are simulated through them, so that ``reshape`` counts as a view exactly when PyTorch can
# make it one (torch's computeStride).
_VIEW_PRIM_IDS = {
    prims.PrimIDs.BROADCAST_IN_DIM: "broadcast_in_dim",
    prims.PrimIDs.TRANSPOSE: "transpose",
    prims.PrimIDs.SLICE: "slice",
    prims.PrimIDs.SQUEEZE: "squeeze",
    prims.PrimIDs.RESHAPE: "reshape",
    prims.PrimIDs.SHALLOW_COPY: "shallow_copy",
}
# The torch executor's symbols that implement a view prim with the prim's own signature (its other
# view prims become torch ops, read through their decomposition); distributed ``wait``.
_VIEW_PRIM_IMPLS = {
    "torch_slice_prim_impl": "slice",
    "torch_prims_reshape_impl": "reshape",
    "shallow_copy": "shallow_copy",
    "torch_wait_prim_impl": "wait",
    "wait": "wait",
    "memopt_wait_reload": "wait",  # offload: the reloaded tensor itself, once its copy is waited for
}
Strides = tuple[int, ...]
# Copies whose output has its input's strides: offload's host copy and its reload.
_STRIDED_COPIES = {"memopt_offload", "memopt_reload"}


# A proxy of a tensor in host memory (a saved tensor offloaded): it takes no device bytes.
ProxyTag.register_tag("MEMOPT_HOST_MEMORY")
HOST_MEMORY = ProxyTag.MEMOPT_HOST_MEMORY


def tensor_nbytes(t: TensorProxy) -> int:
    """Device bytes of a tensor proxy: numel times the dtype's width, none for one in host memory."""
    if HOST_MEMORY in t.tags:
        return 0
    # The proxy's own field: ``t.numel`` goes through TensorProxy.__getattr__, a tenth of the
    # memory model's time on long traces.
    numel = t._numel if isinstance(t._numel, int) else t.numel
    return int(numel) * int(t.dtype.bytes)


def contiguous_strides(shape: Sequence[int]) -> Strides:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(strides))


def dense_strides_like(shape: Sequence[int], like: Strides) -> Strides:
    """Dense strides for ``shape`` whose dimensions are ordered in memory as ``like``'s: largest
    stride outermost, ties by dimension (ATen's ``alloc_with_matching_layout``)."""
    order = sorted(range(len(shape)), key=lambda d: -like[d])
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(strides)


def _reshape_strides(old_shape: Sequence[int], old_strides: Strides, new_shape: Sequence[int]) -> Strides | None:
    """PyTorch's computeStride: the strides of a reshape that is a view, or None if it copies."""
    if math.prod(old_shape) == 0 or not old_shape:
        return contiguous_strides(new_shape)
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base_stride = old_strides[-1]
    tensor_numel, view_numel = 1, 1
    for tensor_d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[tensor_d]
        if tensor_d == 0 or (
            old_shape[tensor_d - 1] != 1 and old_strides[tensor_d - 1] != tensor_numel * chunk_base_stride
        ):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base_stride
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = old_strides[tensor_d - 1]
                tensor_numel, view_numel = 1, 1
    return tuple(new_strides) if view_d == -1 else None


def _view_prim(bsym: BoundSymbol) -> str | None:
    """The view prim a bound symbol is, with the prim's signature, or None."""
    return _VIEW_PRIM_IDS.get(bsym.sym.id) or _VIEW_PRIM_IMPLS.get(bsym.sym.name)


def _may_be_view(bsym: BoundSymbol) -> bool:
    """Whether the bound symbol is a view prim, or every leaf of its decomposition is one: otherwise
    ``view_strides`` is None whatever the strides, and most symbols are told apart here, cheaply."""
    if _view_prim(bsym) is not None:
        return True
    return bool(bsym.subsymbols) and all(_may_be_view(sub) for sub in bsym.subsymbols)


def _leaf_view_strides(name: str, bsym: BoundSymbol, inp: TensorProxy, in_strides: Strides, out: TensorProxy) -> Strides | None:
    shape = tuple(int(s) for s in inp.shape)
    if name in {"shallow_copy", "wait"}:
        return in_strides
    if name == "broadcast_in_dim":
        out_shape, bdims = bsym.args[1], bsym.args[2]
        strides = [0] * len(out_shape)
        for j, d in enumerate(bdims):
            strides[d] = in_strides[j] if shape[j] == out_shape[d] else 0
        return tuple(strides)
    if name == "transpose":
        return tuple(in_strides[d] for d in bsym.args[1])
    if name == "slice":
        steps = bsym.args[3] if len(bsym.args) > 3 and bsym.args[3] is not None else [1] * len(shape)
        return tuple(s * st for s, st in zip(in_strides, steps))
    if name == "squeeze":
        dims = {d % len(shape) for d in bsym.args[1]}
        return tuple(s for d, s in enumerate(in_strides) if d not in dims)
    if name == "reshape":
        return _reshape_strides(shape, in_strides, tuple(int(s) for s in out.shape))
    return None


def view_strides(bsym: BoundSymbol, strides: Mapping[str, Strides]) -> dict[str, Strides] | None:
    """The outputs' strides if the bound symbol returns views of its first tensor argument, else None.

    Executor symbols (``Tensor.expand``, ``torch.unsqueeze``) keep their ltorch/prims decomposition
    as subsymbols; such a symbol is a view when every step of its decomposition is one.
    """
    if not _may_be_view(bsym):
        return None  # most symbols, so before reading any argument
    prim = _view_prim(bsym)
    args, outs = tensor_args(bsym), tensor_outs(bsym)
    if not args or not outs or args[0].name not in strides:
        return None
    if prim is not None:
        s = _leaf_view_strides(prim, bsym, args[0], strides[args[0].name], outs[0])
        return None if s is None else {outs[0].name: s}
    # A ChainMap layer, not a copy: copying the whole map per composite op is quadratic.
    local = ChainMap({}, strides)
    for sub in bsym.subsymbols:
        sub_strides = view_strides(sub, local)
        if sub_strides is None:
            return None
        local.maps[0].update(sub_strides)
    if not all(o.name in local for o in outs):
        return None
    return {o.name: local[o.name] for o in outs}


def _torch_compile_region(bsym: BoundSymbol) -> bool:
    """A region that Thunder runs through torch.compile, whose AOTAutograd returns an output that
    aliases another output, or an input, as a view of it."""
    return isinstance(getattr(bsym.sym, "executor", None), TorchCompileExecutor)


def region_output_views(bsym: BoundSymbol, strides: Mapping[str, Strides]) -> dict[str, tuple[str, Strides]]:
    """For a torch.compile region: each output that is a view of one of the region's arguments or of
    another of its outputs, with that base's name and the view's strides, from the region's
    decomposition (the cross-entropy region returns the logits' gradient and a reshape of it)."""
    local, base_of = _region_strides(bsym, strides)
    outs = tensor_outs(bsym)
    handles = {a.name for a in tensor_args(bsym)} | {o.name for o in outs}
    return {o.name: (base_of[o.name], local[o.name]) for o in outs
            if base_of.get(o.name, o.name) != o.name and base_of[o.name] in handles}


def _region_strides(bsym: BoundSymbol, strides: Mapping[str, Strides]) -> tuple[Mapping[str, Strides], dict[str, str]]:
    """The strides of every tensor a region's decomposition makes, and each one's base (itself if
    it is not a view): compiled code returns eager's strides, a view of an internal tensor included
    (a broadcast mask, stride 0 where it is expanded)."""
    local = ChainMap({}, strides)
    base_of = {a.name: a.name for a in tensor_args(bsym)}
    for sub in bsym.subsymbols:
        if sub.sym.name in _INPLACE_TARGET:  # a donated buffer (passes/donate.py): its target's memory
            target = sub.flat_proxy_args[_INPLACE_TARGET[sub.sym.name]]
            for o in tensor_outs(sub):
                local.maps[0][o.name] = local.get(target.name, contiguous_strides(target.shape))
                base_of[o.name] = base_of.get(target.name, target.name)
            continue
        views = view_strides(sub, local)
        sub_args = tensor_args(sub)
        for o in tensor_outs(sub):
            if views is not None and o.name in views:
                local.maps[0][o.name] = views[o.name]
                base_of[o.name] = base_of.get(sub_args[0].name, sub_args[0].name)
            else:
                local.maps[0][o.name] = contiguous_strides(o.shape)
                base_of[o.name] = o.name
    return local, base_of


def simulated_strides(trace: TraceCtx, received: Mapping[str, Strides] | None = None) -> dict[str, Strides]:
    """Each tensor's strides as the model simulates them to tell views: a view's follow its base's
    (a reshape's where PyTorch can view, an expand's, a transpose's), a region's outputs are as its
    decomposition makes them, offload's copies keep their source's, an op in ``OUTPUT_STRIDES``
    says, and what any other op allocates is contiguous. What the trace receives is contiguous
    unless ``received`` gives its strides (a backward's saved tensors, its forward's).
    Not what the estimate reads: there, an output of a region is its own storage unless it views an
    argument or another output."""
    bsyms = [b for b in trace.bound_symbols if b.sym.name not in DELETION_NAMES]
    received = received or {}
    strides = {t.name: received.get(t.name, contiguous_strides(t.shape)) for t in received_tensors(trace, bsyms)}
    for bsym in bsyms:
        kind = _symbol_facts(bsym).kind
        outs = tensor_outs(bsym)
        if kind is _Kind.REGION:
            local, _ = _region_strides(bsym, strides)
            made = {o.name: local[o.name] for o in outs}
        elif kind in (_Kind.ALIASES, _Kind.INPLACE):
            args = tensor_args(bsym)
            # update_aliases: each output is its input; an in-place op's outputs are its target.
            if kind is _Kind.INPLACE:
                bases = [bsym.flat_proxy_args[_INPLACE_TARGET[bsym.sym.name]]] * len(outs)
            else:
                bases = args
            made = {o.name: strides.get(base.name, contiguous_strides(o.shape)) for base, o in zip(bases, outs)}
        elif bsym.sym.name in _STRIDED_COPIES:
            made = {outs[0].name: strides[tensor_args(bsym)[0].name]}
        elif bsym.sym.name in OUTPUT_STRIDES:
            made = OUTPUT_STRIDES[bsym.sym.name](bsym, strides)
        else:
            made = (view_strides(bsym, strides) if kind is _Kind.VIEW else None) or {}
        for o in outs:
            strides.setdefault(o.name, made.get(o.name, contiguous_strides(o.shape)))
    return strides


@dataclass(frozen=True)
class TensorInfo:
    """One tensor proxy: its bytes and the storage it lives in."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    storage: str  # name of the proxy that allocated the storage
    producer: str | None  # op name of the producing bound symbol, None for trace inputs
    producer_index: int | None
    source: str | None  # "file:line" of the user code that produced it


KnownStorages = Mapping[str, tuple[str, int]]  # input name -> (the input naming its storage, storage bytes)


class _Kind(Enum):
    """How ``storage_roots`` reads a bound symbol's outputs."""

    SKIPPED = "unpacking, return or deletion"
    ALIASES = "update_aliases: each output is its input, renamed"
    INPLACE = "an in-place op: its outputs alias its target"
    REGION = "a torch.compile region, whose outputs may alias its arguments or one another"
    VIEW = "a symbol that may return views of its first argument"
    NEW = "a symbol whose outputs are new storages"


@dataclass(frozen=True)
class _Symbol:
    """What the memory model reads of one bound symbol, wherever it stands in a trace."""

    bsym: BoundSymbol  # held, so that its id, the cache's key, stays its own
    kind: _Kind
    args: tuple[TensorProxy, ...]
    outs: tuple[TensorProxy, ...]
    reads: tuple[str, ...]  # the names of the proxies it reads (none for a deletion)
    producer: str
    source: str | None
    lookups: tuple[str, ...]  # VIEW: every tensor its decomposition names, whose strides it may read
    views: dict[tuple, dict[str, Strides] | None]  # VIEW: view_strides by the strides of ``lookups``
    workspace: int  # WORKSPACE_BYTES


class SymbolFacts:
    """What the memory model reads of bound symbols and tensor proxies that does not depend on where
    they stand in a trace: their kind, names, bytes, shapes and, for a view, the strides it returns
    for given input strides.

    Each function of the model that takes one (``storage_roots``, ``estimate_memory``,
    ``estimate_step``) works out these facts as it meets each symbol; a caller pricing many traces
    made of the same symbols (the recompute ladder's rungs: one forward and one backward, with
    other saved sets and replays) passes one instance to every call and so reads each symbol once.
    It keeps the symbols it has seen alive, and should live no longer than that work.
    """

    def __init__(self) -> None:
        self._symbols: dict[int, _Symbol] = {}
        self._tensors: dict[str, tuple[tuple[int, ...], str, int, Strides]] = {}

    def symbol(self, bsym: BoundSymbol) -> _Symbol:
        facts = self._symbols.get(id(bsym))
        if facts is None:
            facts = self._symbols[id(bsym)] = _symbol_facts(bsym)
        return facts

    def tensor(self, t: TensorProxy) -> tuple[tuple[int, ...], str, int, Strides]:
        """(shape, dtype, bytes, contiguous strides) of a tensor, by name."""
        facts = self._tensors.get(t.name)
        if facts is None:
            shape = tuple(int(s) for s in t.shape)
            facts = self._tensors[t.name] = (shape, str(t.dtype), tensor_nbytes(t), contiguous_strides(shape))
        return facts

    def named(self, name: str) -> tuple[tuple[int, ...], str, int, Strides]:
        """``tensor`` of a tensor met already, by its name."""
        return self._tensors[name]

    def view_strides(self, symbol: _Symbol, strides: Mapping[str, Strides]) -> dict[str, Strides] | None:
        """``view_strides(symbol.bsym, strides)``, computed once for each strides it may read."""
        key = tuple(strides.get(name) for name in symbol.lookups)
        if key not in symbol.views:
            symbol.views[key] = view_strides(symbol.bsym, strides)
        return symbol.views[key]


def _symbol_facts(bsym: BoundSymbol) -> _Symbol:
    name = bsym.sym.name
    if is_bookkeeping(bsym):
        kind = _Kind.SKIPPED
    elif name == "update_aliases":
        kind = _Kind.ALIASES
    elif name in _INPLACE_TARGET:
        kind = _Kind.INPLACE
    elif bsym.subsymbols and _torch_compile_region(bsym):
        kind = _Kind.REGION
    elif _may_be_view(bsym):
        kind = _Kind.VIEW
    else:
        kind = _Kind.NEW
    reads = () if name in DELETION_NAMES else tuple(
        p.name for p in bsym.flat_proxy_args if getattr(p, "name", None) is not None)
    return _Symbol(
        bsym=bsym,
        kind=kind,
        args=tuple(tensor_args(bsym)),
        outs=tuple(tensor_outs(bsym)),
        reads=reads,
        producer=name,
        source=source_of(bsym),
        lookups=tuple(dict.fromkeys(_decomposition_tensors(bsym))) if kind is _Kind.VIEW else (),
        views={},
        workspace=_workspace_bytes(bsym),
    )


def _decomposition_tensors(bsym: BoundSymbol) -> Iterator[str]:
    """The names of the tensors a bound symbol and every level of its decomposition read or return."""
    for t in (*tensor_args(bsym), *tensor_outs(bsym)):
        yield t.name
    for sub in bsym.subsymbols:
        yield from _decomposition_tensors(sub)


def storage_roots(
    trace: TraceCtx,
    bsyms: Sequence[BoundSymbol] | None = None,
    known_storages: KnownStorages | None = None,
    *,
    facts: SymbolFacts | None = None,
) -> dict[str, TensorInfo]:
    """Every tensor proxy of the trace, keyed by name, with the storage it lives in.

    ``bsyms`` replaces the trace's bound symbols (indices then refer to it). ``known_storages``
    gives an input (or a saved tensor a backward unpacks) the storage it shares with another input,
    which the trace cannot see: a forward that saves a tensor and a view of it hands the backward both.
    ``facts``: see ``SymbolFacts``.
    """
    bsyms = trace.bound_symbols if bsyms is None else bsyms
    facts = SymbolFacts() if facts is None else facts
    storages = _storages(trace, bsyms, known_storages, facts)
    infos: dict[str, TensorInfo] = {}
    for name, storage in storages.root.items():
        shape, dtype, nbytes, _ = facts.named(name)
        index = storages.made_at[name]
        producer = None if index is None else facts.symbol(bsyms[index])
        infos[name] = TensorInfo(
            name=name,
            shape=shape,
            dtype=dtype,
            nbytes=nbytes,
            storage=storage,
            producer=None if producer is None else producer.producer,
            producer_index=index,
            source=None if producer is None else producer.source,
        )
    return infos


@dataclass(frozen=True)
class _Storages:
    """``storage_roots`` as maps of names, all that ``estimate_memory`` reads of it: pricing a
    ladder's rungs would otherwise build a TensorInfo for every tensor of every rung."""

    root: dict[str, str]  # tensor -> the tensor that names its storage
    made_at: dict[str, int | None]  # tensor -> index of the bound symbol that made it (None: received)
    nbytes: dict[str, int]  # tensor -> its bytes

    @classmethod
    def of(cls, infos: Mapping[str, TensorInfo]) -> _Storages:
        return cls(
            root={name: i.storage for name, i in infos.items()},
            made_at={name: i.producer_index for name, i in infos.items()},
            nbytes={name: i.nbytes for name, i in infos.items()},
        )

    def storage_bytes(self, known_storages: KnownStorages | None) -> dict[str, int]:
        """``storage_nbytes``."""
        nbytes = {root: self.nbytes[root] for root in self.root.values()}
        nbytes.update((known_storages or {}).values())
        return nbytes


def _storages(
    trace: TraceCtx, bsyms: Sequence[BoundSymbol], known_storages: KnownStorages | None, facts: SymbolFacts
) -> _Storages:
    """``storage_roots``' walk."""
    known_storages = known_storages or {}
    root: dict[str, str] = {}
    made_at: dict[str, int | None] = {}
    nbytes: dict[str, int] = {}
    strides: dict[str, Strides] = {}

    def add(t: TensorProxy, storage: str, index: int | None) -> None:
        if t.name in root:
            return
        _, _, size, contiguous = facts.tensor(t)
        root[t.name], made_at[t.name], nbytes[t.name] = storage, index, size
        strides.setdefault(t.name, contiguous)

    for t in received_tensors(trace, bsyms):
        add(t, known_storages[t.name][0] if t.name in known_storages else t.name, None)
    for i, bsym in enumerate(bsyms):
        symbol = facts.symbol(bsym)
        kind = symbol.kind
        if kind is _Kind.SKIPPED:
            continue
        if kind is _Kind.ALIASES:
            for a, o in zip(symbol.args, symbol.outs):
                add(o, root.get(a.name, a.name), i)
            continue
        if kind is _Kind.INPLACE:
            base = bsym.flat_proxy_args[_INPLACE_TARGET[bsym.sym.name]]
            for o in symbol.outs:
                add(o, root.get(base.name, base.name), i)
            continue
        if kind is _Kind.REGION:
            region_views = region_output_views(bsym, strides)
            for o in symbol.outs:
                base, view = region_views.get(o.name, (o.name, None))
                if view is not None:
                    strides[o.name] = view
                add(o, root.get(base, base), i)
            continue
        views = facts.view_strides(symbol, strides) if kind is _Kind.VIEW else None
        base = symbol.args[0] if views else None
        for o in symbol.outs:
            if views is not None and o.name in views and base.name in root:
                strides[o.name] = views[o.name]
                add(o, root[base.name], i)
            else:
                add(o, o.name, i)
    return _Storages(root=root, made_at=made_at, nbytes=nbytes)


def storage_nbytes(infos: Mapping[str, TensorInfo], known_storages: KnownStorages | None = None) -> dict[str, int]:
    """The bytes of each storage of ``storage_roots``: its root tensor's, or for a storage the trace
    receives and cannot see whole (a saved slice's base), the bytes ``known_storages`` gives."""
    return _Storages.of(infos).storage_bytes(known_storages)


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


# Symbol name -> the bytes an op of it holds while it runs, beyond its inputs and outputs. Ops whose
# kernels allocate what the trace cannot see register here (the fused loss head's chunks).
WORKSPACE_BYTES: dict[str, Callable[[BoundSymbol], int]] = {}


# Symbol name -> the strides of an op's outputs (by name), from the bound symbol and its inputs'
# strides, for ops whose kernels allocate outputs in another layout than contiguous (cuDNN attention's
# follow its inputs'). Fusion regions compiled ahead are compiled for these strides.
OUTPUT_STRIDES: dict[str, Callable[[BoundSymbol, Mapping[str, Strides]], dict[str, Strides]]] = {}


def _workspace_bytes(bsym: BoundSymbol) -> int:
    workspace = WORKSPACE_BYTES.get(bsym.sym.name)
    return 0 if workspace is None else workspace(bsym)


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
    the small tensor it expands, and a tensor saved with its view is one storage."""
    received = {t.name for t in received_tensors(backward_trace)}
    named_by = {t.storage: t.storage for t in saved.tensors if t.storage in received}
    storages = {}
    for t in saved.tensors:
        if t.name in received:
            storages[t.name] = (named_by.setdefault(t.storage, t.name), t.storage_nbytes)
    return storages
