"""Donated buffers: a fusion region writes an output into the memory of an input that dies there.

A backward's saved tensors die one by one, most of them in a fusion region that reads them for the
last time: SwiGLU's gradient reads the MLP's two fc outputs and writes two gradients of their size.
Thunder allocates every region output anew, so at that region inputs and outputs are alive
together; inductor's compiled backwards reuse such inputs ("donated buffers"). This pass ends each
such region with ``copy_(output's value, input)``: inductor then stores the output straight into the
input's memory (one kernel, no temporary), and the memory model counts the output as the input's
storage (``core.memory``: a region's in-place copy returns its target). The values are the ones
the region computed: numerics do not change.

An input is donated only where the caller can hold no other reference to its storage: in a
forward, a storage the forward makes; in a backward, one it makes, or that of a saved tensor its
forward made for the backward alone (not returned to the caller, not received, its storage's only
tensor, saved once). The input is that storage's tensor or a view of all of it (a matmul's output reshaped
for the next op, as the gradient entering SwiGLU's is). Nothing may read the storage after the
region, through the input or any other of its tensors, none of them may be returned, and none may
be read by a side effect or a collective: a copy to the host (offload) or a collective may still
read it on another stream when the region runs.
It goes to an output of the same shape, dtype, device and simulated strides that is its own storage.
Only regions of elementwise ops donate, and of views that only add or drop dimensions of size 1
(the traces reshape (1, T, C) to (T, C) and back, or to their own shape): there each element is
read and written at one index, so a kernel that writes an input's memory never overwrites what it
has still to read (reductions, other views and broadcasts read at other indices; inductor's C++
backend also fails on some reductions that write their input, at least on torch 2.11).
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping

from thunder.core import prims
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx

from thunder_memopt.core.memory import Strides, simulated_strides, storage_roots
from thunder_memopt.core.ops import (
    COLLECTIVE_NAMES,
    ELEMENTWISE,
    SIDE_EFFECT_NAMES,
    leaf_symbols,
    normalized,
    op_names,
)
from thunder_memopt.core.trace import (
    forward_outputs,
    is_bookkeeping,
    replace_bound_symbols,
    saved_proxies,
    tensor_args,
    tensor_outs,
    trace_inputs,
)

__all__ = ["donatable_saved", "donate_buffers"]


def donatable_saved(forward: TraceCtx) -> frozenset[str]:
    """The saved tensors of an augmented forward that its backward may donate: made by the forward,
    not returned to its caller, their storage's only tensor, saved once."""
    saved, _ = saved_proxies(forward)
    infos = storage_roots(forward)
    owners = collections.Counter(info.storage for info in infos.values())
    received = {t.name for t in trace_inputs(forward)}
    outputs = set(forward_outputs(forward))
    times_saved = collections.Counter(t.name for t in saved)
    return frozenset(t.name for t in saved
                     if t.name not in received and t.name not in outputs and times_saved[t.name] == 1
                     and infos[t.name].storage == t.name and owners[t.name] == 1)


def donate_buffers(trace: TraceCtx, fusion, *, donatable_received: Collection[str] = (),
                   received_strides: Mapping[str, Strides] | None = None) -> tuple[TraceCtx, int]:
    """``trace`` with the regions of ``fusion`` (an ``InductorFusionExecutor``) writing outputs into
    inputs that die there (see the module docstring), and how many outputs were donated a buffer.
    ``donatable_received``: received tensors that may be donated (a backward's, ``donatable_saved``);
    ``received_strides``: their strides, as ``simulated_strides`` takes them."""
    bsyms = list(trace.bound_symbols)
    computing = [(i, b) for i, b in enumerate(bsyms) if not is_bookkeeping(b)]
    last_read: dict[str, int] = {}
    for i, b in computing:
        for a in tensor_args(b):
            last_read[a.name] = i
    # Returned, or read on another stream, maybe still when a region runs (copies to the host,
    # collectives): held beyond the region.
    held = {a.name for a in tensor_args(bsyms[-1])} | {
        a.name for _, b in computing if set(op_names(b)) & (SIDE_EFFECT_NAMES | COLLECTIVE_NAMES)
        for a in tensor_args(b)}
    infos = storage_roots(trace)
    tensors_of: dict[str, list[str]] = collections.defaultdict(list)
    for info in infos.values():
        tensors_of[info.storage].append(info.name)
    strides = simulated_strides(trace, received=received_strides)
    made = {o.name for _, b in computing for o in tensor_outs(b)}
    allowed = made | set(donatable_received)

    def may_donate(t: TensorProxy, at: int) -> bool:
        # ``t`` or a view of all of its storage (a matmul's output reshaped, say): the last reader of
        # that storage, which nothing holds.
        storage = infos[t.name].storage
        sharing = tensors_of[storage]
        return (storage in allowed and last_read.get(t.name) == at and infos[t.name].nbytes == infos[storage].nbytes
                and not any(name in held for name in sharing)
                and all(last_read.get(name, -1) < at for name in sharing if name != t.name))

    donated = 0
    for i, b in computing:
        if not fusion.is_own_fusion(b) or not _index_preserving(b):
            continue
        args = {a.name: a for a in tensor_args(b)}
        # An output read within the region (a view of it returned too, say) would be computed into
        # a buffer of its own before its copy: only outputs nothing in the region reads take an input.
        read_within = {a.name for sub in b.subsymbols for a in tensor_args(sub)}
        outs = [o for o in tensor_outs(b)
                if infos[o.name].storage == o.name and o.name not in args and o.name not in read_within]
        pairs: list[tuple[TensorProxy, TensorProxy]] = []
        taken: set[str] = set()
        for a in args.values():
            if not may_donate(a, i):
                continue
            o = next((o for o in outs if o.name not in taken and _same_layout(o, a, strides)), None)
            if o is not None:
                taken.add(o.name)
                pairs.append((o, a))
        if pairs:
            bsyms[i] = _donating(trace, b, fusion, pairs)
            donated += len(pairs)
    if not donated:
        return trace, 0
    return replace_bound_symbols(trace, bsyms, f"thunder_memopt donate: {donated} region outputs written "
                                 "into inputs that die there"), donated


# Views that keep every element at its index when they only add or drop dimensions of size 1.
_UNIT_DIM_VIEWS = frozenset({"reshape", "shallow_copy", "squeeze", "unsqueeze", "view", "flatten"})


def _index_preserving(region: BoundSymbol) -> bool:
    """Whether each output element of ``region`` is computed from its inputs' elements at the same
    index: its ops are elementwise, or views that only add or drop dimensions of size 1."""
    return all(normalized(leaf.sym.name) in ELEMENTWISE or _adds_or_drops_unit_dims(leaf)
               for leaf in leaf_symbols(region))


def _adds_or_drops_unit_dims(view: BoundSymbol) -> bool:
    ins, outs = tensor_args(view), tensor_outs(view)
    return (normalized(view.sym.name) in _UNIT_DIM_VIEWS and len(ins) == 1 and len(outs) == 1
            and [n for n in ins[0].shape if n != 1] == [n for n in outs[0].shape if n != 1])


def _same_layout(o: TensorProxy, a: TensorProxy, strides: Mapping[str, Strides]) -> bool:
    """Same shape, dtype, device and strides, and no element sharing memory with another (an
    expanded dimension): each output element has an input element's memory to itself."""
    stride = strides.get(a.name)
    return (tuple(o.shape) == tuple(a.shape) and o.dtype == a.dtype and o.device == a.device
            and stride is not None and strides.get(o.name) == stride
            and all(s != 0 for n, s in zip(a.shape, stride) if n > 1))


def _donating(trace: TraceCtx, region: BoundSymbol, fusion, pairs: list[tuple[TensorProxy, TensorProxy]]
              ) -> BoundSymbol:
    """``region`` computing each donated output under a new name, then copying it into its input,
    the copy returning the output's name: the trace around it is unchanged."""
    with tracectx(trace):
        values = {o.name: TensorProxy(like=o) for o, _ in pairs}
    swap = {variableify(o): values[o.name] for o, _ in pairs}
    subsymbols = [s.from_bsym_swap_proxies(swap) for s in region.subsymbols]
    copies = [prims.copy_.bind(values[o.name], a, grad_enabled=False, output=o) for o, a in pairs]
    return fusion.region_symbol([*subsymbols, *copies], list(region.args), list(region.output))
