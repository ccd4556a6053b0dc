"""Offload: copy saved tensors to host memory after the forward makes them, and bring them back
before the backward reads them, the third choice beside saving and recomputing.

Whatever the recompute pass leaves saved stays on the GPU from the forward to the backward; at long
context those tensors grow with every token and outnumber everything else. This pass takes the
final forward and backward of a pair and, for each saved tensor it offloads (executors/offload.py):

- the forward copies it to pinned host memory on a side stream, just after its producer, and
  returns the host copy as the saved tensor. Where the cost model expects the copy to have ended,
  and not before the tensor's last forward reader, the forward's stream waits for the copy and
  lets the GPU tensor go (``memopt_offload_wait``): its block is free from there, for the kernels
  that follow on that stream. A copy expected to end only after the forward (one that
  ``budget`` mode must take) is not waited for: after the last reader its block goes back to the
  allocator once the copy has run (``memopt_offload_release``), and the copies queue on into what
  runs next (under FSDP2, the next Block's forward) rather than stall this one. The memory model
  frees it at its last reader, earlier than the device does;
- the backward receives the host copy, starts its reload one reload ahead, before the first
  reader of the previous reloaded tensor (the first one at the top), and waits for it just before
  its own first reader. Reloads run in the order the backward reads them.

Which tensors: saved activations that own their storage (not views, not parameters, not the
forward's own outputs nor received tensors that need no gradient, which the caller holds anyway),
of at least ``min_bytes``. The choice is made on a cost model (``core.cost``): the copies run one
after another on one stream, the forward's while it computes, the backward's behind the compute
before each first reader; a copy hides when it ends before it is needed. Where the backward follows
the backward of a program like it (a Block's under FSDP2), its first reload starts during that one
(the executor's prefetch across programs), and the reloads are modeled in that steady state.
``OffloadMode``: ``auto``
offloads only what hides; ``budget`` also offloads, largest first, what it must for at most
``budget`` of the saved bytes to stay on the GPU (MemoryOptimization's ``offload_budget``, which
defaults to its ``activation_budget``). The budget counts every saved byte, but only tensors of at
least ``min_bytes`` (``MIN_BYTES``, 1 MiB) are candidates: at 0.0 the smaller ones stay.

The memory model counts what is on the GPU: a host copy takes no device bytes, a reloaded tensor
its bytes from its reload on.

Host memory: under ``memory_limit`` the fit gives each program a share of the process's pinned host
limit, over its calls per step (``host_bytes``), and the plan keeps within it. Without it, how many
programs' copies are alive together is known only when the step runs, so the executor holds each
copy against the host limit there, and keeps on the device what would pass it
(executors/offload.py).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceTag, tracectx
from thunder.core.transforms import (
    _update_backward_with_new_saved_for_backward,
    _update_forward_with_new_saved_for_backward,
)

from thunder_memopt.core.cost import DeviceRates, op_seconds
from thunder_memopt.core.memory import is_parameter, storage_roots, tensor_nbytes
from thunder_memopt.core.trace import (
    forward_outputs,
    is_bookkeeping,
    replace_bound_symbols,
    saved_proxies,
    strip_deletions,
    tensor_outs,
    trace_inputs,
)
from thunder_memopt.executors.offload import (
    host_copy_proxy,
    offload,
    offload_release,
    offload_wait,
    pinned_block_bytes,
    reload,
    wait_reload,
)

__all__ = ["OffloadMode", "OffloadPlan", "plan_offload", "apply_offload", "MIN_BYTES"]

# Smaller saved tensors are kept: a copy's fixed cost outweighs what it frees.
MIN_BYTES = 1 << 20
# Backwards in a row over which a chained pair's reloads are simulated (``_exposed``).
_CHAINED_BACKWARDS = 3


class OffloadMode(enum.Enum):
    OFF = "off"
    AUTO = "auto"  # only copies that hide behind compute
    BUDGET = "budget"  # and, largest first, what keeps no more than the budget's share on the GPU


@dataclass(frozen=True)
class OffloadPlan:
    """What a pair's forward offloads, and what the cost model expects of it."""

    offloaded: tuple[str, ...]  # saved tensors, in forward order
    # For each: the index, among the forward's computing symbols, after which its stream waits for
    # the copy and frees the tensor (-1: before the first), or, if spilled, releases it to the copy.
    released_after: tuple[int, ...]
    # Those whose copies are expected to end after the forward: released without a wait.
    spilled: tuple[str, ...]
    offloaded_bytes: int
    kept_bytes: int  # saved activation bytes that stay on the GPU
    pinned_bytes: int  # the host memory the copies take, each as the pinned allocator rounds it
    to_host_hidden: bool  # every copy to the host ends before the forward does
    # The backward's wait for reloads beyond its compute (in the steady state of a chain of
    # backwards where the pair's is chained: ``_exposed``).
    exposed_seconds: float
    # What the plan was made for, to hold against a profile of the step: the device's rates, the
    # forward's compute on their roofline, and when its last copy to the host ends on that clock.
    rates: DeviceRates
    forward_seconds: float
    to_host_end_seconds: float


@dataclass(frozen=True)
class _Candidate:
    name: str
    nbytes: int
    produced: int  # index of its producer among the forward's computing symbols (-1: an input)
    last_read: int  # index of its last forward reader (its producer's if none)
    first_read: int  # index of its first reader among the backward's computing symbols


@dataclass(frozen=True)
class _Pair:
    """A forward and its backward as the plan reads them: their computing symbols, and the seconds
    of compute before each (one more entry: the total)."""

    forward: tuple[BoundSymbol, ...]
    backward: tuple[BoundSymbol, ...]
    forward_times: tuple[float, ...]
    backward_times: tuple[float, ...]

    @classmethod
    def of(cls, forward: TraceCtx, backward: TraceCtx, rates: DeviceRates) -> _Pair:
        fw, bw = _computing(forward), _computing(backward)
        return cls(fw, bw, _timeline(fw, rates), _timeline(bw, rates))


def _computing(trace: TraceCtx) -> tuple[BoundSymbol, ...]:
    return tuple(b for b in strip_deletions(trace).bound_symbols if not is_bookkeeping(b))


def _timeline(bsyms: Sequence[BoundSymbol], rates: DeviceRates) -> tuple[float, ...]:
    times, now = [], 0.0
    for b in bsyms:
        times.append(now)
        now += op_seconds(b, rates)
    times.append(now)
    return tuple(times)


def _first_and_last_reads(bsyms: Sequence[BoundSymbol]) -> tuple[dict[str, int], dict[str, int]]:
    """The index of each proxy's first and last computing reader among ``bsyms``."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, b in enumerate(bsyms):
        if is_bookkeeping(b):
            continue
        for a in b.flat_proxy_args:
            name = getattr(a, "name", None)
            first.setdefault(name, i)
            last[name] = i
    return first, last


def _candidates(forward: TraceCtx, pair: _Pair, min_bytes: int) -> tuple[list[_Candidate], int]:
    """The saved tensors that may be offloaded (see the module docstring), and the saved activation
    bytes."""
    saved, _ = saved_proxies(forward)
    infos = storage_roots(forward)
    inputs = {t.name: t for t in trace_inputs(forward)}
    outputs = set(forward_outputs(forward))
    producer = {o.name: i for i, b in enumerate(pair.forward) for o in tensor_outs(b)}
    _, last_forward_read = _first_and_last_reads(pair.forward)
    first_backward_read, _ = _first_and_last_reads(pair.backward)
    storages = [infos[t.name].storage for t in saved]
    savers = collections.Counter(storages)
    activation_bytes = sum({s: infos[s].nbytes for t, s in zip(saved, storages)
                            if not is_parameter(inputs.get(s, t))}.values())
    candidates = []
    for t, storage in zip(saved, storages):
        made = producer.get(t.name, -1)
        # A received tensor that needs no gradient (a rope table, a mask) is the caller's to hold.
        held_by_caller = made < 0 and not t.requires_grad
        if (storage != t.name or savers[storage] > 1 or is_parameter(t) or t.name in outputs
                or held_by_caller or tensor_nbytes(t) < min_bytes or t.name not in first_backward_read):
            continue
        candidates.append(_Candidate(t.name, tensor_nbytes(t), made, max(made, last_forward_read.get(t.name, made)),
                                     first_backward_read[t.name]))
    return candidates, activation_bytes


def _to_host_ends(chosen: Sequence[_Candidate], pair: _Pair, rates: DeviceRates) -> list[tuple[_Candidate, float]]:
    """Each copy to the host with the forward seconds at which it ends: the copies run one after
    another on one stream, each from its producer's end, in the order they were made."""
    times, end, ends = pair.forward_times, 0.0, []
    for c in sorted(chosen, key=lambda c: c.produced):
        end = max(end, times[c.produced + 1]) + c.nbytes / rates.to_host
        ends.append((c, end))
    return ends


def _to_host(ends: Sequence[tuple[_Candidate, float]], pair: _Pair) -> tuple[dict[str, int], set[str]]:
    """Where the forward lets each tensor go, and which copies spill past its end, from the copies'
    ends (``_to_host_ends``). A copy that ends within the forward is waited for after the first
    computing symbol, from the last reader on, by whose end it has ended; a spilling one is released
    to its copy right after the last reader."""
    times, where, spilled = pair.forward_times, {}, set()
    for c, end in ends:
        if end > times[-1]:
            spilled.add(c.name)
            where[c.name] = c.last_read
        else:
            where[c.name] = next(i for i in range(max(c.last_read, 0), len(pair.forward)) if times[i + 1] >= end)
    return where, spilled


def _exposed(chosen: Sequence[_Candidate], pair: _Pair, rates: DeviceRates, *, chained: bool = False
             ) -> tuple[bool, float]:
    """(every copy to the host ends within the forward, seconds the backward waits for reloads).

    The backward asks for its first reload at its top and for each next one before the first
    reader of the one before; the executor starts each reload when the one before it is asked for
    (a prefetch), the first at the top. ``chained`` (``_is_chained``): the backward runs after the
    backwards of programs like it, and the prefetch crosses programs
    (``executors.offload.next_to_prefetch``), so the first reload starts during the backward
    before. That is simulated over ``_CHAINED_BACKWARDS`` backwards in a row, the last one's wait
    counted: reloads that take longer than a backward pile up and show there."""
    hidden = all(end <= pair.forward_times[-1] for _, end in _to_host_ends(chosen, pair, rates))
    times = pair.backward_times
    by_use = sorted(chosen, key=lambda c: c.first_read)
    end = delay = started = waited = 0.0
    for backward in range(_CHAINED_BACKWARDS if chained else 1):
        top, waited = backward * times[-1], 0.0
        for j, c in enumerate(by_use):
            asked = top + (0.0 if j == 0 else times[by_use[j - 1].first_read]) + delay
            # Started when the one before was asked for (in a chain, this backward's first during
            # the backward before; the very first at the top, 0).
            end = max(end, started) + c.nbytes / rates.to_device
            started = asked
            wait = max(0.0, end - (top + times[c.first_read] + delay))
            delay += wait
            waited += wait
    return hidden, waited


def _is_chained(forward: TraceCtx, backward: TraceCtx) -> bool:
    """Whether the pair's backward runs after the backward of a program like it: its forward takes
    an activation that needs a gradient, and its backward receives the gradient of an output that
    is not a scalar (a Block's, one program per Block under FSDP2), rather than the forward taking
    only token ids or the backward starting from the loss."""
    takes = any(t.requires_grad and not is_parameter(t) for t in trace_inputs(forward))
    cotangents, _ = tree_flatten(backward.args[1])
    return takes and any(isinstance(t, TensorProxy) and t.ndim > 0 for t in cotangents)


def plan_offload(forward: TraceCtx, backward: TraceCtx, *, mode: OffloadMode, budget: float,
                 rates: DeviceRates, min_bytes: int | None = None, host_bytes: int | None = None) -> OffloadPlan:
    """Which saved tensors of the pair to offload, and where the forward lets each go (see the
    module docstring); ``min_bytes``, the smallest tensor offloaded, defaults to ``MIN_BYTES`` (read
    when called). ``host_bytes``: the host memory one run of the pair's copies may take (the fit's
    share of the pinned host limit); a tensor whose copy would pass it stays on the device."""
    pair = _Pair.of(forward, backward, rates)
    chained = _is_chained(forward, backward)
    candidates, activation_bytes = _candidates(forward, pair, MIN_BYTES if min_bytes is None else min_bytes)
    largest_first = sorted(candidates, key=lambda c: -c.nbytes)
    chosen: list[_Candidate] = []
    pinned = 0  # the chosen copies' host bytes, each as the pinned allocator rounds it (as the executor counts)

    def chose_where_host_holds(c: _Candidate) -> bool:
        nonlocal pinned
        if host_bytes is not None and pinned + pinned_block_bytes(c.nbytes) > host_bytes:
            return False
        chosen.append(c)
        pinned += pinned_block_bytes(c.nbytes)
        return True

    if mode is not OffloadMode.OFF:
        for c in largest_first:
            hidden, delay = _exposed([*chosen, c], pair, rates, chained=chained)
            if hidden and delay == 0.0:
                chose_where_host_holds(c)
    if mode is OffloadMode.BUDGET:
        kept = activation_bytes - sum(c.nbytes for c in chosen)
        for c in largest_first:
            if kept <= budget * activation_bytes:
                break
            if c not in chosen and chose_where_host_holds(c):
                kept -= c.nbytes
    chosen.sort(key=lambda c: c.produced)
    hidden, delay = _exposed(chosen, pair, rates, chained=chained)
    ends = _to_host_ends(chosen, pair, rates)
    released, spilled = _to_host(ends, pair)
    offloaded = sum(c.nbytes for c in chosen)
    return OffloadPlan(
        offloaded=tuple(c.name for c in chosen),
        released_after=tuple(released[c.name] for c in chosen),
        spilled=tuple(c.name for c in chosen if c.name in spilled),
        offloaded_bytes=offloaded,
        kept_bytes=activation_bytes - offloaded,
        pinned_bytes=pinned,
        to_host_hidden=hidden,
        exposed_seconds=delay,
        rates=rates,
        forward_seconds=pair.forward_times[-1],
        to_host_end_seconds=max((end for _, end in ends), default=0.0),
    )


def apply_offload(forward: TraceCtx, backward: TraceCtx, plan: OffloadPlan) -> tuple[TraceCtx, TraceCtx]:
    """The pair with ``plan``'s tensors offloaded: the forward copies each to the host after its
    producer, waits for the copy (or releases a spilled one to it) where the plan says and saves
    the copy; the backward reloads it (one reload ahead) and waits for it before its first reader."""
    if TraceTag.BACKWARD not in backward.tags:
        raise ValueError("apply_offload needs a forward and its backward trace")
    if not plan.offloaded:
        return forward, backward
    saved, others = saved_proxies(forward)
    received, received_others = backward.args[0]
    if [t.name for t in received] != [t.name for t in saved]:
        raise RuntimeError("thunder_memopt offload: the backward does not receive what its forward saves")
    by_name = {t.name: t for t in saved}
    with tracectx(forward):  # named in the forward, whose copies below know the names
        host = {n: host_copy_proxy(by_name[n]) for n in plan.offloaded}
    new_saved = [host.get(t.name, t) for t in saved]
    first_read, _ = _first_and_last_reads(backward.bound_symbols)
    by_use = sorted(plan.offloaded, key=first_read.__getitem__)
    return (_offloading_forward(forward, plan, by_name, host, [*new_saved, *others], by_use),
            _reloading_backward(backward, by_name, host, [*new_saved, *received_others], by_use))


def _offloading_forward(forward: TraceCtx, plan: OffloadPlan, by_name: dict[str, TensorProxy],
                        host: dict[str, TensorProxy], saved: list, by_use: list[str]) -> TraceCtx:
    fw = strip_deletions(forward)
    rank = {n: i for i, n in enumerate(by_use)}
    with tracectx(fw):
        # The plan's order is the order the copies run in: its first opens the call's group.
        copies = {n: offload.bind(by_name[n], rank[n], n == plan.offloaded[0], output=host[n])
                  for n in plan.offloaded}
        releases = {n: (offload_release if n in plan.spilled else offload_wait).bind(host[n], output=None)
                    for n in plan.offloaded}
    computing = [b for b in fw.bound_symbols if not is_bookkeeping(b)]
    produced = {o.name for b in computing for o in tensor_outs(b)}
    after: dict[int, list[BoundSymbol]] = {}  # by id of a computing symbol
    for n, i in zip(plan.offloaded, plan.released_after):
        after.setdefault(id(computing[i]) if i >= 0 else None, []).append(releases[n])
    # A received tensor's copy (and a release planned before any computation) ahead of the first
    # computing symbol; every other copy right after its producer.
    ahead = [copies[n] for n in plan.offloaded if n not in produced] + after.pop(None, [])
    placed: list[BoundSymbol] = []
    for b in fw.bound_symbols[:-1]:
        if not is_bookkeeping(b):
            placed.extend(ahead)
            ahead = []
        placed.append(b)
        placed.extend(copies[o.name] for o in tensor_outs(b) if o.name in copies and not is_bookkeeping(b))
        placed.extend(after.get(id(b), ()))
    fw.bound_symbols = [*placed, *ahead, fw.bound_symbols[-1]]
    _update_forward_with_new_saved_for_backward(fw, saved)
    return replace_bound_symbols(fw, fw.bound_symbols, f"thunder_memopt offload: {len(plan.offloaded)} saved "
                                 "tensors copied to the host (forward)")


def _reloading_backward(backward: TraceCtx, by_name: dict[str, TensorProxy], host: dict[str, TensorProxy],
                        saved: list, by_use: list[str]) -> TraceCtx:
    bw = strip_deletions(backward)
    _update_backward_with_new_saved_for_backward(bw, saved)
    first_read, _ = _first_and_last_reads(bw.bound_symbols)
    # The first reload right after the unpacking of what the backward receives.
    host_names = {h.name for h in host.values()}
    unpacked = max(i for i, b in enumerate(bw.bound_symbols) for o in b.flat_proxy_outs
                   if getattr(o, "name", None) in host_names)
    starts: dict[int, list[BoundSymbol]] = {}
    waits: dict[int, list[BoundSymbol]] = {}
    with tracectx(bw):
        for j, n in enumerate(by_use):
            t = by_name[n]
            loaded = TensorProxy(like=t, requires_grad=False)
            at = unpacked + 1 if j == 0 else first_read[by_use[j - 1]]
            starts.setdefault(at, []).append(reload.bind(host[n], t.device.device_str(), output=loaded))
            # The wait returns the proxy the backward reads: its readers are unchanged.
            waits.setdefault(first_read[n], []).append(wait_reload.bind(loaded, output=t))
    out: list[BoundSymbol] = []
    for i, b in enumerate(bw.bound_symbols):
        out.extend(starts.get(i, ()))
        out.extend(waits.get(i, ()))
        out.append(b)
    return replace_bound_symbols(bw, out, f"thunder_memopt offload: {len(by_use)} saved tensors "
                                 "reloaded (backward)")
