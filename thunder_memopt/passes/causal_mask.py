"""The causal-mask pass: an attention mask that the trace proves causal becomes ``is_causal=True``.

transformers builds its causal mask as a tensor whenever it is traced (``masking_utils`` skips the
``is_causal`` shortcut under torch.compile, since it cannot check the padding mask's values there)
and passes it to ``scaled_dot_product_attention``. With a mask, attention runs on the
memory-efficient kernel: neither flash nor cuDNN (thunder_memopt.executors.cudnn_attention) takes
one. Where the mask is causal, ``is_causal=True`` means the same (SDPA's own mask is top-left
aligned: key ``j`` is seen by query ``i`` where ``j <= i``), and the fast kernels take it.

The proof is made from the ops that make the mask, before Thunder's autodiff, never from values:
each integer tensor is followed as an affine function of its element's index (an ``arange``,
broadcast, sliced, shifted, concatenated, or a constant), each boolean one as "an affine function
of the index >= 0" or a constant. transformers' mask, ``kv_idx <= q_idx`` AND-ed with an all-true
tensor and with the packed-sequence mask of positions made by ``arange``, is ``q_idx - kv_idx >= 0``
on the last two axes: causal. A tensor made any other way proves nothing (a trace input, such as
a padding mask, whatever its values; an op this does not follow), and its attention keeps its
mask, and with it its numerics. Only the attention changes; the ops that made the mask are left
to dead-code elimination.

A mask proven a sliding window, ``0 <= q_idx - kv_idx < w`` (``sliding_window``), makes its attention
``window_attention`` (thunder_memopt.executors.window_attention), whose kernel skips the keys
outside the window, where flash serves the inputs (CUDA); elsewhere it keeps its mask.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import dce

from thunder_memopt.executors.window_attention import window_attention, window_supports
from thunder_memopt.passes.index_values import (P, Affine, AtLeastZero, TensorValues, constant_of, normalized,
                                                  number_of)

__all__ = ["is_causal_mask", "shows_each_query_its_own_key", "sliding_window", "causal_band", "causal_attention",
           "causal_outputs"]


def is_causal_mask(values: TensorValues, mask) -> bool:
    """Whether ``mask`` is, by how it is made, true exactly where the key's index (its last axis) is
    at most the query's (the axis before): ``k * (q_idx - kv_idx) >= 0`` for some ``k > 0``, alone or
    AND-ed with a window that every query's keys fit in."""
    return causal_band(values, mask) == 0


def causal_band(values: TensorValues, mask) -> int | None:
    """How far back each query sees, by how ``mask`` is made: 0 for a causal mask (every earlier
    key, ``is_causal_mask``), ``w`` for a sliding window of ``w`` keys (``sliding_window``); None for
    any other mask."""
    band = _band(values, mask)
    if band is None or band[0] != 0:
        return None
    if band[1] is None or band[1] >= mask.shape[-2] - 1:
        return 0
    return band[1] + 1 if band[1] >= 0 and mask.shape[-1] == mask.shape[-2] else None


def shows_each_query_its_own_key(values: TensorValues, mask) -> bool:
    """Whether ``mask`` is, by how it is made, true wherever the key's index (its last axis) equals
    the query's (the axis before), with a key for every query: then no query sees no key. Causal
    masks are, and so are sliding windows of at least one key (``kv_idx > q_idx - window``) and an
    AND of such masks, transformers' sliding-window causal mask (Mistral, Phi-3, Gemma-2); a padding
    mask, a trace input, proves nothing."""
    return (isinstance(mask, TensorProxy) and dtypes.is_boolean_dtype(mask.dtype) and mask.ndim >= 2
            and mask.shape[-1] >= mask.shape[-2] and _true_on_the_diagonal(_formula(values, mask)))


def sliding_window(values: TensorValues, mask) -> int | None:
    """The window ``w`` where ``mask`` is, by how it is made, true exactly where
    ``0 <= q_idx - kv_idx < w`` on its last two axes (of one size, longer than ``w``), whatever the
    index along the others: transformers' sliding-window causal mask, ``kv_idx <= q_idx`` AND
    ``kv_idx > q_idx - w`` (Mistral, Phi-3, Gemma-2's sliding layers). None for any other mask, a
    causal one included (``is_causal_mask``)."""
    return causal_band(values, mask) or None


def _band(values: TensorValues, mask) -> tuple[int, int | None] | None:
    """``(low, high)`` where ``mask`` is, by how it is made, an AND of bounds on the query's index
    less the key's, ``d = q_idx - kv_idx``, true exactly where ``low <= d <= high`` (high None: no
    bound above); None for a mask made otherwise (an OR, an operand not followed, an index of
    another axis, no bound below)."""
    if not isinstance(mask, TensorProxy) or not dtypes.is_boolean_dtype(mask.dtype) or mask.ndim < 2:
        return None
    forms = _conjuncts(_formula(values, mask))
    if not forms:
        return None
    lows, highs = [], []
    for form in forms:
        coef = dict(form.coef)
        k = coef.get(-2, 0)
        if k == 0 or coef != {-2: k, -1: -k}:
            return None
        if k > 0:  # k * d + const >= 0: d >= ceil(-const / k)
            lows.append(-(form.const // k))
        else:  # d <= floor(const / -k)
            highs.append(form.const // -k)
    return (max(lows), min(highs, default=None)) if lows else None


@dataclass(frozen=True)
class _Leaf:
    """A boolean tensor of ``shape`` whose value is ``value``."""

    value: AtLeastZero
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Both:
    """The AND of two formulas."""

    parts: tuple


@dataclass(frozen=True)
class _Either:
    """The OR of two formulas."""

    parts: tuple


# How a boolean mask is made on its last two axes: a leaf, a constant, an AND or OR of formulas,
# or None (not known).
_Formula = _Leaf | bool | _Both | _Either | None


def _formula(values: TensorValues, x: TensorProxy) -> _Formula:
    value = values.of(x)
    if isinstance(value, AtLeastZero):
        return _Leaf(value, tuple(x.shape))
    if value is not None:
        return _truth(value)
    for b in values.producers(x):
        if b.output is not x:
            continue
        if b.sym.id in (P.BITWISE_AND, P.BITWISE_OR):
            parts = tuple(_operand_formula(values, a, x) for a in (b.args[0], b.args[1]))
            return _Both(parts) if b.sym.id == P.BITWISE_AND else _Either(parts)
        if b.sym.id in _KEEPING_THE_LAST_TWO_AXES and _keeps_the_last_two_axes(b, x):
            return _formula(values, b.args[0])
    return None


def _truth(value) -> bool | None:
    c = constant_of(value)
    return None if c is None else bool(c)


def _operand_formula(values: TensorValues, a, out: TensorProxy) -> _Formula:
    """The formula of ``a``, an operand of an elementwise op making ``out``, on ``out``'s last two
    axes: of ``out``'s last two sizes (an operand broadcast along them is known only if constant)."""
    if not isinstance(a, TensorProxy) or not dtypes.is_boolean_dtype(a.dtype):
        return _truth(number_of(a))
    if a.ndim >= 2 and tuple(a.shape[-2:]) == tuple(out.shape[-2:]):
        return _formula(values, a)
    return _truth(values.of(a))


def _true_on_the_diagonal(formula: _Formula) -> bool:
    if isinstance(formula, _Leaf):
        return _diagonal_low(formula.value.form, formula.shape) >= 0
    if isinstance(formula, (_Both, _Either)):
        kept = [_true_on_the_diagonal(p) for p in formula.parts]
        return all(kept) if isinstance(formula, _Both) else any(kept)
    return formula is True


def _conjuncts(formula: _Formula) -> list[Affine] | None:
    """The forms whose ``>= 0`` AND-ed make ``formula``; None where it is not such an AND."""
    if formula is True:
        return []
    if isinstance(formula, _Leaf):
        return [formula.value.form]
    if isinstance(formula, _Both):
        parts = [_conjuncts(p) for p in formula.parts]
        return None if None in parts else [f for p in parts for f in p]
    return None


# Ops whose output element (..., i, j) is their input's (..., i, j) where both have the same last
# two sizes (and, for a broadcast, the input's last two axes become the output's).
_KEEPING_THE_LAST_TWO_AXES = (P.BROADCAST_IN_DIM, P.RESHAPE, P.CONVERT_ELEMENT_TYPE, P.SHALLOW_COPY,
                              P.STRIDE_ORDER, P.SLICE)


def _keeps_the_last_two_axes(b: BoundSymbol, out: TensorProxy) -> bool:
    a = b.args[0]
    if not isinstance(a, TensorProxy) or a.ndim < 2 or not dtypes.is_boolean_dtype(a.dtype):
        return False
    if b.sym.id == P.SLICE:  # from index 0, every element, on the last two axes: a corner of the diagonal
        strides = b.args[3] if len(b.args) > 3 and b.args[3] else [1] * a.ndim
        return tuple(b.args[1][-2:]) == (0, 0) and tuple(strides[-2:]) == (1, 1)
    if tuple(a.shape[-2:]) != tuple(out.shape[-2:]):
        return False
    return b.sym.id != P.BROADCAST_IN_DIM or tuple(b.args[2][-2:]) == (out.ndim - 2, out.ndim - 1)


def _diagonal_low(form: Affine, shape: Sequence[int]) -> int:
    """The least value of ``form`` over the elements whose last two indices are equal."""
    coef = dict(form.coef)
    diagonal = coef.pop(-2, 0) + coef.pop(-1, 0)
    low = form.const + min(0, diagonal * (min(shape[-2], shape[-1]) - 1))
    return low + sum(min(0, c * (shape[a] - 1)) for a, c in coef.items())


_SDPA = inspect.signature(ltorch.scaled_dot_product_attention.meta)


def causal_attention(trace: TraceCtx) -> TraceCtx:
    """The trace with each ``scaled_dot_product_attention`` whose mask is proven causal called with
    ``is_causal=True`` and no mask, each whose mask is proven a sliding window that flash serves
    (``window_attention.window_supports``) made ``window_attention``, and the ops left unused
    removed; the trace itself if none is."""
    attentions = []
    for b in trace.bound_symbols:
        if b.sym.id == ltorch.scaled_dot_product_attention.id:
            bound = _SDPA.bind(*b.args, **b.kwargs)
            bound.apply_defaults()
            if bound.arguments["attn_mask"] is not None and bound.arguments["is_causal"] is False:
                attentions.append((b, bound.arguments))
    if not attentions:
        return trace
    values = TensorValues(trace)
    rewritten: dict[int, BoundSymbol] = {}
    windows = 0
    new = from_trace(trace)
    for b, arguments in attentions:
        qkv = arguments["query"], arguments["key"], arguments["value"]
        mask, scale = arguments["attn_mask"], arguments["scale"]
        band = causal_band(values, mask)
        if band == 0:
            call = lambda: ltorch.scaled_dot_product_attention(*qkv, None, arguments["dropout_p"], True, scale=scale)
        elif band and arguments["dropout_p"] == 0.0 and window_supports(*qkv):
            call = lambda: window_attention(*qkv, band, scale)
            windows += 1
        else:
            continue
        scope: list[BoundSymbol] = []
        new.push_scope(scope)
        with tracectx(new):
            out = call()
        new.pop_scope()
        (attention,) = scope
        rewritten[id(b)] = attention.from_bsym_swap_proxies({variableify(out): b.output})
    if not rewritten:
        return trace
    new.bound_symbols = [rewritten.get(id(b), b) for b in trace.bound_symbols]
    new = dce(new)
    new.set_provenance(TraceProvenance(
        f"thunder_memopt causal_mask: the masks of {len(rewritten) - windows} of {len(attentions)} attentions "
        f"proven causal" + (f", of {windows} sliding windows" if windows else "")))
    return new


# The positions 0, 1, ... of the tokens along the last axis, as transformers makes position ids.
_POSITIONS = Affine.of({-1: 1}, 0)


def _may_hold_positions(x) -> bool:
    return (isinstance(x, TensorProxy) and dtypes.is_exact_dtype(x.dtype) and not dtypes.is_boolean_dtype(x.dtype)
            and x.ndim >= 1 and all(isinstance(s, int) for s in x.shape))


def causal_outputs(trace: TraceCtx) -> dict[int, tuple[tuple[int, ...], int]]:
    """The trace's outputs (by position among its flattened outputs) that are causal masks or
    sliding windows by how they are made, each with the positions among its flattened arguments of
    the integer inputs that it is so only if they hold the positions ``0, 1, ...`` along their last
    axis (empty: whatever the inputs), and its ``causal_band``. transformers combines its causal
    mask with the packed-sequence mask of the position ids, which is all true exactly where they
    count up by one; where the position ids are an input (made outside the graph), the mask is
    causal if they hold those positions."""
    outputs = tree_flatten((trace.output,))[0]
    masks = [i for i, out in enumerate(outputs)
             if isinstance(out, TensorProxy) and dtypes.is_boolean_dtype(out.dtype) and out.ndim >= 2]
    if not masks:
        return {}
    plain = TensorValues(trace)
    found = {i: ((), band) for i in masks if (band := causal_band(plain, outputs[i])) is not None}
    inputs = tree_flatten((trace.args, trace.kwargs))[0]
    candidates = [j for j, x in enumerate(inputs) if _may_hold_positions(x)]

    def band_given(premise: Sequence[int], mask: TensorProxy) -> int | None:
        return causal_band(TensorValues(trace, {inputs[j].name: normalized(_POSITIONS, inputs[j]) for j in premise}),
                           mask)

    for i in masks:
        if i in found or not candidates or (band := band_given(candidates, outputs[i])) is None:
            continue
        premise = list(candidates)
        for j in candidates:  # only the inputs the proof needs, so that no other input's values matter
            if band_given([k for k in premise if k != j], outputs[i]) == band:
                premise.remove(j)
        found[i] = (tuple(premise), band)
    return found
