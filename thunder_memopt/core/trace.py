"""Trace utilities shared by every pass: a bound symbol's tensors, the trace's inputs and saved
tensors, and the rewrites the passes make of whole traces.

Every pass that changes a trace goes through ``replace_bound_symbols``, which re-places Thunder's
deletions (``del_last_used``) and stamps the rewrite's provenance. A ``SavedSetChange`` changes
what a forward saves for its backward (``save_in_forward``) and what the backward replays instead
(``replay_in_backward``): the recompute pass's plans and the collectives pass's ZeRO-3 plan are
changes of this one kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, TraceTag, from_trace
from thunder.core.transforms import (
    _update_backward_with_new_saved_for_backward,
    _update_forward_with_new_saved_for_backward,
)
from thunder.executors.passes import del_last_used

from thunder_memopt.core.ops import HEAD_LOGITS_GRAD, OpKind, op_kind

__all__ = [
    "DELETION_NAMES",
    "UNPACK_IDS",
    "is_bookkeeping",
    "tensor_args",
    "tensor_outs",
    "source_of",
    "trace_inputs",
    "received_tensors",
    "saved_proxies",
    "forward_outputs",
    "unmade_cotangents",
    "strip_deletions",
    "replace_bound_symbols",
    "save_in_forward",
    "replay_in_backward",
    "SavedSetChange",
]

# Bound symbols that allocate nothing and are not computation.
_BOOKKEEPING_IDS = {
    prims.PrimIDs.RETURN,
    prims.PrimIDs.UNPACK_TRIVIAL,
    prims.PrimIDs.UNPACK_SEQUENCE,
    prims.PrimIDs.UNPACK_KEY,
    prims.PrimIDs.UNPACK_EMPTY_DICT,
    prims.PrimIDs.DEL,
}
UNPACK_IDS = (prims.PrimIDs.UNPACK_SEQUENCE, prims.PrimIDs.UNPACK_TRIVIAL)
DELETION_NAMES = {"python_del", "del", "clear_mutable_collection"}


def is_bookkeeping(bsym: BoundSymbol) -> bool:
    """Unpacking, return and deletion: symbols that compute nothing."""
    return bsym.sym.id in _BOOKKEEPING_IDS or bsym.sym.name in DELETION_NAMES


def tensor_args(bsym: BoundSymbol) -> list[TensorProxy]:
    return [a for a in bsym.flat_proxy_args if isinstance(a, TensorProxy)]


def tensor_outs(bsym: BoundSymbol) -> list[TensorProxy]:
    return [o for o in bsym.flat_proxy_outs if isinstance(o, TensorProxy)]


def source_of(bsym: BoundSymbol) -> str | None:
    if bsym.source_filename is None:
        return None
    line = bsym.source_positions.lineno if bsym.source_positions is not None else "?"
    return f"{bsym.source_filename}:{line}"


def trace_inputs(trace: TraceCtx) -> list[TensorProxy]:
    """The tensor proxies a trace receives: its arguments, including those inside collections."""
    flat, _ = tree_flatten((trace.args, trace.kwargs))
    return [a for a in flat if isinstance(a, TensorProxy)]


def received_tensors(trace: TraceCtx, bsyms: Sequence[BoundSymbol] | None = None) -> list[TensorProxy]:
    """The tensors a trace receives: its arguments and, in a backward trace, the saved tensors that
    its unpacking introduces."""
    bsyms = trace.bound_symbols if bsyms is None else bsyms
    unpacked = [o for b in bsyms if b.sym.id in UNPACK_IDS for o in tensor_outs(b)]
    return trace_inputs(trace) + unpacked


def saved_proxies(forward_trace: TraceCtx) -> tuple[list, list]:
    """The (tensors, others) that a forward trace returns for backward."""
    ret = forward_trace.bound_symbols[-1]
    if ret.sym.id != prims.PrimIDs.RETURN or TraceTag.AUGMENTED_FORWARD not in forward_trace.tags:
        raise ValueError("not an augmented forward trace: it returns nothing for backward")
    tensors, others = ret.args[1]
    return list(tensors), list(others)


def forward_outputs(forward_trace: TraceCtx) -> list[str]:
    """The names of the tensors an augmented forward trace returns to its caller (its
    ``flat_output``; its ``flat_args`` are what it received)."""
    flat, _ = tree_flatten(forward_trace.bound_symbols[-1].args[0].get("flat_output", ()))
    return [t.name for t in flat if isinstance(t, TensorProxy)]


# Reshapes as the backward runs them: Thunder's prim, its torch implementation, torch's ops.
_RESHAPE_NAMES = {"torch_prims_reshape_impl", "reshape", "view"}


def unmade_cotangents(backward_trace: TraceCtx) -> dict[int, TensorProxy]:
    """The backward's cotangents, by their position (that of the forward's output in its
    ``flat_output``), that reach nothing but the fused head's argument for the gradient of the model's
    logits (``HEAD_LOGITS_GRAD``), through reshapes each read once. Where the caller never used such an
    output, its gradient is not made (executors.unmade_gradients): the memory model counts none of
    its bytes."""
    if TraceTag.BACKWARD not in backward_trace.tags or len(backward_trace.args) < 2:
        return {}
    bsyms = [b for b in backward_trace.bound_symbols if b.sym.name not in DELETION_NAMES]
    if not any(b.sym.name in HEAD_LOGITS_GRAD for b in bsyms):  # most backwards: no walk
        return {}
    position = {t.name: i for i, t in enumerate(backward_trace.args[1]) if isinstance(t, TensorProxy)}
    readers: dict[str, int] = {}
    producer: dict[str, BoundSymbol] = {}
    for b in bsyms:
        for a in {a.name for a in b.flat_proxy_args}:
            readers[a] = readers.get(a, 0) + 1
        producer.update((o.name, b) for o in b.flat_proxy_outs)
    found = {}
    for b in bsyms:
        index = HEAD_LOGITS_GRAD.get(b.sym.name)
        t = b.args[index] if index is not None and len(b.args) > index else None
        while isinstance(t, TensorProxy) and readers.get(t.name) == 1:
            if t.name in position:
                found[position[t.name]] = t
                break
            reshape = producer.get(t.name)
            if reshape is None or not (reshape.sym.id == prims.PrimIDs.RESHAPE or reshape.sym.name in _RESHAPE_NAMES):
                break
            t = reshape.flat_proxy_args[0]
    return found


def strip_deletions(trace: TraceCtx) -> TraceCtx:
    """A copy of the trace without ``del`` and ``clear_mutable_collection``, ready to reorder."""
    new = from_trace(trace)
    new.bound_symbols = [b for b in trace.bound_symbols if b.sym.name not in DELETION_NAMES]
    return new


def replace_bound_symbols(
    trace: TraceCtx, bsyms: Sequence[BoundSymbol], provenance: str, *, deletions: bool = True
) -> TraceCtx:
    """A copy of ``trace`` with new bound symbols, deletions re-inserted by ``del_last_used``; without
    them if not ``deletions`` (a trace only to be priced: the memory model ignores deletions)."""
    new = from_trace(trace)
    new.bound_symbols = [b for b in bsyms if b.sym.name not in DELETION_NAMES]
    new.set_provenance(TraceProvenance(provenance))
    if not deletions:
        return new
    is_backward = TraceTag.BACKWARD in trace.tags
    out = del_last_used(new, clear_mutable_collections=is_backward)
    out.set_provenance(TraceProvenance(provenance))
    return out


def save_in_forward(
    forward_trace: TraceCtx, saved: Sequence[TensorProxy], *, what: str, deletions: bool = True
) -> TraceCtx:
    """The forward returning ``saved`` as its saved tensors, deletions placed anew (unless not
    ``deletions``: a trace only to be priced)."""
    new = strip_deletions(forward_trace)
    _, others = saved_proxies(forward_trace)
    _update_forward_with_new_saved_for_backward(new, [*saved, *others])
    return replace_bound_symbols(new, new.bound_symbols, f"thunder_memopt {what}: new saved set (forward)",
                                 deletions=deletions)


def replay_in_backward(
    backward_trace: TraceCtx,
    *,
    key: Sequence[str],
    saved: Sequence[TensorProxy],
    replayed: Sequence[BoundSymbol],
    what: str,
    deletions: bool = True,
) -> TraceCtx:
    """The backward receiving ``saved`` instead of ``key`` and running each of ``replayed`` (forward
    symbols, in forward order) just before the first symbol that reads what it produces; deletions
    placed anew unless not ``deletions``: a trace only to be priced, which shares the replayed
    symbols with the forward rather than running copies of them."""
    if TraceTag.BACKWARD not in backward_trace.tags:
        raise ValueError("replay_in_backward needs a backward trace")
    saved_tensors, saved_others = backward_trace.args[0]
    received = tuple(t.name for t in saved_tensors)
    if received != tuple(key):
        raise RuntimeError(
            "thunder_memopt: the backward trace does not receive the tensors its forward saved "
            f"({len(received)} received, {len(key)} saved); refusing to {what}"
        )
    new = strip_deletions(backward_trace)
    _update_backward_with_new_saved_for_backward(new, [*saved, *saved_others])
    # Shared, a symbol's flattened arguments are read once for every rung the ladder prices.
    copy = BoundSymbol.from_bsym if deletions else lambda b: b
    producer = {o.name: b for b in replayed for o in b.flat_proxy_outs if hasattr(o, "name")}
    position = {id(b): i for i, b in enumerate(replayed)}
    emitted: set[int] = set()
    # A fused backward can compute some forward values itself (Thunder splits a joint trace whose
    # regions hold them): what it has computed by then is not replayed again.
    available: set[str] = set()
    out: list[BoundSymbol] = []
    for bsym in new.bound_symbols:
        outs = [o.name for o in bsym.flat_proxy_outs if hasattr(o, "name")]
        if outs and available.issuperset(outs) and op_kind(bsym) is OpKind.CHEAP:
            continue  # the backward's own later copy of a value replayed already
        for b in sorted(_replay_chain(bsym, producer, emitted, available), key=lambda b: position[id(b)]):
            emitted.add(id(b))
            out.append(copy(b))
            available.update(o.name for o in b.flat_proxy_outs if hasattr(o, "name"))
        out.append(bsym)
        available.update(outs)
    return replace_bound_symbols(new, out, f"thunder_memopt {what}: replay in backward", deletions=deletions)


def _replay_chain(
    bsym: BoundSymbol, producer: dict[str, BoundSymbol], emitted: set[int], available: set[str]
) -> list[BoundSymbol]:
    """The not-yet-emitted replayed symbols that ``bsym`` reads, transitively (futures included),
    short of what is ``available`` already."""
    chain: dict[int, BoundSymbol] = {}
    # Most symbols read nothing replayed: only names a replayed symbol makes start the walk.
    stack = [a.name for a in bsym.flat_proxy_args if getattr(a, "name", None) in producer and a.name not in available]
    while stack:
        name = stack.pop()
        p = None if name in available else producer.get(name)
        if p is None or id(p) in emitted or id(p) in chain:
            continue
        chain[id(p)] = p
        stack.extend(a.name for a in p.flat_proxy_args if hasattr(a, "name"))
    return list(chain.values())


@dataclass(frozen=True)
class SavedSetChange:
    """A change of what a forward saves for its backward: the forward saves ``saved`` in place of
    ``key`` (what it saved before, which the backward receives), and the backward replays
    ``replayed`` (forward symbols, in forward order), each just before its first reader, to make
    again what is no longer saved. A subclass names the change in the rewritten traces' provenance."""

    key: tuple[str, ...]
    saved: tuple[TensorProxy, ...]
    replayed: tuple[BoundSymbol, ...]

    forward_what: ClassVar[str]
    backward_what: ClassVar[str]

    def apply_to_forward(self, forward_trace: TraceCtx, *, deletions: bool = True) -> TraceCtx:
        """The forward saving ``saved`` (see ``save_in_forward``)."""
        return save_in_forward(forward_trace, self.saved, what=self.forward_what, deletions=deletions)

    def apply_to_backward(self, backward_trace: TraceCtx, *, deletions: bool = True) -> TraceCtx:
        """The backward receiving ``saved`` and replaying ``replayed`` (see ``replay_in_backward``)."""
        return replay_in_backward(backward_trace, key=self.key, saved=self.saved, replayed=self.replayed,
                                  what=self.backward_what, deletions=deletions)
