"""Tensor bytes and storages: how many device bytes each tensor proxy of a trace occupies, and which
storage it lives in (``storage_roots``), from what the memory model reads of each bound symbol
(``SymbolFacts``).

Storages, not proxies, are the unit of memory: saving a slice of ``qkv`` costs the whole ``qkv``.
Whether an output is a storage of its own or a view of an input is ``core/views.py``'s to say; when
each storage is live, and so a trace's peak, is ``core/memory.py``'s, which re-exports the names here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from thunder.core.proxies import ProxyTag, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

from thunder_memopt.core.trace import DELETION_NAMES, received_tensors, source_of, tensor_args, tensor_outs
from thunder_memopt.core.views import (
    _INPLACE_TARGET,
    Strides,
    _Kind,
    _kind_of,
    contiguous_strides,
    region_output_views,
    view_strides,
)

__all__ = [
    "HOST_MEMORY",
    "WORKSPACE_BYTES",
    "TensorInfo",
    "KnownStorages",
    "SymbolFacts",
    "tensor_nbytes",
    "storage_roots",
    "storage_nbytes",
]


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


# Symbol name -> the bytes an op of it holds while it runs, beyond its inputs and outputs. Ops whose
# kernels allocate what the trace cannot see register here (the fused loss head's chunks).
WORKSPACE_BYTES: dict[str, Callable[[BoundSymbol], int]] = {}


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
    kind = _kind_of(bsym)
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


def _workspace_bytes(bsym: BoundSymbol) -> int:
    workspace = WORKSPACE_BYTES.get(bsym.sym.name)
    return 0 if workspace is None else workspace(bsym)


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
