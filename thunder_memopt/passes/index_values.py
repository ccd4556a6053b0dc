"""The values of a trace's integer and boolean tensors, by how they are made, never from data.

Each integer tensor is followed as an affine function of its element's index (``Affine``: an
``arange``, broadcast, sliced, shifted, concatenated, or a constant), each boolean one as "an affine
function of the index >= 0" (``AtLeastZero``) or a constant. ``TensorValues`` computes them on
demand from each tensor's producer; a tensor made any other way (a trace input, an op without a
rule) is unknown. The masks' proofs (thunder_memopt.passes.causal_mask) read them.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx

__all__ = ["P", "Affine", "AtLeastZero", "Value", "TensorValues", "constant_of", "number_of", "normalized"]

P = prims.PrimIDs


@dataclass(frozen=True)
class Affine:
    """A tensor whose every element is ``const + sum(coef * index)`` over its axes, axes counted
    from the last (-1), so that broadcasting keeps them; integers (booleans as 0 and 1)."""

    coef: tuple[tuple[int, int], ...]  # (axis, coefficient), sorted, no zero coefficients
    const: int

    @staticmethod
    def of(coef: dict[int, int], const: int) -> Affine:
        return Affine(tuple(sorted((a, c) for a, c in coef.items() if c)), const)

    @property
    def constant(self) -> bool:
        return not self.coef

    def plus(self, other: Affine, sign: int = 1) -> Affine:
        coef = dict(self.coef)
        for a, c in other.coef:
            coef[a] = coef.get(a, 0) + sign * c
        return Affine.of(coef, self.const + sign * other.const)

    def times(self, k: int) -> Affine:
        return Affine.of({a: k * c for a, c in self.coef}, k * self.const)


@dataclass(frozen=True)
class AtLeastZero:
    """A boolean tensor (or one of ones and zeros): true where ``form`` is at least zero."""

    form: Affine


Value = Affine | AtLeastZero


def constant_of(x: Value | None) -> int | None:
    """The value of every element, where all are one known integer (booleans as 0 and 1)."""
    if isinstance(x, Affine) and x.constant:
        return x.const
    if isinstance(x, AtLeastZero) and x.form.constant:
        return int(x.form.const >= 0)
    return None


def number_of(x) -> Affine | None:
    if isinstance(x, int):  # bools too
        return Affine.of({}, int(x))
    if isinstance(x, float) and x.is_integer():
        return Affine.of({}, int(x))
    return None


# Integers that every float dtype holds exactly (bf16 has 8 significant bits).
_EXACT_IN_FLOATS = 2**8


def _exact(form: Affine, out: TensorProxy) -> bool:
    """Whether ``out``'s dtype holds every value of ``form`` over ``out``'s indices exactly: within an
    integer dtype's range (no wrap-around), 0 or 1 for booleans, small constants for floats."""
    if dtypes.is_boolean_dtype(out.dtype):
        return form.constant and form.const in (0, 1)
    if not dtypes.is_exact_dtype(out.dtype):
        return form.constant and abs(form.const) <= _EXACT_IN_FLOATS
    low = high = form.const
    for a, c in form.coef:
        span = c * (out.shape[a] - 1)
        low, high = low + min(0, span), high + max(0, span)
    info = torch.iinfo(dtypes.to_torch_dtype(out.dtype))
    return info.min <= low and high <= info.max


def normalized(value: Value | None, out) -> Value | None:
    """``value`` for the tensor ``out``, coefficients of its size-1 axes dropped (their index is 0),
    or None where ``out``'s dtype would not hold it exactly."""
    if value is None or not isinstance(out, TensorProxy):
        return None
    form = value.form if isinstance(value, AtLeastZero) else value
    kept = Affine.of({a: c for a, c in form.coef if -out.ndim <= a < 0 and out.shape[a] != 1}, form.const)
    if isinstance(value, AtLeastZero):  # ones and zeros, in any dtype
        return AtLeastZero(kept) if not kept.constant else Affine.of({}, int(kept.const >= 0))
    return kept if _exact(kept, out) else None


def _moved(x: Value, to_axis: Callable[[int], int | None]) -> Value | None:
    """``x`` with each axis ``a`` become ``to_axis(a)`` (None: the axis is gone, fine for size 1)."""
    form = x.form if isinstance(x, AtLeastZero) else x
    coef = {}
    for a, c in form.coef:
        b = to_axis(a)
        if b is None:
            return None
        coef[b] = c
    moved = Affine.of(coef, form.const)
    return AtLeastZero(moved) if isinstance(x, AtLeastZero) else moved


# Each rule takes ``values``, the bound symbol's arguments by name (its meta's signature) with each
# tensor, list of tensors and operand number replaced by its value (None: unknown), ``raw``, the same
# arguments as they are (proxies, shapes, dims), and the output; it returns the output's value or
# None (unknown).


def _iota(values, raw, out):
    start, step = number_of(raw["start"]), number_of(raw["step"])
    return None if start is None or step is None else Affine.of({-1: step.const}, start.const)


def _full(values, raw, out):
    return number_of(raw["fill_value"])


def _broadcast_in_dim(values, raw, out):
    a, bd = values["a"], raw["broadcast_dimensions"]
    if a is None:
        return None
    return _moved(a, lambda ax: bd[ax + len(bd)] - out.ndim)


def _moved_kept(a: Value | None, source: TensorProxy, kept_in: Sequence[int], out: TensorProxy) -> Value | None:
    """``a`` where the axes ``kept_in`` of ``source`` (positive) become ``out``'s axes of size other
    than 1, in order, and every other axis of ``source`` has size 1."""
    kept_out = [i for i, s in enumerate(out.shape) if s != 1]
    if a is None or [source.shape[i] for i in kept_in] != [out.shape[i] for i in kept_out]:
        return None
    return _moved(a, {i - source.ndim: j - out.ndim for i, j in zip(kept_in, kept_out)}.get)


def _reshape(values, raw, out):
    """Only reshapes that add or drop size-1 axes keep the index of the others; a constant any."""
    a, source = values["a"], raw["a"]
    if constant_of(a) is not None:
        return a
    return _moved_kept(a, source, [i for i, s in enumerate(source.shape) if s != 1], out)


def _squeeze(values, raw, out):
    source, dims = raw["a"], {d % raw["a"].ndim for d in raw["dims"]}
    return _moved_kept(values["a"], source, [i for i in range(source.ndim) if i not in dims], out)


def _transpose(values, raw, out):
    a, perm = values["a"], raw["permutation"]
    if a is None:
        return None
    where = {p: i for i, p in enumerate(perm)}
    return _moved(a, lambda ax: where[ax + len(perm)] - len(perm))


def _slice(values, raw, out):
    """Element ``j`` of a slice is element ``start + j * stride`` of its source."""
    a, source = values["a"], raw["a"]
    if a is None:
        return None
    form = a.form if isinstance(a, AtLeastZero) else a
    coef, const = dict(form.coef), form.const
    for i, (start, stride) in enumerate(zip(raw["start_indices"], raw["strides"] or [1] * source.ndim)):
        c = coef.get(i - source.ndim, 0)
        const += c * start
        coef[i - source.ndim] = c * stride
    sliced = Affine.of(coef, const)
    return AtLeastZero(sliced) if isinstance(a, AtLeastZero) else sliced


def _convert(values, raw, out):
    a = values["a"]
    if dtypes.is_boolean_dtype(raw["dtype"]) and isinstance(a, Affine):
        c = constant_of(a)
        return None if c is None else Affine.of({}, int(c != 0))
    return a


def _same(values, raw, out):
    return values["a"]


def _affine_operands(values) -> tuple[Affine, Affine] | None:
    a, b = values["a"], values["b"]
    return (a, b) if isinstance(a, Affine) and isinstance(b, Affine) else None


def _add_or_sub(sign: int):
    def rule(values, raw, out):
        ab = _affine_operands(values)
        return None if ab is None else ab[0].plus(ab[1], sign)
    return rule


def _mul(values, raw, out):
    ab = _affine_operands(values)
    if ab is None or not (ab[0].constant or ab[1].constant):
        return None
    a, b = ab if ab[1].constant else ab[::-1]
    return a.times(b.const)


def _neg(values, raw, out):
    a = values["a"]
    return a.times(-1) if isinstance(a, Affine) else None


_ONE = Affine.of({}, 1)


def _below_zero(form: Affine) -> AtLeastZero:
    """True where ``form`` (integer) is below zero: ``-form - 1 >= 0``."""
    return AtLeastZero(form.times(-1).plus(_ONE, -1))


def _not(values, raw, out):
    """``~a``: for booleans the negation, for integers ``-a - 1``."""
    a = values["a"]
    if not dtypes.is_boolean_dtype(out.dtype):
        return _neg(values, raw, out).plus(_ONE, -1) if isinstance(a, Affine) else None
    if isinstance(a, AtLeastZero):
        return _below_zero(a.form)
    c = constant_of(a)
    return None if c is None else Affine.of({}, 1 - c)


def _compare(at_least_zero: Callable[[Affine, Affine], Affine]):
    """The rule of a comparison of integers that is true where ``at_least_zero(a, b) >= 0``."""
    def rule(values, raw, out):
        ab = _affine_operands(values)
        return None if ab is None else AtLeastZero(at_least_zero(*ab))
    return rule


def _equality(equal: bool):
    def rule(values, raw, out):
        ab = _affine_operands(values)
        if ab is None:
            return None
        difference = ab[0].plus(ab[1], -1)
        return Affine.of({}, int((difference.const == 0) == equal)) if difference.constant else None
    return rule


def _logical(absorbing: int):
    """``and`` (absorbing 0) or ``or`` (absorbing 1) of booleans (for integers, bitwise: unknown)."""
    def rule(values, raw, out):
        a, b = values["a"], values["b"]
        if not dtypes.is_boolean_dtype(out.dtype):
            return None
        for x, y in ((a, b), (b, a)):
            c = constant_of(x)
            if c == absorbing:
                return Affine.of({}, absorbing)
            if c == 1 - absorbing:
                return y
        return a if a is not None and a == b else None
    return rule


def _where(values, raw, out):
    pred, a, b = values["pred"], values["a"], values["b"]
    c = constant_of(pred)
    if c is not None:
        return a if c else b
    if not isinstance(pred, AtLeastZero):
        return None
    picked = (constant_of(a), constant_of(b))
    if picked == (1, 0):
        return pred
    return _below_zero(pred.form) if picked == (0, 1) else None


def _cat(values, raw, out):
    """Pieces that continue one another: the same coefficients, and each piece's values those of the
    first's function at its offset along the joined axis (a piece of size 1 there fits any step)."""
    parts, pieces, dim = values["tensors"], raw["tensors"], raw["dim"] % out.ndim - out.ndim
    if not all(isinstance(p, Affine) for p in parts):
        return None
    steps = {dict(p.coef).get(dim, 0) for p, t in zip(parts, pieces) if t.shape[dim] != 1}
    others = {tuple((a, c) for a, c in p.coef if a != dim) for p in parts}
    if len(steps) > 1 or len(others) > 1:
        return None
    step = steps.pop() if steps else 0
    offsets = [0, *itertools.accumulate(t.shape[dim] for t in pieces)]
    if len({p.const - step * o for p, o in zip(parts, offsets)}) != 1:
        return None
    return Affine.of({**dict(others.pop()), dim: step}, parts[0].const)


def _gather_of_constant(values, raw, out):
    """Elements picked from a constant tensor are that constant, whatever the indices."""
    a = values["a"]
    return a if constant_of(a) is not None else None


def _cumsum(values, raw, out):
    """The running sum of a constant ``c`` along an axis is ``c * (index + 1)``."""
    c = constant_of(values["a"])
    return None if c is None else Affine.of({raw["dim"] % out.ndim - out.ndim: c}, c)


_RULES: dict[object, Callable] = {
    P.IOTA: _iota,
    P.FULL: _full,
    P.BROADCAST_IN_DIM: _broadcast_in_dim,
    P.RESHAPE: _reshape,
    P.SQUEEZE: _squeeze,
    P.TRANSPOSE: _transpose,
    P.SLICE: _slice,
    P.CONVERT_ELEMENT_TYPE: _convert,
    P.SHALLOW_COPY: _same,
    P.STRIDE_ORDER: _same,
    P.ADD: _add_or_sub(1),
    P.SUB: _add_or_sub(-1),
    P.MUL: _mul,
    P.NEG: _neg,
    P.BITWISE_NOT: _not,
    P.GE: _compare(lambda a, b: a.plus(b, -1)),
    P.LE: _compare(lambda a, b: b.plus(a, -1)),
    P.GT: _compare(lambda a, b: a.plus(b, -1).plus(_ONE, -1)),
    P.LT: _compare(lambda a, b: b.plus(a, -1).plus(_ONE, -1)),
    P.EQ: _equality(True),
    P.NE: _equality(False),
    P.BITWISE_AND: _logical(0),
    P.BITWISE_OR: _logical(1),
    P.WHERE: _where,
    P.CAT: _cat,
    P.TAKE: _gather_of_constant,
    P.TAKE_ALONG_AXIS: _gather_of_constant,
    P.GATHER: _gather_of_constant,
    ltorch.cumsum.id: _cumsum,
}
_OPERANDS = ("a", "b", "pred")  # the arguments of elementwise ops, tensors or numbers


class TensorValues:
    """The values of a trace's tensors, each computed once, on demand, from its producer: the outermost
    bound symbol that makes it and has a rule, else the symbols of its decomposition; ``assumed``: the
    values of some tensors (by name), taken as given."""

    def __init__(self, trace: TraceCtx, assumed: dict[str, Value] | None = None) -> None:
        self._producers: dict[str, list[BoundSymbol]] = {}
        stack = list(reversed(trace.bound_symbols))
        while stack:  # outer symbols before the symbols of their decompositions
            b = stack.pop()
            for out in b.flat_proxy_outs:
                self._producers.setdefault(out.name, []).append(b)
            stack.extend(reversed(b.subsymbols))
        self._known: dict[str, Value | None] = dict(assumed or {})

    def of(self, x) -> Value | None:
        """The value of a tensor or a number; None where it is not known."""
        if not isinstance(x, TensorProxy):
            return number_of(x)
        if x.name not in self._known:
            self._known[x.name] = None  # while it is being found
            found = (self._apply(b, x) for b in self._producers.get(x.name, ()))
            self._known[x.name] = next((v for v in found if v is not None), None)
        return self._known[x.name]

    def producers(self, x: TensorProxy) -> list[BoundSymbol]:
        """The bound symbols that make ``x``: the outermost first, then those of decompositions."""
        return self._producers.get(x.name, [])

    def _apply(self, b: BoundSymbol, out: TensorProxy) -> Value | None:
        rule = _RULES.get(b.sym.id)
        if rule is None or b.output is not out:
            return None
        raw = inspect.signature(b.sym.meta).bind(*b.args, **b.kwargs).arguments
        values = {}
        for name, a in raw.items():
            if isinstance(a, TensorProxy) or name in _OPERANDS:
                values[name] = self.of(a)
            elif name == "tensors":
                values[name] = [self.of(t) for t in a]
        return normalized(rule(values, raw, out), out)

