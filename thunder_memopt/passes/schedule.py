"""Schedule: reorder the bound symbols of a trace so that fewer bytes are alive at its peak.

Thunder runs bound symbols in trace order, and that order comes from tracing, not from memory. In a
parallel-residual block the MLP's 4h intermediates are alive on top of everything the attention
branch has just saved; in a backward, a gradient can be allocated while a saved tensor whose last
reader could already have run waits. Recompute decides what is saved; this pass decides when each
tensor is born and when it dies.

The pass works on an executed forward, backward or inference trace, in the style of
``torch/_inductor/memory.py``:

1. strip ``del`` and ``clear_mutable_collection`` and build the dependency graph of the remaining
   bound symbols: data flow, plus ordering constraints for in-place writes (every access to a
   storage, through any of its views, keeps its place relative to each write to it), for side
   effects (random ops, RNG state, prints, in-place ops keep their relative order, so numerics stay
   bit-identical), for collectives (fixed points: the collectives pass placed them for overlap and
   for memory, and no op crosses one) and for unpacking (first) and the return (last);
2. price an order with the shared memory model (``thunder_memopt.core.memory``: storages, not proxies;
   a view keeps its base alive; in a backward, the saved tensors live in the forward's storages,
   so a tensor saved with its view is freed once both are read): each storage's span in the
   order, over integer ids, summed by ``memory.live_bytes`` as the estimate sums a trace's, so
   that one order costs O(n);
3. take the best of a few whole-trace orders, the input order and inductor's DFS (its LPMF and BFS
   only ever raised the peak on these traces), then improve it by a peak-directed local search:
   at the peak, postpone a whole independent branch that allocated a live tensor past the peak, or
   advance the last reader of a live tensor, with its not yet run ancestors, before it. Only the
   moved span is re-priced, so one move costs O(span), not O(n). This is what inductor's greedy
   sorts cannot do: they decide one node at a time, and the payoff of running a branch first (its
   4h intermediates die before the other branch's saved tensors are born) only shows a branch later;
4. keep the input order unless the estimated peak falls, then re-insert the deletions with
   ``del_last_used`` (``memory.replace_bound_symbols``).

The order is chosen for the memory as it really is: in a backward, the parameters it receives are
held by the module, so "freeing" one by running its last reader early gains nothing. The result
must also not raise ``memory.estimate_memory``'s peak, which frees them; ``ScheduleResult`` reports
that estimate before and after, and where the new peak sits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from thunder.core import prims
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag

from thunder_memopt.core.memory import (
    KnownStorages,
    TensorInfo,
    is_parameter,
    live_bytes,
    storage_nbytes,
    storage_roots,
)
from thunder_memopt.core.ops import SIDE_EFFECT_NAMES, is_collective, is_random, normalized, symbols
from thunder_memopt.core.trace import (
    is_bookkeeping,
    replace_bound_symbols,
    source_of,
    strip_deletions,
    tensor_args,
    tensor_outs,
)

__all__ = [
    "ScheduleGraph",
    "ScheduleResult",
    "build_graph",
    "simulate",
    "has_side_effects",
    "is_collective",
    "schedule_trace",
]

Order = list[int]

# Collectives (thunder_memopt.core.ops) are fixed points: the collectives pass placed them (just-in-time
# gathers, early reduce-scatters), so no op crosses one, and the schedule reorders between them.
_SIDE_EFFECT_TAGS = {
    prims.OpTags.RANDOM_OP,
    prims.OpTags.DONT_DCE,
    prims.OpTags.IN_PLACE,
    prims.OpTags.DEVICE_SYNC_OP,
    prims.OpTags.CTX_MANAGER_ENTER_EXIT_OP,
}
# In-place ops and the one argument each writes, by name: executors rebind prims under string ids.
_WRITE_TARGET = {"copy_": 1, "copy_with_setitem": 0}
# Thunder's fence after an in-place op: its outputs alias its inputs, and it is ordered as a write.
_UPDATE_ALIASES = "update_aliases"

# Local search: how far from the peak to look for a branch to move, how many candidates each way,
# and how many span positions to price in all, which bounds the pass's time on long traces (a
# 32-layer trace takes about ten moves and prices about 15k).
_SEARCH_SPAN = 800
_CANDIDATES = 24
_PRICING_BUDGET = 2_000_000


def has_side_effects(bsym: BoundSymbol) -> bool:
    """Random, RNG-state, collective, in-place, sync or printing ops, at any level of a bound symbol."""
    if is_random(bsym) or is_collective(bsym):
        return True
    for sym in symbols(bsym):
        if normalized(sym.name) in SIDE_EFFECT_NAMES:
            return True
        if sym.tags and _SIDE_EFFECT_TAGS.intersection(sym.tags):
            return True
    # A symbol that returns nothing is only run for its effect.
    return not bsym.flat_proxy_outs and bsym.output is None


def _writes_every_arg(bsym: BoundSymbol) -> bool:
    """In-place ops whose written argument is not known precisely: all their arguments count as written."""
    for sym in symbols(bsym):
        if sym.name in _WRITE_TARGET or sym.name == _UPDATE_ALIASES:
            return True
        if sym.tags and prims.OpTags.IN_PLACE in sym.tags:
            return True
        if sym.name.endswith("_") and not sym.name.endswith("__"):
            return True
    return False


@dataclass(frozen=True)
class ScheduleGraph:
    """The reorderable bound symbols of a trace (nodes, by index) and the storages they touch."""

    head: tuple[BoundSymbol, ...]  # leading unpacking: stays first
    nodes: tuple[BoundSymbol, ...]  # in input order, which is topological
    tail: tuple[BoundSymbol, ...]  # the return: stays last
    preds: tuple[tuple[int, ...], ...]
    succs: tuple[tuple[int, ...], ...]
    alloc: tuple[int, ...]  # bytes of the storages each node creates
    creates: tuple[tuple[int, ...], ...]  # storage ids
    reads: tuple[tuple[int, ...], ...]  # storage ids, each once
    storage_bytes: tuple[int, ...]
    readers: tuple[tuple[int, ...], ...]  # nodes reading each storage
    held: tuple[bool, ...]  # never freed: returned, the caller's inputs, the module's parameters
    estimate_held: tuple[bool, ...]  # never freed in memory.estimate_memory's model
    input_bytes: int


def _split(bsyms: Sequence[BoundSymbol]):
    """(leading unpacking, the bound symbols that may move, the return)."""
    first = 0
    while first < len(bsyms) and is_bookkeeping(bsyms[first]) and bsyms[first].sym.id != prims.PrimIDs.RETURN:
        first += 1
    last = len(bsyms)
    if last > first and bsyms[-1].sym.id == prims.PrimIDs.RETURN:
        last -= 1
    return tuple(bsyms[:first]), tuple(bsyms[first:last]), tuple(bsyms[last:])


class _Storages:
    """Integer ids for the storages of a trace, and alias classes for write ordering."""

    def __init__(self, infos: dict[str, TensorInfo], storage_bytes: Mapping[str, int]) -> None:
        self.infos = infos
        self.storage_bytes = storage_bytes
        self.ids: dict[str, int] = {}
        self.nbytes: list[int] = []
        self.parent: list[int] = []

    def of(self, name: str) -> int:
        root = self.infos[name].storage
        sid = self.ids.get(root)
        if sid is None:
            sid = self.ids[root] = len(self.nbytes)
            self.nbytes.append(self.storage_bytes[root])
            self.parent.append(sid)
        return sid

    def alias_class(self, sid: int) -> int:
        while self.parent[sid] != sid:
            self.parent[sid] = sid = self.parent[self.parent[sid]]
        return sid

    def merge(self, a: int, b: int) -> None:
        self.parent[self.alias_class(b)] = self.alias_class(a)


def _data_and_effect_edges(nodes: Sequence[BoundSymbol], preds: list[set[int]]) -> None:
    """Data flow, side effects in their input order, and collectives as fixed points."""
    producer: dict[str, int] = {}
    last_effect = last_collective = None
    since_collective: list[int] = []
    for v, bsym in enumerate(nodes):
        for p in bsym.flat_proxy_args:
            u = producer.get(p.name)
            if u is not None:
                preds[v].add(u)
        for o in bsym.flat_proxy_outs:
            producer.setdefault(o.name, v)
        if has_side_effects(bsym):
            if last_effect is not None:
                preds[v].add(last_effect)
            last_effect = v
        if is_collective(bsym):
            preds[v].update(since_collective)
            since_collective = []
            last_collective = v
        else:
            since_collective.append(v)
        if last_collective is not None and last_collective != v:
            preds[v].add(last_collective)


def _write_edges(
    nodes: Sequence[BoundSymbol], touched: list[set[int]], storages: _Storages, preds: list[set[int]]
) -> None:
    """Every access to a storage stays after the write before it and before the write after it."""
    last_write: dict[int, int] = {}
    reads_since: dict[int, list[int]] = {}
    for v, bsym in enumerate(nodes):
        classes = {storages.alias_class(s) for s in touched[v]}
        written: set[int] = set()
        if bsym.sym.name in _WRITE_TARGET:
            target = bsym.flat_proxy_args[_WRITE_TARGET[bsym.sym.name]]
            written = {storages.alias_class(storages.of(target.name))}
        elif _writes_every_arg(bsym):
            written = classes
        for c in classes:
            w = last_write.get(c)
            if w is not None:
                preds[v].add(w)
            if c in written:
                preds[v].update(reads_since.pop(c, ()))
                last_write[c] = v
            else:
                reads_since.setdefault(c, []).append(v)
        preds[v].discard(v)


def build_graph(trace: TraceCtx, known_storages: KnownStorages | None = None) -> ScheduleGraph:
    """The dependency graph and storages of an execution trace (see the module docstring).

    ``known_storages`` is ``memory.estimate_memory``'s: for a backward, the forward storage of each
    saved tensor (``memory.backward_storages``), so that a tensor saved with its view is one storage.
    """
    is_backward = TraceTag.BACKWARD in trace.tags
    bsyms = strip_deletions(trace).bound_symbols
    head, nodes, tail = _split(bsyms)
    infos = storage_roots(trace, bsyms, known_storages)
    storages = _Storages(infos, storage_nbytes(infos, known_storages))
    inputs = {i.storage for i in storages.infos.values() if i.producer_index is None}
    for name in inputs:
        storages.of(name)

    creates, reads, touched = [], [], []
    for bsym in nodes:
        outs = tensor_outs(bsym)
        roots = [o for o in outs if storages.infos[o.name].storage == o.name and o.name not in inputs]
        created = tuple(storages.of(o.name) for o in roots)
        read = tuple(dict.fromkeys(storages.of(a.name) for a in tensor_args(bsym) if a.name in storages.infos))
        if bsym.sym.name == _UPDATE_ALIASES:
            for a, o in zip(tensor_args(bsym), outs):
                storages.merge(storages.of(a.name), storages.of(o.name))
        creates.append(created)
        reads.append(read)
        touched.append(set(read) | {storages.of(o.name) for o in outs})

    preds: list[set[int]] = [set() for _ in nodes]
    _data_and_effect_edges(nodes, preds)
    _write_edges(nodes, touched, storages, preds)
    succs: list[list[int]] = [[] for _ in nodes]
    for v, ps in enumerate(preds):
        for u in ps:
            succs[u].append(v)

    n_storages = len(storages.nbytes)
    readers: list[list[int]] = [[] for _ in range(n_storages)]
    for v, read in enumerate(reads):
        for s in read:
            readers[s].append(v)
    returned = {storages.of(a.name) for b in tail for a in tensor_args(b) if a.name in storages.infos}
    input_ids = {storages.ids[name] for name in inputs}
    estimate_held = [s in returned or (s in input_ids and not is_backward) for s in range(n_storages)]
    params = {storages.of(o.name) for b in head for o in tensor_outs(b) if is_parameter(o)}
    held = [h or s in params for s, h in enumerate(estimate_held)]
    return ScheduleGraph(
        head=head,
        nodes=tuple(nodes),
        tail=tail,
        preds=tuple(tuple(sorted(p)) for p in preds),
        succs=tuple(tuple(s) for s in succs),
        alloc=tuple(sum(storages.nbytes[s] for s in c) for c in creates),
        creates=tuple(creates),
        reads=tuple(reads),
        storage_bytes=tuple(storages.nbytes),
        readers=tuple(tuple(r) for r in readers),
        held=tuple(held),
        estimate_held=tuple(estimate_held),
        input_bytes=sum(storages.nbytes[s] for s in input_ids),
    )


def _positions(g: ScheduleGraph, order: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """For ``order``: each node's position, and each storage's creator's position (-1 for an input)
    and last reader's position (-1 if nothing reads it)."""
    pos = [0] * len(order)
    for i, v in enumerate(order):
        pos[v] = i
    born = [-1] * len(g.storage_bytes)
    for v in order:
        for s in g.creates[v]:
            born[s] = pos[v]
    last_read = [max((pos[r] for r in rs), default=-1) for rs in g.readers]
    return pos, born, last_read


def _live_after_alloc(g: ScheduleGraph, born: Sequence[int], last_read: Sequence[int],
                      held: Sequence[bool]) -> list[int]:
    """Live bytes at each step of an order (its ``_positions``), just after its node's outputs are
    allocated: the storages' spans in it, summed by ``memory.live_bytes``, as
    ``memory.estimate_memory`` sums a trace's. A storage dies after its last reader, or after its
    creator if nothing reads it, unless held; the trace's inputs are live from the start."""
    steps = len(g.nodes)

    def span(s: int) -> tuple[int, int, int]:
        if held[s] or (born[s] < 0 and last_read[s] < 0):
            return born[s], steps, g.storage_bytes[s]
        return born[s], max(last_read[s], born[s]), g.storage_bytes[s]

    return live_bytes(steps, map(span, range(len(g.storage_bytes))))[1]


def simulate(g: ScheduleGraph, order: Sequence[int], *, estimate: bool = False) -> tuple[int, int]:
    """(peak bytes, position of the peak in ``order``, -1 for the inputs alone).

    ``estimate`` frees what ``memory.estimate_memory`` frees (a backward's parameters); otherwise
    parameters are held, as they are by the module.
    """
    _, born, last_read = _positions(g, order)
    live = _live_after_alloc(g, born, last_read, g.estimate_held if estimate else g.held)
    peak = max(live, default=g.input_bytes)
    if peak <= g.input_bytes:
        return g.input_bytes, -1
    return peak, live.index(peak)


def _dfs_order(g: ScheduleGraph) -> Order:
    """Inductor's ``topological_sort_dfs``: smallest (outputs + inputs) first, predecessors first."""
    size = [g.alloc[v] + sum(g.storage_bytes[s] for s in g.reads[v]) for v in range(len(g.nodes))]
    by_size = sorted(range(len(g.nodes)), key=lambda v: (size[v], v))
    rank = {v: i for i, v in enumerate(by_size)}
    preds_by_size = [sorted(ps, key=rank.__getitem__) for ps in g.preds]
    seen = [False] * len(g.nodes)
    order: Order = []
    for root in by_size:
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, iter(preds_by_size[root]))]
        while stack:
            v, it = stack[-1]
            u = next((u for u in it if not seen[u]), None)
            if u is None:
                stack.pop()
                order.append(v)
            else:
                seen[u] = True
                stack.append((u, iter(preds_by_size[u])))
    return order


class _Timeline:
    """An order with its live-bytes profile, kept up to date move by move."""

    def __init__(self, g: ScheduleGraph, order: Sequence[int]) -> None:
        self.g = g
        self.order = list(order)
        self.pos, self.born, self.last_read = _positions(g, self.order)
        self.live = _live_after_alloc(g, self.born, self.last_read, g.held)

    def peak(self) -> int:
        return self.live.index(max(self.live))

    def is_live_at(self, s: int, k: int) -> bool:
        return self.born[s] <= k and (self.g.held[s] or self.last_read[s] >= k)

    def span_profile(self, a: int, b: int, span: Sequence[int]) -> list[int]:
        """Live bytes at positions a..b if they ran ``span`` (a permutation of them) instead."""
        g, held = self.g, self.g.held
        live = self.live[a] - g.alloc[self.order[a]]
        dies_inside: dict[int, int] = {}
        for v in span:
            for s in g.reads[v]:
                if not held[s] and self.last_read[s] <= b:
                    dies_inside[s] = dies_inside.get(s, 0) + 1
        out = []
        for v in span:
            live += g.alloc[v]
            out.append(live)
            for s in g.reads[v]:
                if s in dies_inside:
                    dies_inside[s] -= 1
                    if not dies_inside[s]:
                        live -= g.storage_bytes[s]
            for s in g.creates[v]:
                if not g.readers[s] and not held[s]:
                    live -= g.storage_bytes[s]
        return out

    def apply(self, a: int, span: Sequence[int], profile: list[int]) -> None:
        g = self.g
        self.order[a : a + len(span)] = span
        self.live[a : a + len(span)] = profile
        for i, v in enumerate(span, a):
            self.pos[v] = i
            for s in g.creates[v]:
                self.born[s] = i
        for s in {s for v in span for s in g.reads[v]}:
            self.last_read[s] = max(self.pos[r] for r in g.readers[s])


def _closure(start: int, edges: Sequence[Sequence[int]], inside, forbidden: int) -> set[int] | None:
    """``start`` and what it reaches along ``edges`` through nodes ``inside``; None if that
    includes ``forbidden`` or grows past the search span."""
    seen = {start}
    stack = [start]
    while stack:
        for w in edges[stack.pop()]:
            if w == forbidden:
                return None
            if w not in seen and inside(w):
                seen.add(w)
                stack.append(w)
        if len(seen) > _SEARCH_SPAN:
            return None
    return seen


def _grown(
    members: set[int], away: Sequence[Sequence[int]], toward: Sequence[Sequence[int]], near, far
) -> set[int]:
    """``members`` plus, to a fixpoint, each ``near`` neighbour along ``away`` whose every neighbour
    along ``toward`` is a member or ``far``: it can move with them.

    A branch's first ops (a norm feeding only the attention's qkv projection) allocate nothing
    live at the peak themselves, but they hold their inputs; they are worth moving with the branch.
    """
    grown = set(members)
    stack = [u for v in members for u in away[v] if u not in grown]
    while stack and len(grown) <= _SEARCH_SPAN:
        u = stack.pop()
        if u in grown or not near(u) or not all(w in grown or far(w) for w in toward[u]):
            continue
        grown.add(u)
        stack.extend(w for w in away[u] if w not in grown)
    return grown


def _moves_across(t: _Timeline, k: int, side: int):
    """Spans ``(start, new order of the span)`` that move a branch from one side of the peak ``k``
    to the other, the nearest candidates first.

    ``side=-1`` postpones: a node before ``k`` that allocated a storage still live at ``k``, with its
    descendants up to ``k``, moves to just after it. ``side=1`` advances: a node after ``k`` that is
    the last reader of a storage live at ``k``, with its ancestors after ``k``, moves to just before
    it. Each branch is tried as found and grown (``_grown``).
    """
    g, order, pos = t.g, t.order, t.pos
    toward, away = (g.succs, g.preds) if side < 0 else (g.preds, g.succs)
    near = lambda w: 0 < (pos[w] - k) * side <= _SEARCH_SPAN  # noqa: E731
    far = lambda w: (pos[w] - k) * side < 0  # noqa: E731

    def is_candidate(i: int) -> bool:
        if side < 0:
            return any(t.is_live_at(s, k) for s in g.creates[order[i]])
        return any(t.last_read[s] == i and not g.held[s] and t.born[s] <= k for s in g.reads[order[i]])

    found = 0
    for i in range(k + side, min(max(k + side * _SEARCH_SPAN, -1), len(order)), side):
        if found == _CANDIDATES:
            return
        if not is_candidate(i):
            continue
        branch = _closure(order[i], toward, near, order[k])
        if branch is None:
            continue
        found += 1
        for moved in (branch, _grown(branch, away, toward, near, far)):
            ends = [pos[v] for v in moved] + [k]
            a, b = min(ends), max(ends)
            kept = [v for v in order[a : b + 1] if v not in moved]
            moved_in_order = sorted(moved, key=pos.__getitem__)
            yield a, (kept + moved_in_order) if side < 0 else (moved_in_order + kept)


def _local_search(g: ScheduleGraph, order: Sequence[int]) -> Order:
    """Repeatedly take the move that lowers the live bytes around the peak the most.

    Positions outside a moved span keep their live bytes (the same nodes ran before and after it),
    so a move that lowers the span's maximum never raises the trace's peak.
    """
    t = _Timeline(g, order)
    budget = _PRICING_BUDGET
    while budget > 0:
        k = t.peak()
        best = None
        for a, span in (*_moves_across(t, k, -1), *_moves_across(t, k, 1)):
            budget -= len(span)
            old_max = max(t.live[a : a + len(span)])
            profile = t.span_profile(a, a + len(span) - 1, span)
            gain = old_max - max(profile)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, a, span, profile)
        if best is None:
            break
        t.apply(*best[1:])
    return t.order


@dataclass(frozen=True)
class ScheduleResult:
    """What the pass did to one trace. Peaks are ``memory.estimate_memory``'s, in bytes."""

    trace: TraceCtx  # the input trace itself when no order lowered the peak
    peak_before: int
    peak_after: int
    peak_op: str | None  # the bound symbol at the peak after the pass
    peak_source: str | None  # its user source line
    method: str  # which order won: "input", "dfs", "dfs + local search", ...
    seconds: float


def _best_order(g: ScheduleGraph) -> tuple[str, Order]:
    """The order with the lowest peak, and how it was found; the input order unless it is beaten."""
    identity = list(range(len(g.nodes)))
    if len(identity) < 2:
        return "input", identity
    before = simulate(g, identity)[0]
    start, start_order, start_peak = "input", identity, before
    dfs = _dfs_order(g)
    dfs_peak = simulate(g, dfs)[0]
    if dfs_peak < before:
        start, start_order, start_peak = "dfs", dfs, dfs_peak
    order = _local_search(g, start_order)
    peak = simulate(g, order)[0]
    method = f"{start} + local search"
    if peak >= start_peak:
        method, order, peak = start, start_order, start_peak
    # The estimate frees a backward's parameters; an order that only looks better to it is not
    # taken, and one that looks worse to it is not taken either.
    if peak >= before or simulate(g, order, estimate=True)[0] > simulate(g, identity, estimate=True)[0]:
        return "input", identity
    return method, order


def schedule_trace(trace: TraceCtx, known_storages: KnownStorages | None = None) -> ScheduleResult:
    """Reorder an execution trace to lower its peak of live bytes (see the module docstring).
    ``known_storages``: as for ``build_graph``."""
    start = time.perf_counter()
    g = build_graph(trace, known_storages)
    method, order = _best_order(g)
    before = simulate(g, range(len(g.nodes)), estimate=True)[0]
    peak, k = simulate(g, order, estimate=True)
    new_trace = trace
    if method != "input":
        bsyms = [*g.head, *(g.nodes[v] for v in order), *g.tail]
        new_trace = replace_bound_symbols(trace, bsyms, f"thunder_memopt schedule ({method})")
    peak_bsym = g.nodes[order[k]] if k >= 0 else None
    return ScheduleResult(
        trace=new_trace,
        peak_before=before,
        peak_after=peak,
        peak_op=None if peak_bsym is None else peak_bsym.sym.name,
        peak_source=None if peak_bsym is None else source_of(peak_bsym),
        method=method,
        seconds=time.perf_counter() - start,
    )
