"""Collective-aware scheduling for Thunder's own fsdp: just-in-time all-gathers, real ZeRO-3, early reduce-scatters.

``thunder.distributed.fsdp`` inserts an all-gather + wait per sharded parameter and a divide +
reduce-scatter + wait per gradient, and ``sort_waits`` then issues every all-gather at the top of
the forward and leaves every reduce-scatter at the end of the backward. So all unsharded weights are
alive at once, every unsharded gradient stays alive for the whole backward, and ZERO3 saves the
unsharded weights for backward exactly like ZERO2.

This module rewrites the post-optimization traces (dels stripped, reordered, dels re-inserted):

* all-gathers: each wait sits right before the first reader of the unsharded tensor, and each
  all-gather is issued ``prefetch`` gathers ahead of its wait, so at most ``prefetch + 1`` are in
  flight; ``del_last_used`` then frees each unsharded parameter after its last use;
* ZeRO-3: the forward saves the shard instead of the unsharded weight (and of views of it); the
  backward re-gathers it just before its first reader, under the same prefetch window;
* reduce-scatters: each gradient's divide + reduce-scatter is issued as soon as the gradient is
  final, and its wait placed when ``max(prefetch, 1)`` newer reduce-scatters have been issued (or at
  the return), since the collective holds the unsharded gradient until it is waited on.

``CollectivesPass.forward`` returns the ZeRO-3 plan that the backward of the same pair must be given;
it runs after the recompute pass on both traces.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from thunder.core import utils
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.core.utils import ProxyDict

from thunder_memopt.core.memory import estimate_from_lifetimes, storage_lifetimes, storage_roots
from thunder_memopt.core.trace import (
    SavedSetChange,
    is_bookkeeping,
    replace_bound_symbols,
    saved_proxies,
    strip_deletions,
    tensor_args,
    tensor_outs,
)

__all__ = [
    "ALL_GATHER",
    "WAIT",
    "REDUCE_SCATTER",
    "Zero3Plan",
    "CollectivesPass",
    "checked_prefetch",
    "is_zero3_module",
    "schedule_all_gathers",
    "schedule_reduce_scatters",
    "plan_zero3",
    "CollectiveBytes",
    "collective_bytes_at_peak",
]

ALL_GATHER = "torch_all_gather_prim_impl"
WAIT = "torch_wait_prim_impl"
REDUCE_SCATTER = "torch_reduce_scatter_prim_impl"


def _name(bsym: BoundSymbol) -> str:
    return bsym.sym.name


def _consumers(bsyms: Sequence[BoundSymbol]) -> ProxyDict:
    """Tensor or future -> indices of the bound symbols that read it (Thunder's ``consumers``)."""
    return utils.consumers(list(bsyms), _map_to_numbers=True)


def _gather_pairs(bsyms: Sequence[BoundSymbol]) -> list[tuple[BoundSymbol, BoundSymbol]]:
    """(all_gather, wait) of every gather whose shard is a trace input or an unpacked saved tensor.

    Gathers of computed tensors are left where they are: moving them would need their producers.
    """
    produced = {o.name for b in bsyms if not is_bookkeeping(b) for o in tensor_outs(b)}
    waits = {b.flat_proxy_args[0].name: b for b in bsyms if _name(b) == WAIT}
    pairs = []
    for b in bsyms:
        if _name(b) != ALL_GATHER or any(a.name in produced for a in tensor_args(b)):
            continue
        wait = waits.get(b.flat_proxy_outs[0].name)
        if wait is not None:
            pairs.append((b, wait))
    return pairs


def _reorder_gathers(bsyms: Sequence[BoundSymbol], prefetch: int) -> list[BoundSymbol]:
    pairs = _gather_pairs(bsyms)
    moved = {id(b) for pair in pairs for b in pair}
    rest = [b for b in bsyms if id(b) not in moved]
    readers = _consumers(rest)
    first_use = {id(w): min(readers.get(w.flat_proxy_outs[0], [len(rest) - 1])) for _, w in pairs}
    pairs.sort(key=lambda p: first_use[id(p[1])])
    waits_at: dict[int, list[int]] = {}
    for k, (_, w) in enumerate(pairs):
        waits_at.setdefault(first_use[id(w)], []).append(k)
    out: list[BoundSymbol] = []
    issued = 0
    for i, b in enumerate(rest):
        for k in waits_at.get(i, ()):
            # Keep `prefetch` gathers in flight behind the one waited on now.
            while issued <= min(k + prefetch, len(pairs) - 1):
                out.append(pairs[issued][0])
                issued += 1
            out.append(pairs[k][1])
        out.append(b)
    return out


def schedule_all_gathers(trace: TraceCtx, prefetch: int) -> TraceCtx:
    """Waits right before first use, all-gathers ``prefetch`` ahead (see the module docstring)."""
    stripped = strip_deletions(trace)
    if not _gather_pairs(stripped.bound_symbols):
        return trace
    out = _reorder_gathers(stripped.bound_symbols, prefetch)
    return replace_bound_symbols(stripped, out, "thunder_memopt collectives: just-in-time all-gathers")


def _hoisted_chain(
    bsyms: Sequence[BoundSymbol], rs_index: int, readers: ProxyDict, producer: dict[str, int]
) -> list[int]:
    """The reduce-scatter and the single-input, single-reader ops feeding it (the ``/ world_size``)."""
    chain = [rs_index]
    while True:
        args = tensor_args(bsyms[chain[-1]])
        if len(args) != 1 or args[0].name not in producer:
            return chain
        p = producer[args[0].name]
        if len(tensor_args(bsyms[p])) != 1 or readers.get(args[0], None) != [chain[-1]]:
            return chain
        chain.append(p)


@dataclass(frozen=True)
class _Scatter:
    """One gradient's divide + reduce-scatter, in order, and the wait on its future."""

    chain: tuple[BoundSymbol, ...]
    wait: BoundSymbol | None

    @property
    def members(self) -> tuple[BoundSymbol, ...]:
        return self.chain if self.wait is None else (*self.chain, self.wait)

    @cached_property  # read for every pending scatter after every symbol of the backward
    def needs(self) -> set[str]:
        made = {o.name for b in self.chain for o in tensor_outs(b)}
        return {a.name for b in self.chain for a in tensor_args(b)} - made


def _scatters(bsyms: Sequence[BoundSymbol]) -> list[_Scatter]:
    readers = _consumers(bsyms)
    # Built once, not per reduce-scatter: the backward has one per gradient.
    producer = {o.name: i for i, b in enumerate(bsyms) if not is_bookkeeping(b) for o in tensor_outs(b)}
    waits = {b.flat_proxy_args[0].name: b for b in bsyms if _name(b) == WAIT}
    return [
        _Scatter(
            chain=tuple(bsyms[j] for j in reversed(_hoisted_chain(bsyms, i, readers, producer))),
            wait=waits.get(b.flat_proxy_outs[0].name),
        )
        for i, b in enumerate(bsyms)
        if _name(b) == REDUCE_SCATTER
    ]


def _reorder_reduce_scatters(bsyms: Sequence[BoundSymbol], in_flight: int) -> list[BoundSymbol]:
    scatters = _scatters(bsyms)
    moved = {id(m) for s in scatters for m in s.members}
    rest = [b for b in bsyms if id(b) not in moved]
    available: set[str] = set()
    out: list[BoundSymbol] = []
    waiting: list[_Scatter] = []  # issued, not yet waited on, oldest first
    todo = list(scatters)
    for b in rest[:-1]:
        out.append(b)
        available.update(o.name for o in tensor_outs(b))
        for s in [s for s in todo if s.needs <= available]:
            if len(waiting) >= in_flight:
                # The collective holds its unsharded input until waited on: bound how many do.
                out.extend(w for w in [waiting.pop(0).wait] if w is not None)
            out.extend(s.chain)
            waiting.append(s)
            todo.remove(s)
    if todo:
        raise RuntimeError(f"{len(todo)} reduce-scatters read tensors the backward never computes")
    out.extend(w for s in waiting for w in [s.wait] if w is not None)
    return [*out, rest[-1]]


def schedule_reduce_scatters(trace: TraceCtx, in_flight: int) -> TraceCtx:
    """Issue each gradient's reduce-scatter once it is final; at most ``in_flight`` un-waited."""
    stripped = strip_deletions(trace)
    bsyms = stripped.bound_symbols
    if not any(_name(b) == REDUCE_SCATTER for b in bsyms):
        return trace
    out = _reorder_reduce_scatters(bsyms, max(in_flight, 1))
    return replace_bound_symbols(stripped, out, "thunder_memopt collectives: early reduce-scatters")


@dataclass(frozen=True)
class Zero3Plan(SavedSetChange):
    """What a ZeRO-3 forward saves instead of unsharded weights (``saved``: their shards), and what
    its backward re-gathers (``replayed``: the all_gather, wait and view ops, in forward order)."""

    unsharded_bytes: int  # bytes of the unsharded storages no longer saved

    forward_what = "ZeRO-3"
    backward_what = "re-gather (ZeRO-3)"


def is_zero3_module() -> bool:
    """Whether the module being compiled was sharded by ``thunder.distributed.fsdp`` with ZERO3."""
    from thunder.core.compile_data import get_compile_data
    from thunder.distributed import FSDPType

    cd = get_compile_data()
    return getattr(getattr(cd, "fn", None), "sharding_strategy", None) is FSDPType.ZERO3


def _producers(bsyms: Sequence[BoundSymbol]) -> dict[str, BoundSymbol]:
    """Tensor or future name -> the computing bound symbol that outputs it."""
    return {o.name: b for b in bsyms if not is_bookkeeping(b) for o in b.flat_proxy_outs if hasattr(o, "name")}


def plan_zero3(forward_trace: TraceCtx) -> Zero3Plan:
    """Replace every saved unsharded weight, or view of one, by the shard it was gathered from."""
    bsyms = strip_deletions(forward_trace).bound_symbols
    infos = storage_roots(forward_trace)
    gathered = {w.flat_proxy_outs[0].name: (ag, w) for ag, w in _gather_pairs(bsyms)}
    producer = _producers(bsyms)
    saved, _ = saved_proxies(forward_trace)
    new_saved: dict[str, TensorProxy] = {}
    replay: set[int] = set()
    removed: dict[str, int] = {}
    for t in saved:
        root = infos[t.name].storage
        if root not in gathered:
            new_saved.setdefault(t.name, t)
            continue
        ag, w = gathered[root]
        shard = tensor_args(ag)[0]
        new_saved.setdefault(shard.name, shard)
        removed[root] = infos[root].nbytes
        replay.update((id(ag), id(w)))
        name = t.name
        while name != root:  # the views from the unsharded weight down to the saved tensor
            view = producer[name]
            replay.add(id(view))
            name = tensor_args(view)[0].name
    return Zero3Plan(
        key=tuple(t.name for t in saved),
        saved=tuple(new_saved.values()),
        replayed=tuple(b for b in bsyms if id(b) in replay),
        unsharded_bytes=sum(removed.values()),
    )


def checked_prefetch(prefetch: object) -> int:
    """``prefetch`` as an int (any integral number, numpy's too, but a bool): a TypeError naming
    it for another type, a ValueError for a negative one."""
    if isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be an int >= 0, got {prefetch!r}")
    try:
        value = operator.index(prefetch)
    except TypeError:
        raise TypeError(f"prefetch must be an int >= 0, got {prefetch!r}") from None
    if value < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {value}")
    return value


@dataclass(frozen=True)
class CollectivesPass:
    """The collective passes of one transform instance: a forward returns the ZeRO-3 plan that the
    caller gives to its backward.

    Args:
        prefetch: all-gathers issued ahead of the one being waited on; also bounds un-waited
            reduce-scatters (at least one).
        zero3: save shards and re-gather in backward; None detects ``FSDPType.ZERO3``.
    """

    prefetch: int = 2
    zero3: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefetch", checked_prefetch(self.prefetch))  # frozen: set once, checked

    def forward(self, trace: TraceCtx) -> tuple[TraceCtx, Zero3Plan | None]:
        """The forward scheduled, and the ZeRO-3 plan its backward must follow (None: nothing to re-gather)."""
        plan = plan_zero3(trace) if (is_zero3_module() if self.zero3 is None else self.zero3) else None
        if plan is not None and plan.replayed:
            # Unsharded weights die after their last forward use.
            trace = plan.apply_to_forward(trace)
        trace = schedule_all_gathers(trace, self.prefetch)
        # Only a forward that was fully rewritten hands its plan to the backward.
        return trace, plan if plan is not None and plan.replayed else None

    def backward(self, trace: TraceCtx, zero3: Zero3Plan | None) -> TraceCtx:
        """The backward scheduled; with ``zero3``, its forward's plan, re-gathering what it saved sharded."""
        if zero3 is not None:
            # Shards received, each weight re-gathered just before its first reader.
            trace = zero3.apply_to_backward(trace)
        trace = schedule_reduce_scatters(trace, self.prefetch)
        return schedule_all_gathers(trace, self.prefetch)


@dataclass(frozen=True)
class CollectiveBytes:
    """An estimated peak, what unsharded parameters and gradients contribute to it, and their own highs."""

    peak_bytes: int
    unsharded_param_bytes: int  # all-gathered storages live at the peak
    unsharded_grad_bytes: int  # gradients bound for a reduce-scatter live at the peak (held until the wait)
    max_unsharded_param_bytes: int  # the most all-gathered bytes live at any symbol
    max_unsharded_grad_bytes: int


def _tensor_names(bsym: BoundSymbol) -> list[str]:
    return [t.name for t in (*tensor_args(bsym), *tensor_outs(bsym))]


def collective_bytes_at_peak(trace: TraceCtx) -> CollectiveBytes:
    """The peak of ``memory.estimate_memory`` and the unsharded bytes alive at that symbol."""
    lifetimes = storage_lifetimes(trace)
    est = estimate_from_lifetimes(lifetimes)
    bsyms, storage_of, span = lifetimes.bsyms, lifetimes.storage_of, dict(lifetimes.spans)
    # The memory model frees a reduce-scatter's input at the reduce-scatter; it is held to the wait.
    waits = {b.flat_proxy_args[0].name: i for i, b in enumerate(bsyms) if _name(b) == WAIT}
    for b in bsyms:
        if _name(b) == REDUCE_SCATTER and b.flat_proxy_outs[0].name in waits:
            root = storage_of[tensor_args(b)[0].name]
            span[root] = (span[root][0], max(span[root][1], waits[b.flat_proxy_outs[0].name]))
    gathered = {w.flat_proxy_outs[0].name for _, w in _gather_pairs(bsyms)}
    # A gradient and its `/ world_size` copy are both unsharded gradient storage.
    scattered = {storage_of[n] for s in _scatters(bsyms) for b in s.chain for n in _tensor_names(b) if n in storage_of}

    def live_bytes(k: int, storages: set[str]) -> int:
        return sum(lifetimes.nbytes[s] for s in storages if span[s][0] <= k <= span[s][1])

    gathered &= span.keys()
    scattered &= span.keys()
    # estimate_memory indexes the trace without dels, like the lifetimes.
    k = max(est.peak_index, 0)
    return CollectiveBytes(
        peak_bytes=est.peak_bytes,
        unsharded_param_bytes=live_bytes(k, gathered),
        unsharded_grad_bytes=live_bytes(k, scattered),
        max_unsharded_param_bytes=max((live_bytes(i, gathered) for i in range(len(bsyms))), default=0),
        max_unsharded_grad_bytes=max((live_bytes(i, scattered) for i in range(len(bsyms))), default=0),
    )
