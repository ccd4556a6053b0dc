"""Views and strides in a Thunder trace: which outputs of a bound symbol share the storage of one of
its inputs, and the strides the memory model simulates to tell.

A view keeps its base alive, so the memory model (``core/memory.py``) asks of every output whether it
is one. Which ops return views is decided from the op names at every level of a bound symbol
(executor symbols keep the ``ltorch``/``prims`` decomposition as subsymbols), and ``reshape`` is a
view only of an input PyTorch can view, so each tensor's strides are simulated through the trace
(``simulated_strides``); a torch.compile region's outputs may view its arguments or one another
(``region_output_views``). How the model reads each symbol's outputs is its ``_Kind``. The fusion
executor compiles its regions ahead for the strides simulated here.
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from enum import Enum

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.executors.torch_compile import TorchCompileExecutor

from thunder_memopt.core.trace import DELETION_NAMES, is_bookkeeping, received_tensors, tensor_args, tensor_outs

__all__ = [
    "Strides",
    "OUTPUT_STRIDES",
    "contiguous_strides",
    "dense_strides_like",
    "view_strides",
    "region_output_views",
    "simulated_strides",
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


class _Kind(Enum):
    """How ``storage_roots`` reads a bound symbol's outputs."""

    SKIPPED = "unpacking, return or deletion"
    ALIASES = "update_aliases: each output is its input, renamed"
    INPLACE = "an in-place op: its outputs alias its target"
    REGION = "a torch.compile region, whose outputs may alias its arguments or one another"
    VIEW = "a symbol that may return views of its first argument"
    NEW = "a symbol whose outputs are new storages"


def _kind_of(bsym: BoundSymbol) -> _Kind:
    """How the memory model reads the bound symbol's outputs."""
    name = bsym.sym.name
    if is_bookkeeping(bsym):
        return _Kind.SKIPPED
    if name == "update_aliases":
        return _Kind.ALIASES
    if name in _INPLACE_TARGET:
        return _Kind.INPLACE
    if bsym.subsymbols and _torch_compile_region(bsym):
        return _Kind.REGION
    if _may_be_view(bsym):
        return _Kind.VIEW
    return _Kind.NEW


# Symbol name -> the strides of an op's outputs (by name), from the bound symbol and its inputs'
# strides, for ops whose kernels allocate outputs in another layout than contiguous (cuDNN attention's
# follow its inputs'). Fusion regions compiled ahead are compiled for these strides.
OUTPUT_STRIDES: dict[str, Callable[[BoundSymbol, Mapping[str, Strides]], dict[str, Strides]]] = {}


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
        kind = _kind_of(bsym)
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
