"""The masked-rows pass: attention gives a query that its mask hides every key from zeros, as torch's
SDPA does, where Thunder's decomposition gives NaN.

torch's SDPA returns zeros for a fully masked row (a left pad's query; with a sliding window, a
right pad's): a boolean mask whose row is all False, or an additive one whose row is all -inf.
Thunder decomposes SDPA for autodiff (``where(mask, logits, -inf)``, softmax), and softmax over a
row of -inf is NaN, which ``NaN * 0`` carries into every row of the next layer. Here, before
autodiff, each attention whose mask may have such rows reads a mask in which those rows see every
key (finite), and its output is zeroed there: ``where(row_has_a_key, sdpa(q, k, v, mask'), 0)``.
Every other row's mask is unchanged, so every other value and gradient is the same, bit for bit.

Untouched: ``is_causal`` and mask-free attention, boolean masks that show each query its own key by
how they are made (``causal_mask.shows_each_query_its_own_key``: causal and sliding-window causal
masks without padding) and additive masks that hold no -inf by how they are made
(``torch.finfo(dtype).min`` fills, transformers' float masks). Each distinct mask is prepared once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_memopt.passes.causal_mask import shows_each_query_its_own_key
from thunder_memopt.passes.index_values import TensorValues

__all__ = ["zero_fully_masked_rows"]

P = prims.PrimIDs
_SDPA = inspect.signature(ltorch.scaled_dot_product_attention.meta)
# Ops whose every output element is one of their input ``a``'s elements.
_SAME_ELEMENTS = (P.BROADCAST_IN_DIM, P.RESHAPE, P.SQUEEZE, P.TRANSPOSE, P.SLICE, P.SHALLOW_COPY, P.STRIDE_ORDER)


class _NoNegativeInfinity:
    """Which float tensors of a trace hold no -inf by how they are made: fills and ``where``s of
    numbers that the dtype holds (not ``finfo(float32).min`` in bf16, which is -inf there), casts of
    booleans or to a dtype of wider range, and views of such tensors. Anything else, a trace input
    among them, may hold -inf."""

    def __init__(self, trace: TraceCtx) -> None:
        self._producers: dict[str, list[BoundSymbol]] = {}
        stack = list(reversed(trace.bound_symbols))
        while stack:  # outer symbols first, then those of their decompositions
            b = stack.pop()
            for out in b.flat_proxy_outs:
                self._producers.setdefault(out.name, []).append(b)
            stack.extend(reversed(b.subsymbols))
        self._known: dict[str, bool] = {}

    def holds_none(self, x, dtype: dtypes.dtype) -> bool:
        if not isinstance(x, TensorProxy):
            return isinstance(x, (int, float)) and not math.isnan(x) and -_max(dtype) <= x
        if x.name not in self._known:
            self._known[x.name] = False  # while it is being found
            self._known[x.name] = any(self._made_without(b) for b in self._producers.get(x.name, ()))
        return self._known[x.name]

    def _made_without(self, b: BoundSymbol) -> bool:
        out = b.output
        if not isinstance(out, TensorProxy) or dtypes.is_boolean_dtype(out.dtype) or b.sym.id not in _RULES:
            return False
        arguments = inspect.signature(b.sym.meta).bind(*b.args, **b.kwargs).arguments
        return _RULES[b.sym.id](self, arguments, out)


def _max(dtype: dtypes.dtype) -> float:
    return torch.finfo(dtypes.to_torch_dtype(dtype)).max


def _convert(values: _NoNegativeInfinity, arguments: dict, out: TensorProxy) -> bool:
    a = arguments["a"]
    if dtypes.is_boolean_dtype(a.dtype):
        return True
    return (dtypes.is_inexact_dtype(a.dtype) and not dtypes.is_complex_dtype(a.dtype)
            and _max(a.dtype) <= _max(out.dtype) and values.holds_none(a, a.dtype))


_RULES: dict[object, Callable[[_NoNegativeInfinity, dict, TensorProxy], bool]] = {
    P.FULL: lambda values, arguments, out: values.holds_none(arguments["fill_value"], out.dtype),
    P.WHERE: lambda values, arguments, out: all(values.holds_none(arguments[n], out.dtype) for n in ("a", "b")),
    P.CONVERT_ELEMENT_TYPE: _convert,
    **{i: (lambda values, arguments, out: values.holds_none(arguments["a"], out.dtype)) for i in _SAME_ELEMENTS},
}


def _may_hide_every_key(causal: TensorValues, finite: _NoNegativeInfinity, mask) -> bool:
    """Whether some row of ``mask`` may hide every key from its query, by how the mask is made."""
    if dtypes.is_boolean_dtype(mask.dtype):
        return not shows_each_query_its_own_key(causal, mask)
    return not finite.holds_none(mask, mask.dtype)


def _finite_rows(mask: TensorProxy) -> tuple[TensorProxy, TensorProxy]:
    """In the current trace: whether each row of ``mask`` shows its query a key (its last axis kept,
    of size 1), and the mask with every row that shows none made to show every key."""
    if dtypes.is_boolean_dtype(mask.dtype):
        row_has_a_key = ltorch.amax(mask, -1, True)
        return row_has_a_key, ltorch.bitwise_or(mask, ltorch.bitwise_not(row_has_a_key))
    row_has_a_key = ltorch.gt(ltorch.amax(mask, -1, True), -math.inf)
    return row_has_a_key, ltorch.where(row_has_a_key, mask, 0.0)


def zero_fully_masked_rows(trace: TraceCtx) -> TraceCtx:
    """The trace with each ``scaled_dot_product_attention`` whose mask may hide every key from a
    query reading a finite mask, its output zeroed in those rows; the trace itself if none may."""
    attentions = []
    for b in trace.bound_symbols:
        if b.sym.id == ltorch.scaled_dot_product_attention.id:
            bound = _SDPA.bind(*b.args, **b.kwargs)
            bound.apply_defaults()
            if isinstance(bound.arguments["attn_mask"], TensorProxy) and bound.arguments["is_causal"] is False:
                attentions.append((b, bound.arguments))
    if not attentions:
        return trace
    causal, finite = TensorValues(trace), _NoNegativeInfinity(trace)
    attentions = [(b, a) for b, a in attentions if _may_hide_every_key(causal, finite, a["attn_mask"])]
    if not attentions:
        return trace
    new = from_trace(trace)
    prepared: dict[str, tuple[TensorProxy, TensorProxy]] = {}  # by mask name: made before its first reader
    inserted: dict[int, list[BoundSymbol]] = {}
    for b, arguments in attentions:
        mask = arguments["attn_mask"]
        scope: list[BoundSymbol] = []
        new.push_scope(scope)
        with tracectx(new):
            if mask.name not in prepared:
                prepared[mask.name] = _finite_rows(mask)
            row_has_a_key, finite_mask = prepared[mask.name]
            out = ltorch.scaled_dot_product_attention(arguments["query"], arguments["key"], arguments["value"],
                                                      finite_mask, arguments["dropout_p"], False,
                                                      scale=arguments["scale"])
            zeroed = ltorch.where(row_has_a_key, out, 0.0)
        new.pop_scope()
        if tuple(zeroed.shape) != tuple(b.output.shape) or zeroed.dtype != b.output.dtype:
            raise ValueError(f"the mask {mask.name} {tuple(mask.shape)} does not broadcast to the attention's "
                             f"output {tuple(b.output.shape)}")
        scope[-1] = scope[-1].from_bsym_swap_proxies({variableify(zeroed): b.output})
        inserted[id(b)] = scope
    new.bound_symbols = [s for b in trace.bound_symbols for s in inserted.get(id(b), [b])]
    new.set_provenance(TraceProvenance(
        f"thunder_memopt masked_rows: {len(attentions)} attentions over {len(prepared)} masks "
        "give fully masked rows zeros"))
    return new
