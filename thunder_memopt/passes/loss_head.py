"""The loss-head pass: ``linear -> cross_entropy`` in a trace becomes the fused loss head.

A model that computes its loss in the compiled function (litgpt's ``GPT`` and
``F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))``, in the model's dtype or upcast)
traces to a ``linear`` whose use is a chain of reshapes and casts into ``cross_entropy``. That
chain is what holds the logits. The pass replaces it, before Thunder's autodiff, by
``memopt_linear_cross_entropy`` (thunder_memopt.executors.chunked_cross_entropy), whose grad
transform saves the hidden states and the log-sum-exp instead of the logits and their
log-softmax.

transformers' ``ForCausalLMLoss`` is the same chain (``logits.float().view(-1, V)``, the labels
shifted by a pad and a slice, ``ignore_index=-100``, "mean", or "sum" that the model then divides
by ``num_items_in_batch``: the division reads the fused loss as it read the unfused one), but the
model also returns the logits. Then the head becomes ``memopt_linear_cross_entropy_and_logits``,
which makes the logits with the same one matmul and returns them in their place, without saving
them (its gradients come from slices of them in the forward, or from chunks of them made again in
the backward); what it never holds whole is their fp32 copy, the log-softmax and the loss's
gradient of the logits.

Between the linear and the chain, a model may scale the logits by a Python number (Granite's
``logits / logits_scaling``, Cohere's ``logits * logit_scale``) or soft-cap them (Gemma-2's
``tanh(logits / cap) * cap``): those elementwise ops (``mul``, ``true_divide``, ``tanh``, and casts
among them) become the fused head's ``steps``, which it applies to each chunk as the model did, and
the logits the model returns are theirs.

It rewrites only what it can prove equal: the chain's intermediates used by nothing else, any
other reader of the model's logits (after the steps) after the cross-entropy, a mean or sum reduction, no class weights, no
label smoothing, and targets of one index per token. Anything else is left as it was.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
from thunder.core import prims, utils
from thunder.core.proxies import ProxyInterface, TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx

from thunder_memopt.core.trace import replace_bound_symbols, unmade_cotangents
from thunder_memopt.executors._head_math import Steps
from thunder_memopt.executors.chunked_cross_entropy import REDUCTIONS, chunk_tokens, head_loss, head_loss_and_logits
from thunder_memopt.executors.unmade_gradients import unused_gradient_unmade

__all__ = ["LossHead", "find_loss_heads", "fuse_loss_heads", "unused_logits_gradients_unmade"]

_CROSS_ENTROPY = inspect.signature(ltorch.cross_entropy.meta)
# Between the head's linear and the cross-entropy: ops that change only shape or dtype.
_RESHAPES = {ltorch.reshape.id, ltorch.view.id, ltorch.contiguous.id}
_CASTS = {ltorch.to.id, prims.PrimIDs.CONVERT_ELEMENT_TYPE}
# Elementwise ops of the logits and a Python number (tanh: alone) that the fused head can apply per chunk.
_STEPS = {ltorch.mul.id: "mul", ltorch.true_divide.id: "true_divide", ltorch.div.id: "true_divide",
          ltorch.tanh.id: "tanh"}


@dataclass(frozen=True)
class LossHead:
    """A ``linear -> (steps, reshapes, casts) -> cross_entropy`` chain that the pass can fuse."""

    linear: BoundSymbol
    chain: tuple[BoundSymbol, ...]  # from the linear's consumer to the cross-entropy, inclusive
    shapes: tuple[BoundSymbol, ...]  # ``shape`` queries of the logits, dropped with them
    target: TensorProxy  # the cross-entropy's (tokens,) targets
    ignore_index: int
    reduction: str
    steps: Steps  # the model's ops of the logits before the loss, () for none (executors._head_math)
    logits: TensorProxy  # the model's logits: the linear's output, or the last step's
    keeps_logits: bool  # the logits have readers besides the chain (the model returns them)


def _readers(t: TensorProxy, consumers, shapes: list[BoundSymbol]) -> list[BoundSymbol]:
    """The bound symbols that read ``t``, not counting ``shape`` queries with constant results."""
    readers = []
    for b in consumers.get(t, ()):
        if b.sym.id == prims.PrimIDs.SHAPE and not any(isinstance(o, ProxyInterface) for o in b.flat_outs):
            shapes.append(b)
        else:
            readers.append(b)
    return readers


_CHAIN = _RESHAPES | _CASTS | set(_STEPS) | {ltorch.cross_entropy.id}


def _number(value: object) -> bool:
    """A Python number in the trace: a constant, not a proxy of one."""
    return isinstance(value, (int, float)) and not isinstance(value, (bool, ProxyInterface))


def _step(b: BoundSymbol, t: TensorProxy) -> tuple[str, object] | None:
    """``(name, number)`` of the step ``b`` applies to ``t`` alone, elementwise, in ``t``'s dtype."""
    op, out = _STEPS[b.sym.id], b.output
    if not isinstance(out, TensorProxy) or out.shape != t.shape or out.dtype != t.dtype:
        return None
    if op == "tanh":
        return (op, None) if tuple(b.args) == (t,) and not b.kwargs else None
    if len(b.args) != 2 or b.kwargs.get("rounding_mode") is not None or set(b.kwargs) - {"rounding_mode"}:
        return None
    a, value = b.args
    if op == "mul" and value is t:
        a, value = value, a
    return (op, value) if a is t and _number(value) else None


def _match(linear: BoundSymbol, consumers, position: dict[int, int]) -> LossHead | None:
    logits = linear.output
    if not isinstance(logits, TensorProxy) or logits.ndim < 2:
        return None
    vocab, tokens = logits.shape[-1], math.prod(logits.shape[:-1])
    shapes: list[BoundSymbol] = []
    chain: list[BoundSymbol] = []
    steps: list[tuple[str, object]] = []
    others: dict[int, list[BoundSymbol]] = {}  # readers of a tensor of the chain beside it, by its position
    t, kept = logits, logits
    while True:
        readers = _readers(t, consumers, shapes)
        mine = [b for b in readers if b.sym.id in _CHAIN]
        if len(mine) != 1:
            return None
        others[len(chain)] = [b for b in readers if b.sym.id not in _CHAIN]
        b = mine[0]
        chain.append(b)
        if b.sym.id == ltorch.cross_entropy.id:
            break
        out = b.output
        if not isinstance(out, TensorProxy) or not b.flat_proxy_args or b.flat_proxy_args[0] is not t:
            return None
        if b.sym.id in _RESHAPES:
            if out.shape[-1] != vocab:
                return None
        elif b.sym.id in _CASTS:
            if not dtypes.is_float_dtype(out.dtype):
                return None
            steps.append(("to", out.dtype))
        else:
            step = _step(b, t)
            if step is None:
                return None
            steps.append(step)
            kept = out
        t = out
    # The model's logits are the last step's output (the linear's without steps), or a reshape of
    # it (OPT returns ``.contiguous()``): only they may have other readers. Casts after the last
    # step are the loss's upcast, as without steps.
    start = 0 if kept is logits else next(i for i, b in enumerate(chain) if b.output is kept) + 1
    stop = next(i for i in range(start, len(chain)) if chain[i].sym.id not in _RESHAPES)
    read = [i for i, readers in others.items() if readers]
    if len(read) > 1 or any(not start <= i <= stop for i in read):
        return None
    at = read[0] if read else start
    kept = chain[at - 1].output if at else logits
    last = max((i for i, (op, _) in enumerate(steps) if op != "to"), default=-1)
    bound = _CROSS_ENTROPY.bind(*chain[-1].args, **chain[-1].kwargs)
    bound.apply_defaults()
    a, target = bound.arguments["a"], bound.arguments["target"]
    ok = (
        a is t and tuple(a.shape) == (tokens, vocab)
        and isinstance(target, TensorProxy) and tuple(target.shape) == (tokens,)
        and not dtypes.is_float_dtype(target.dtype)
        and bound.arguments["weight"] is None and bound.arguments["size_average"] is None
        and bound.arguments["reduce"] is None and bound.arguments["label_smoothing"] == 0.0
        and bound.arguments["reduction"] in REDUCTIONS
        and isinstance(bound.arguments["ignore_index"], int)
    )
    # The fused head makes the logits where the cross-entropy was: every other reader comes later.
    if not ok or any(position[id(b)] < position[id(chain[-1])] for b in others[at]):
        return None
    return LossHead(linear, tuple(chain), tuple(shapes), target, bound.arguments["ignore_index"],
                    bound.arguments["reduction"], tuple(steps[: last + 1]), kept, keeps_logits=bool(others[at]))


def find_loss_heads(trace: TraceCtx) -> list[LossHead]:
    """Every fusable ``linear -> cross_entropy`` chain of a (pre-autodiff) computation trace."""
    consumers = utils.consumers(trace)
    position = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    found = (_match(b, consumers, position) for b in trace.bound_symbols if b.sym.id == ltorch.linear.id)
    return [h for h in found if h is not None]


def fuse_loss_heads(trace: TraceCtx, *, gradients_in_forward: bool = False) -> TraceCtx:
    """The trace with each loss head fused; the trace itself if it has none.

    ``gradients_in_forward`` chooses how the head trains (executors.chunked_cross_entropy): with
    the gradients computed in the forward (one matmul less), or recomputing the logits in the
    backward (the least memory)."""
    heads = find_loss_heads(trace)
    if not heads:
        return trace
    new = from_trace(trace)
    replacement: dict[int, list[BoundSymbol]] = {}
    dropped: set[int] = set()
    for head in heads:
        x, weight, bias = (list(head.linear.args) + [None])[:3]
        ce, target = head.chain[-1], head.target
        tokens, vocab = target.shape[0], weight.shape[0]
        # With the logits kept, the chunks of the loss are views of them whatever the head does.
        chunk = chunk_tokens(tokens, vocab, gradients_in_forward=gradients_in_forward and not head.keeps_logits,
                             device=x.device.type)
        scope: list[BoundSymbol] = []
        new.push_scope(scope)
        with tracectx(new):
            hidden = ltorch.reshape(x, (tokens, x.shape[-1]))
            options = (head.ignore_index, head.reduction, chunk, head.steps, ce.output.dtype)
            if head.keeps_logits:
                loss, flat_logits = head_loss_and_logits(hidden, weight, bias, target, *options, gradients_in_forward)
                logits = ltorch.reshape(flat_logits, head.logits.shape)
            else:
                loss = head_loss(hidden, weight, bias, target, *options, gradients_in_forward)
        new.pop_scope()
        swaps = {variableify(loss): ce.output}
        if head.keeps_logits:
            swaps[variableify(logits)] = head.logits
        scope = [b.from_bsym_swap_proxies(swaps) for b in scope]
        replacement[id(ce)] = scope
        dropped.update(id(b) for b in (head.linear, *head.chain[:-1], *head.shapes))
    bsyms: list[BoundSymbol] = []
    for b in trace.bound_symbols:
        if id(b) not in dropped:
            bsyms.extend(replacement.get(id(b), [b]))
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance(f"thunder_memopt loss_head: {len(heads)} linear+cross_entropy fused"))
    return new


def unused_logits_gradients_unmade(forward: TraceCtx, backward: TraceCtx) -> TraceCtx:
    """The forward with each output marked whose gradient its backward reads in the fused head alone
    (core.trace.unmade_cotangents): where the caller leaves that output unused, its gradient is
    never made (executors.unmade_gradients). The forward itself where there is none."""
    cotangents = unmade_cotangents(backward)
    ret = forward.bound_symbols[-1]
    outputs = ret.args[0].get("flat_output", ()) if ret.sym.id == prims.PrimIDs.RETURN else ()
    if not cotangents or len(outputs) != len(backward.args[1]):  # a position would name another tensor
        return forward
    marked = [outputs[k] for k, t in sorted(cotangents.items())
              if isinstance(outputs[k], TensorProxy) and outputs[k].shape == t.shape]
    if not marked:
        return forward
    marks = [unused_gradient_unmade.bind(t, output=None) for t in marked]
    return replace_bound_symbols(forward, [*forward.bound_symbols[:-1], *marks, ret],
                                 f"thunder_memopt loss_head: {len(marks)} unused gradient(s) unmade")
