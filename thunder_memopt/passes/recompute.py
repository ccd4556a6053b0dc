"""Recompute: choose what the forward saves for backward, and recompute the rest in the backward.

Thunder saves every intermediate that a backward formula reads. Without nvFuser, LayerNorm, GELU
and rotary are decomposed into upcast fp32 elementwise ops and each intermediate is saved; with
nvFuser, Thunder's rematerialization still refuses values with several consumers, which is the
parallel-residual block (``x + attn(n1(x)) + mlp(n2(x))``).

This pass works on the executed forward trace, where the real ops and the real saved set are known.
It builds the forward's data-flow graph and finds a minimum cut between what the forward must
compute (its inputs and the outputs of ops that must not be recomputed) and what the backward reads
(the saved set), weighting each tensor by the bytes of its storage. Tensors on the cut are saved;
the cheap ops behind the cut are replayed in the backward, each just before its first reader, from
the same executor symbols that ran in the forward, so numerics are unchanged.

Which ops may be replayed depends on ``activation_budget`` (see ``thunder_memopt.core.ops.op_kind``): at 1.0 cheap ops only
(elementwise, casts, views, norms, activations, rotary, masks); below it also matmuls and attention,
the cheapest FLOPs first, until the saved bytes fall to the budget's share between the two extremes.
Random ops, collectives, in-place ops and anything not recognised are never replayed: they are
saved, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import boykov_kolmogorov
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, from_trace

from thunder_memopt.core.cost import estimate_flops
from thunder_memopt.core.memory import (
    StepEstimate,
    SymbolFacts,
    TensorInfo,
    estimate_step,
    is_parameter,
    storage_roots,
)
from thunder_memopt.core.ops import OpKind, moves_data, op_kind
from thunder_memopt.core.trace import (
    SavedSetChange,
    forward_outputs,
    is_bookkeeping,
    saved_proxies,
    strip_deletions,
    tensor_args,
    tensor_outs,
    trace_inputs,
)

__all__ = [
    "RecomputePlan",
    "plan_recompute",
    "plan_ladder",
    "price_ladder",
    "choose_by_budget",
    "runs_per_layer",
]


@dataclass(frozen=True)
class RecomputePlan(SavedSetChange):
    """What a forward saves after the pass (``saved``), and what its backward recomputes
    (``replayed``: forward symbols, in forward order)."""

    saved_bytes_before: int  # storages, parameters excluded
    saved_bytes_after: int

    forward_what = "recompute"
    backward_what = "recompute"


@dataclass(frozen=True)
class _ForwardGraph:
    bsyms: tuple[BoundSymbol, ...]  # computation only, in forward order
    producer: dict[str, int]  # tensor name -> index into bsyms
    kinds: tuple[OpKind, ...]
    cost: dict[str, int]  # bytes of keeping a tensor alive until backward
    inputs: frozenset[str]
    needed: tuple[TensorProxy, ...]  # the original saved tensors
    outputs: tuple[str, ...]  # the forward's own outputs
    infos: dict[str, TensorInfo]  # every tensor's storage (memory.storage_roots)
    proxies: dict[str, TensorProxy]  # every tensor by name


def _forward_graph(trace: TraceCtx) -> _ForwardGraph:
    bsyms = tuple(b for b in strip_deletions(trace).bound_symbols if not is_bookkeeping(b))
    infos = storage_roots(trace)
    inputs = trace_inputs(trace)
    params = {t.name for t in inputs if is_parameter(t)}
    producer = {o.name: i for i, b in enumerate(bsyms) for o in tensor_outs(b)}
    cost = {}
    for name, info in infos.items():
        root = info.storage
        cost[name] = 0 if root in params else infos[root].nbytes
    needed, _ = saved_proxies(trace)
    proxies = {t.name: t for t in (*needed, *inputs)}
    proxies.update((o.name, o) for b in bsyms for o in tensor_outs(b))
    return _ForwardGraph(
        bsyms=bsyms,
        producer=producer,
        kinds=tuple(op_kind(b) for b in bsyms),
        cost=cost,
        inputs=frozenset(t.name for t in inputs),
        needed=tuple(needed),
        outputs=tuple(forward_outputs(trace)),
        infos=infos,
        proxies=proxies,
    )


class _CutNetwork:
    """The flow network of the min-cut, built once for every rung of a ladder.

    Each tensor is an edge ``t.in -> t.out`` of capacity its bytes; a replayable op connects its
    inputs' ``out`` to its outputs' ``in``; inputs and non-replayable outputs hang off the source,
    and the backward's needs off the sink. Rungs differ only in which ops are replayable, so both
    kinds of an op's edges are in the network, and each rung gives the kind it uses infinite
    capacity and the other none: an edge of no capacity carries no flow, as if it were absent.
    Building the graph and its residual network anew was half of each rung's cut.
    """

    def __init__(self, g: _ForwardGraph) -> None:
        self._names = tuple(g.cost)
        # Boykov-Kolmogorov's residual network, built as networkx's build_residual_network would:
        # each edge with a reverse edge of no capacity; infinity three times the finite capacities.
        self._inf = 3 * sum(c for c in g.cost.values() if c > 0) or 1
        self._residual = nx.DiGraph()
        self._residual.graph["inf"] = self._inf
        self._into: dict[Hashable, list[tuple[Hashable, dict]]] = {}  # each node's incoming edges, as (tail, attributes)
        self._residual.add_node("source")
        self._residual.add_nodes_from((name, side) for name in self._names for side in (0, 1))
        for name in self._names:
            self._edge((name, 0), (name, 1), g.cost[name])
        for name in g.inputs:
            self._edge("source", (name, 0), self._inf)
        for t in g.needed:
            self._edge((t.name, 1), "sink", self._inf)
        always = {id(attrs) for attrs in self._residual.succ["source"].values()}  # the inputs' edges
        # Per op, the edges that are infinite when it is replayed, and when it is not.
        self._replayed: list[list[dict]] = []
        self._kept: list[list[dict]] = []
        for b in g.bsyms:
            outs = tensor_outs(b)
            kept = [self._edge("source", (o.name, 0), 0) for o in outs]
            self._kept.append([attrs for attrs in kept if id(attrs) not in always])
            self._replayed.append([self._edge((a.name, 1), (o.name, 0), 0)
                                   for a in tensor_args(b) for o in outs if a.name != o.name])
        self._switched = [attrs for edges in (*self._replayed, *self._kept) for attrs in edges]

    def _edge(self, u: Hashable, v: Hashable, capacity: int) -> dict:
        """The attributes of edge ``u -> v``, added with ``capacity`` (and its reverse) if new."""
        if not self._residual.has_edge(u, v):
            self._residual.add_edge(u, v, capacity=capacity)
            self._residual.add_edge(v, u, capacity=0)
            for a, b in ((u, v), (v, u)):
                self._into.setdefault(b, []).append((a, self._residual.succ[a][b]))
        return self._residual.succ[u][v]

    def min_cut_saved(self, replayable: Sequence[bool]) -> set[str]:
        """The cheapest set of tensors to save so that the backward's needs can be recomputed:
        the tensors whose edge crosses the minimum cut."""
        if "sink" not in self._residual:  # the backward reads nothing the forward made (an embedding-only graph, say)
            return set()
        for attrs in self._switched:
            attrs["capacity"] = 0
        for kept, replayed, r in zip(self._kept, self._replayed, replayable):
            for attrs in replayed if r else kept:
                attrs["capacity"] = self._inf
        # Boykov-Kolmogorov: ten times preflow-push's speed on these graphs. The residual network is
        # its own graph (it only checks that the source and sink are in it), and it resets the flows.
        boykov_kolmogorov(self._residual, "source", "sink", residual=self._residual)
        # What can still reach the sink is the same for every maximum flow, so the cut does not
        # depend on the algorithm: it is nx.minimum_cut's partition.
        sink_side, stack = {"sink"}, ["sink"]
        while stack:
            for u, attrs in self._into.get(stack.pop(), ()):
                if u not in sink_side and attrs["flow"] < attrs["capacity"]:
                    sink_side.add(u)
                    stack.append(u)
        return {name for name in self._names if (name, 0) not in sink_side and (name, 1) in sink_side}


def _closure(g: _ForwardGraph, saved: set[str], replayable: Sequence[bool]) -> tuple[set[str], set[int]]:
    """Complete a saved set: replay what is missing where allowed, save it otherwise."""
    saved = set(saved)
    replay: set[int] = set()
    stack = [t.name for t in g.needed]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in saved:
            continue
        seen.add(name)
        i = g.producer.get(name)
        if i is None or not replayable[i]:
            saved.add(name)
            continue
        replay.add(i)
        stack.extend(a.name for a in tensor_args(g.bsyms[i]))
    return saved, replay


def _bases_saved_for_views(
    g: _ForwardGraph, saved: set[str], replay: set[int], replayable: Sequence[bool]
) -> tuple[set[str], set[int]]:
    """Save what a saved view looks into, and replay the view: the same storage, so the same bytes
    (a parameter's broadcast costs nothing either way). A fusion region is split where replayed ops
    meet ops that are not, and a view kept out of the replays, such as a norm weight's broadcast
    between the normalization and its scale, split the norm in two."""
    def replayable_view(name: str) -> bool:
        i = g.producer.get(name)
        if i is None or not replayable[i] or moves_data(g.bsyms[i]):
            return False
        storage = g.infos[name].storage  # a reshape may copy: then its input can cost more
        return all(g.infos[a.name].storage == storage or g.cost[a.name] == 0 for a in tensor_args(g.bsyms[i]))

    views = [name for name in saved if replayable_view(name)]
    while views:
        i = g.producer[views.pop()]
        saved.difference_update(o.name for o in tensor_outs(g.bsyms[i]))
        replay.add(i)
        for a in tensor_args(g.bsyms[i]):
            if g.producer.get(a.name) in replay:
                continue
            if replayable_view(a.name):
                views.append(a.name)
            else:
                saved.add(a.name)
    return saved, replay


def _saved_bytes(g: _ForwardGraph, saved: set[str]) -> int:
    return sum({g.infos[n].storage: g.cost[n] for n in saved}.values())


def _solve(g: _ForwardGraph, network: _CutNetwork, replayable: Sequence[bool],
           replay_saved_views: bool) -> tuple[set[str], set[int], int]:
    saved, replay = _closure(g, network.min_cut_saved(replayable), replayable)
    if replay_saved_views:
        saved, replay = _bases_saved_for_views(g, saved, replay, replayable)
    return saved, replay, _saved_bytes(g, saved)


def plan_recompute(forward_trace: TraceCtx) -> RecomputePlan:
    """The default plan: replay cheap ops only, save the min-cut (see the module docstring)."""
    return plan_ladder(forward_trace, steps=0)[0]


def plan_ladder(forward_trace: TraceCtx, *, steps: int = 8, replay_saved_views: bool = False) -> list[RecomputePlan]:
    """Plans from the default (cheap ops only) to the most recompute, in ``steps`` rungs.

    ``replay_saved_views``: replay each saved view from what it looks into, for the same bytes
    (``_bases_saved_for_views``), so that fusion regions stay whole. Without fusion the cut is kept
    as it is: there the change gains nothing, and on a narrowed Llama it left the schedule pass a
    backward it could not improve.

    Rung k also replays the cheapest-FLOPs k/steps of the expensive ops (matmuls, attention) that
    are not segment checkpoints (see ``_checkpoints``). Allowing more ops can only lower the min
    cut, so saved bytes fall along the ladder. Which rung is taken is decided once the backward trace
    is known: by ``choose_by_budget``, or under a memory limit by ``passes.fit.choose_by_limit``.
    """
    g = _forward_graph(forward_trace)
    cheap = [k is OpKind.CHEAP for k in g.kinds]
    before = _saved_bytes(g, {t.name for t in g.needed})
    network = _CutNetwork(g)
    solutions = [_solve(g, network, cheap, replay_saved_views)]
    if steps:
        checkpoints = _checkpoints(g)
        expensive = sorted(
            (i for i, k in enumerate(g.kinds) if k is OpKind.EXPENSIVE and i not in checkpoints),
            key=lambda i: estimate_flops(g.bsyms[i]),
        )
        allowed_cheap = [c and i not in checkpoints for i, c in enumerate(cheap)]
        for n in sorted({round(k * len(expensive) / steps) for k in range(1, steps + 1)}):
            allowed = list(allowed_cheap)
            for i in expensive[:n]:
                allowed[i] = True
            solutions.append(_solve(g, network, allowed, replay_saved_views))
    return [_plan(g, before, *solution) for solution in solutions]


def _plan(g: _ForwardGraph, before: int, saved: set[str], replay: set[int], after: int) -> RecomputePlan:
    if after > before:  # never save more than Thunder did
        saved, replay, after = {t.name for t in g.needed}, set(), before
    order = [t.name for t in g.needed if t.name in saved]
    order += sorted(saved - set(order), key=lambda n: g.producer.get(n, -1))
    return RecomputePlan(
        key=tuple(t.name for t in g.needed),
        saved=tuple(g.proxies[n] for n in order),
        replayed=tuple(g.bsyms[i] for i in sorted(replay)),
        saved_bytes_before=before,
        saved_bytes_after=after,
    )


def price_ladder(
    plans: Sequence[RecomputePlan], forward_trace: TraceCtx, backward_trace: TraceCtx
) -> list[StepEstimate]:
    """Each rung applied to both traces and priced by ``memory.estimate_step``, in ladder order."""
    # Priced without deletions (the memory model reads liveness from last uses), which saves placing
    # them for every rung; the chosen rung gets them. The rungs' forwards differ only in what they
    # return: one is built, the others take its symbols with another return, and one storage map
    # serves them all.
    first = plans[0].apply_to_forward(forward_trace, deletions=False)
    forwards = [first, *(_returning_saved(first, plan.saved) for plan in plans[1:])]
    # The rungs are made of the same symbols, so one SymbolFacts reads each of them once.
    facts = SymbolFacts()
    forward_infos = storage_roots(forwards[0], facts=facts)
    return [estimate_step(forward, plan.apply_to_backward(backward_trace, deletions=False),
                          forward_infos=forward_infos, facts=facts) for forward, plan in zip(forwards, plans)]


def choose_by_budget(
    plans: Sequence[RecomputePlan], forward_trace: TraceCtx, backward_trace: TraceCtx, budget: float
) -> int:
    """The rung a budget takes (the caller applies it to both traces).

    Each rung is priced by ``price_ladder``. The budget places a target between the lowest estimated
    peak (0.0) and the default's (1.0), and the rung with the least recompute that meets it wins. A
    lower budget only removes rungs that a higher one could have taken, so the estimated peak never
    rises as the budget falls; torch's activation_memory_budget does not guarantee that (pytorch
    #197838). Budget 0.0 takes, among the rungs at the lowest estimated peak, the one that saves
    least; in a program that runs once per layer (``runs_per_layer``), the rung that saves least.
    """
    if budget == 0.0 and runs_per_layer(forward_trace):
        # Under FSDP2 each Block is such a program: its saved bytes add up over the Blocks, and its own
        # peak, which the replay of a whole Block raises, is counted once. Priced by that peak, a
        # Llama-3-70B Block at T=8192 took a rung saving 7.8 times the ladder's end (1028 against 132
        # MiB, traced on meta by benchmarks/diagnostics/fit_meta.py).
        return min(range(len(plans)), key=lambda k: (plans[k].saved_bytes_after, k))
    peaks = [estimate.peak_bytes for estimate in price_ladder(plans, forward_trace, backward_trace)]
    target = min(peaks) + budget * (peaks[0] - min(peaks))
    meeting = [k for k, peak in enumerate(peaks) if peak <= target]
    # At 0.0 memory is all that counts: of the rungs at the lowest estimated peak, the one that saves
    # least (the ladder's end is per-block checkpointing), since the estimate can tie rungs whose
    # real peaks differ. Otherwise the least recompute that meets the target.
    return min(meeting, key=lambda k: plans[k].saved_bytes_after) if budget == 0.0 else meeting[0]


def runs_per_layer(forward_trace: TraceCtx) -> bool:
    """Whether a forward maps an activation to one of the same shape and dtype, as a transformer
    Block maps the residual stream: a program taken to run once per layer of a step. A whole model
    returns its loss or logits from token ids, and a loss head its loss."""
    inputs = {(tuple(t.shape), t.dtype) for t in trace_inputs(forward_trace) if not is_parameter(t)}
    names = set(forward_outputs(forward_trace))
    return any((tuple(t.shape), t.dtype) in inputs
               for b in forward_trace.bound_symbols for t in tensor_outs(b) if t.name in names)


def _returning_saved(forward_trace: TraceCtx, saved: Sequence[TensorProxy]) -> TraceCtx:
    """The forward's symbols, its return saving ``saved`` instead (the other saved values kept)."""
    ret = forward_trace.bound_symbols[-1]
    output, (_, others) = ret.args
    new = from_trace(forward_trace)
    new.bound_symbols = [*forward_trace.bound_symbols[:-1], dataclasses.replace(ret, args=(output, (tuple(saved), others)))]
    return new


def _checkpoints(g: _ForwardGraph, min_expensive_per_segment: int = 5) -> set[int]:
    """Producers of the tensors that every path from the batch to the output crosses (the residual
    stream between blocks), spaced at least ``min_expensive_per_segment`` expensive ops apart.

    Below budget 1.0, matmuls may be replayed and a replay chain could otherwise reach back through
    every layer to the input: the whole forward would be replayed at once in the backward and the
    peak would rise. Never replaying these producers keeps each replay inside one segment, which at
    budget 0.0 is full activation checkpointing of each block.
    """
    graph = nx.DiGraph()
    root, sink = "root", "sink"
    free = {n for n in g.inputs if g.cost.get(n, 0) == 0}
    graph.add_edges_from((root, n) for n in g.inputs if n not in free)
    for b in g.bsyms:
        for a in tensor_args(b):
            if a.name in free:
                continue
            graph.add_edges_from((a.name, o.name) for o in tensor_outs(b) if o.name != a.name)
    graph.add_edges_from((name, sink) for name in g.outputs if name in graph)
    if sink not in graph or root not in graph:
        return set()
    idom = nx.immediate_dominators(graph, root)
    if sink not in idom:
        return set()
    chain, node = [], idom[sink]
    while node != root:
        if node in g.producer:
            chain.append(g.producer[node])
        node = idom[node]
    expensive_before = _prefix_counts([k is OpKind.EXPENSIVE for k in g.kinds])
    chosen, last = set(), 0
    for i in sorted(chain):
        if expensive_before[i] - last >= min_expensive_per_segment:
            chosen.add(i)
            last = expensive_before[i]
    return chosen


def _prefix_counts(flags: Sequence[bool]) -> list[int]:
    counts, c = [], 0
    for f in flags:
        counts.append(c)
        c += f
    return counts
