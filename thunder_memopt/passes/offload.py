"""Offload: copy saved tensors to host memory after the forward makes them, and bring them back
before the backward reads them, the third choice beside saving and recomputing.

Whatever the recompute pass leaves saved stays on the GPU from the forward to the backward; at long
context those tensors grow with every token and outnumber everything else. This pass takes the
final forward and backward of a pair and, for each saved tensor it offloads (executors/offload.py):

- the forward copies it to pinned host memory on a side stream, just after its producer, and
  returns the host copy as the saved tensor: the GPU copy is freed after its last forward reader
  (once its copy has finished);
- the backward receives the host copy, starts its reload one reload ahead, before the first
  reader of the previous reloaded tensor (the first one at the top), and waits for it just before
  its own first reader. Reloads run in the order the backward reads them.

Which tensors: saved activations that own their storage (not views, not parameters, not the
forward's own outputs, which the caller holds anyway), of at least ``min_bytes``. The choice is
made on a cost model (``core.cost``): the copies run one after another on one stream, the forward's
while it computes, the backward's behind the compute before each first reader; a copy hides when it
ends before it is needed. ``OffloadMode``: ``auto`` offloads only what hides; ``budget`` also
offloads, largest first, what it must for at most ``activation_budget`` of the saved bytes to stay
on the GPU (all of it at budget 0.0).

The memory model counts what is on the GPU: a host copy takes no device bytes, a reloaded tensor
its bytes from its reload on.
"""

from __future__ import annotations

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
    is_bookkeeping,
    replace_bound_symbols,
    saved_proxies,
    strip_deletions,
    tensor_outs,
    trace_inputs,
)
from thunder_memopt.executors.offload import host_copy_proxy, offload, reload, wait_reload

__all__ = ["OffloadMode", "OffloadPlan", "plan_offload", "apply_offload", "MIN_BYTES"]

# Smaller saved tensors are kept: a copy's fixed cost outweighs what it frees.
MIN_BYTES = 1 << 20


class OffloadMode(enum.Enum):
    OFF = "off"
    AUTO = "auto"  # only copies that hide behind compute
    BUDGET = "budget"  # and, largest first, what keeps no more than the budget's share on the GPU


@dataclass(frozen=True)
class OffloadPlan:
    """What a pair's forward offloads, and what the cost model expects of it."""

    offloaded: tuple[str, ...]  # saved tensors, in forward order
    offloaded_bytes: int
    kept_bytes: int  # saved activation bytes that stay on the GPU
    to_host_hidden: bool  # every copy to the host ends before the forward does
    exposed_seconds: float  # the backward's wait for reloads beyond its compute


@dataclass(frozen=True)
class _Candidate:
    name: str
    nbytes: int
    produced_at: float  # forward seconds when it exists (0 for an input)
    first_read: int  # index of its first reader among the backward's symbols


def _flat_output_names(forward: TraceCtx) -> set[str]:
    flat, _ = tree_flatten(forward.bound_symbols[-1].args[0])
    return {t.name for t in flat if isinstance(t, TensorProxy)}


def _timeline(bsyms: Sequence[BoundSymbol], rates: DeviceRates) -> list[float]:
    """Seconds of compute before each symbol, and the total at the end."""
    times, now = [], 0.0
    for b in bsyms:
        times.append(now)
        now += op_seconds(b, rates)
    times.append(now)
    return times


def _candidates(forward: TraceCtx, backward: TraceCtx, rates: DeviceRates, min_bytes: int
                ) -> tuple[list[_Candidate], int, list[float]]:
    """The saved tensors that may be offloaded, the saved activation bytes, and the backward's
    timeline (see the module docstring for which may)."""
    saved, _ = saved_proxies(forward)
    infos = storage_roots(forward)
    inputs = {t.name: t for t in trace_inputs(forward)}
    outputs = _flat_output_names(forward)
    fw = [b for b in strip_deletions(forward).bound_symbols if not is_bookkeeping(b)]
    fw_times = _timeline(fw, rates)
    produced = {o.name: fw_times[i + 1] for i, b in enumerate(fw) for o in tensor_outs(b)}
    bw = [b for b in strip_deletions(backward).bound_symbols if not is_bookkeeping(b)]
    first_read: dict[str, int] = {}
    for i, b in enumerate(bw):
        for a in b.flat_proxy_args:
            first_read.setdefault(getattr(a, "name", None), i)
    storages = [infos[t.name].storage for t in saved]
    activation_bytes = sum({infos[t.name].storage: infos[infos[t.name].storage].nbytes for t in saved
                            if not is_parameter(inputs.get(infos[t.name].storage, t))}.values())
    candidates = []
    for t, storage in zip(saved, storages):
        if (storage != t.name or storages.count(storage) > 1 or is_parameter(t) or t.name in outputs
                or tensor_nbytes(t) < min_bytes or t.name not in first_read):
            continue
        candidates.append(_Candidate(t.name, tensor_nbytes(t), produced.get(t.name, 0.0), first_read[t.name]))
    return candidates, activation_bytes, _timeline(bw, rates)


def _simulate(chosen: Sequence[_Candidate], forward_seconds: float, bw_times: Sequence[float],
              rates: DeviceRates) -> tuple[bool, float]:
    """(every copy to the host ends within the forward, seconds the backward waits for reloads)."""
    free = 0.0
    for c in sorted(chosen, key=lambda c: c.produced_at):
        free = max(free, c.produced_at) + c.nbytes / rates.to_host
    hidden = free <= forward_seconds
    by_use = sorted(chosen, key=lambda c: c.first_read)
    free = delay = 0.0
    for j, c in enumerate(by_use):
        issued = 0.0 if j == 0 else bw_times[by_use[j - 1].first_read] + delay
        free = max(free, issued) + c.nbytes / rates.to_device
        needed = bw_times[c.first_read] + delay
        delay += max(0.0, free - needed)
    return hidden, delay


def plan_offload(forward: TraceCtx, backward: TraceCtx, *, mode: OffloadMode, budget: float,
                 rates: DeviceRates, min_bytes: int | None = None) -> OffloadPlan:
    """Which saved tensors of the pair to offload (see the module docstring); ``min_bytes``, the
    smallest tensor offloaded, defaults to ``MIN_BYTES`` (read when called)."""
    candidates, activation_bytes, bw_times = _candidates(forward, backward, rates,
                                                         MIN_BYTES if min_bytes is None else min_bytes)
    fw = [b for b in strip_deletions(forward).bound_symbols if not is_bookkeeping(b)]
    forward_seconds = _timeline(fw, rates)[-1]
    chosen: list[_Candidate] = []
    if mode is not OffloadMode.OFF:
        for c in sorted(candidates, key=lambda c: -c.nbytes):
            hidden, delay = _simulate([*chosen, c], forward_seconds, bw_times, rates)
            if hidden and delay == 0.0:
                chosen.append(c)
    if mode is OffloadMode.BUDGET:
        allowed = budget * activation_bytes
        for c in sorted(candidates, key=lambda c: -c.nbytes):
            if activation_bytes - sum(x.nbytes for x in chosen) <= allowed:
                break
            if c not in chosen:
                chosen.append(c)
    hidden, delay = _simulate(chosen, forward_seconds, bw_times, rates)
    order = {t.name: i for i, t in enumerate(saved_proxies(forward)[0])}
    offloaded = sum(c.nbytes for c in chosen)
    return OffloadPlan(
        offloaded=tuple(sorted((c.name for c in chosen), key=order.__getitem__)),
        offloaded_bytes=offloaded,
        kept_bytes=activation_bytes - offloaded,
        to_host_hidden=hidden,
        exposed_seconds=delay,
    )


def apply_offload(forward: TraceCtx, backward: TraceCtx, plan: OffloadPlan) -> tuple[TraceCtx, TraceCtx]:
    """The pair with ``plan``'s tensors offloaded: the forward copies each to the host after its
    producer and saves the copy, the backward reloads it (one reload ahead) and waits for it before
    its first reader."""
    if TraceTag.BACKWARD not in backward.tags:
        raise ValueError("apply_offload needs a forward and its backward trace")
    if not plan.offloaded:
        return forward, backward
    names = set(plan.offloaded)
    saved, others = saved_proxies(forward)
    received, received_others = backward.args[0]
    if [t.name for t in received] != [t.name for t in saved]:
        raise RuntimeError("thunder_memopt offload: the backward does not receive what its forward saves")

    fw = strip_deletions(forward)
    host: dict[str, TensorProxy] = {}
    copies: dict[str, BoundSymbol] = {}
    with tracectx(fw):
        for t in saved:
            if t.name in names:
                host[t.name] = host_copy_proxy(t)
                copies[t.name] = offload.bind(t, output=host[t.name])
    # Each copy right after its producer; a received tensor's before the first computation.
    produced = {o.name for b in fw.bound_symbols if not is_bookkeeping(b) for o in tensor_outs(b)}
    received_first = [copies[n] for n in plan.offloaded if n not in produced]
    placed: list[BoundSymbol] = []
    for b in fw.bound_symbols[:-1]:
        if is_bookkeeping(b):
            placed.append(b)
            continue
        placed.extend(received_first)
        received_first = []
        placed.append(b)
        placed.extend(copies[o.name] for o in tensor_outs(b) if o.name in copies)
    fw.bound_symbols = [*placed, *received_first, fw.bound_symbols[-1]]
    new_saved = [host.get(t.name, t) for t in saved]
    _update_forward_with_new_saved_for_backward(fw, [*new_saved, *others])
    new_forward = replace_bound_symbols(fw, fw.bound_symbols, f"thunder_memopt offload: {len(names)} saved "
                                        "tensors copied to the host (forward)")

    bw = strip_deletions(backward)
    _update_backward_with_new_saved_for_backward(bw, [*new_saved, *received_others])
    by_name = {t.name: t for t in saved}
    first_read: dict[str, int] = {}
    for i, b in enumerate(bw.bound_symbols):
        if is_bookkeeping(b):
            continue
        for a in b.flat_proxy_args:
            if getattr(a, "name", None) in names:
                first_read.setdefault(a.name, i)
    by_use = sorted(names, key=first_read.__getitem__)
    # The first reload right after the unpacking of what the backward receives.
    unpacked = max(i for i, b in enumerate(bw.bound_symbols) for o in b.flat_proxy_outs
                   if getattr(o, "name", None) in {host[n].name for n in names})
    starts: dict[int, list[BoundSymbol]] = {}
    waits: dict[int, list[BoundSymbol]] = {}
    with tracectx(bw):
        for j, n in enumerate(by_use):
            t = by_name[n]
            device = t.device.device_str()
            loaded = TensorProxy(like=t, requires_grad=False)
            at = unpacked + 1 if j == 0 else first_read[by_use[j - 1]]
            starts.setdefault(at, []).append(reload.bind(host[n], device, output=loaded))
            # The wait returns the proxy the backward reads: its readers are unchanged.
            waits.setdefault(first_read[n], []).append(wait_reload.bind(loaded, output=t))
    out: list[BoundSymbol] = []
    for i, b in enumerate(bw.bound_symbols):
        out.extend(starts.get(i, ()))
        out.extend(waits.get(i, ()))
        out.append(b)
    new_backward = replace_bound_symbols(bw, out, f"thunder_memopt offload: {len(names)} saved tensors "
                                         "reloaded (backward)")
    return new_forward, new_backward
