"""The fused loss head: a linear layer and its cross-entropy, without holding fp32 logits whole.

Unfused, the head saves its tokens x vocabulary logits and their log-softmax, then builds a gradient
of that size. Following Apple's Cut Cross-Entropy, this head walks its logits in chunks of tokens or
slices of the vocabulary, each made by the model's own matmul in its dtype and upcast per chunk, so
the loss is the fp32 loss of the model's logits; only the order of summation differs. The model's
ops between the matmul and the loss (Granite's scale, Gemma-2's soft-cap) apply per chunk, in the
dtype it ran them in (executors._head_math); the chunks' shapes keep every matmul on Hopper's fast
kernels (executors._head_shapes). Where the gradients are computed (the grad transforms, below):
- in the backward: the forward keeps each token's log-sum-exp, the backward makes the logits again;
- in the forward: from the logits the forward has (one matmul less); the backward scales them.
A model that also returns its logits (transformers) gets them whole from one matmul, its ops on them
in one kernel over it where the chunk math is compiled (torch.compile's rounding of those ops).
Ways in: ``linear_cross_entropy`` (an autograd.Function), and the Thunder ops of
``linear_cross_entropy_ex`` that MemoryOptimization's ``loss_head`` pass puts in a trace.
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from thunder_memopt.executors._head_math import lse_and_target_logit as _lse_and_target_logit
from thunder_memopt.executors._head_math import logits_grad as _logits_grad
from thunder_memopt.executors._head_math import loss_terms_and_logits_grad_ as _loss_terms_and_logits_grad_
from thunder_memopt.executors._head_math import apply_steps, scaled, softcap_steps, steps_applied_, steps_dtype
from thunder_memopt.executors._head_shapes import (aligned_classes, chunk_tokens, gradient_slices, padded_row, spans,
                                                   vocabulary_width)
from thunder_memopt.executors._loss_checks import REDUCTIONS, check_targets, checked_options
from thunder_memopt.executors.fusion import TensorMetadata, compiled_function, torch_metadata

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ex", "chunk_tokens", "REDUCTIONS"]

# On CUDA each chunk's math is one inductor kernel that reads the model-dtype logits once, instead
# of several passes over fp32 copies, and so is the scaling of the gradients (a bf16 tensor times
# an fp32 scalar tensor takes ATen's slow mixed-dtype path); elsewhere they run eagerly, in place.
# They are compiled as the fusion executor compiles its regions (no dynamo, no AOTAutograd, no
# autotuning), and ahead of the first step with the regions (executors._head_accounting).
COMPILED_DEVICES = {"cuda"}
_TAKES_COMPILED = (_logits_grad, _loss_terms_and_logits_grad_)
# Devices where _linear splits off the classes past the last whole 16 bytes.
SPLIT_DEVICES = {"cuda"}


def _compiled(f, tensors: list[TensorMetadata], **constants):
    """``f`` compiled for tensors of ``tensors``'s metadata (and ``constants``) on a device in
    COMPILED_DEVICES, else None."""
    if tensors[0][2].type not in COMPILED_DEVICES:
        return None
    if f in _TAKES_COMPILED:
        constants["compiled"] = True
    return compiled_function(f, constants, tensors)


def _run(f, *tensors, **constants):
    """``f(*tensors, **constants)``, compiled where COMPILED_DEVICES says, else eagerly."""
    compiled = _compiled(f, [torch_metadata(t) for t in tensors], **constants)
    return f(*tensors, **constants) if compiled is None else compiled(*tensors)


def _model_logits_(raw: torch.Tensor, steps) -> torch.Tensor:
    """The model's logits from the head's matmul ``raw``, after ``steps``: over ``raw`` in one
    compiled kernel where the chunk math is compiled and the steps end in its dtype; else op by op,
    in place where no cast comes first (apply_steps)."""
    if steps and steps_dtype(steps, raw.dtype) == raw.dtype:
        compiled = _compiled(steps_applied_, [torch_metadata(raw)], steps=steps)
        if compiled is not None:
            compiled(raw)
            return raw
    return apply_steps(raw, steps, in_place=True)


def _accumulate_product_(total, a, b):
    """``total += a @ b`` for an fp32 ``total`` and model-dtype ``a`` and ``b``. On CUDA one matmul
    accumulates into ``total`` in fp32 (cuBLAS with beta 1), rounding the product never; elsewhere
    the product is made in the model's dtype and upcast, two temporaries of ``total``'s shape."""
    if total.device.type == "cuda":
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += (a @ b).float()


def _accumulation_temporary_bytes(device, dtype) -> int:
    """Bytes per element of _accumulate_product_'s temporaries, beside its accumulator."""
    return 0 if device.type == "cuda" else 4 + dtype.bytes


def _logits_buffer(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (rows, columns) tensor of ``like``'s dtype whose rows start 16-byte aligned: on CUDA,
    where an unaligned leading dimension keeps cuBLAS off Hopper's TMA kernels, padded where
    ``columns`` needs it (a view of the first ``columns`` of each row); elsewhere dense."""
    row = padded_row(columns, like.element_size()) if like.device.type == "cuda" else columns
    return torch.empty((rows, row), dtype=like.dtype, device=like.device)[:, :columns]


def _linear(hidden, weight, bias, out=None):
    """``linear(hidden, weight, bias)`` into ``out`` (default: a _logits_buffer): one matmul, or on
    CUDA, where the classes are not a whole number of 16 bytes, two: the aligned_classes, then the
    few left. cuBLAS runs a matmul with that many output columns on an sm75 kernel of one-element
    accesses: at Granite-3-8B's width and 49155 classes, T=8192, it took 33.9 ms of a 151 ms step on
    an H100 (benchmarks/results/hf_granite_3_8b_4l_none_1xH100_T8192_profile.md); split, the step
    took 121 ms (hf_granite_3_8b_4l_none_1xH100_T8192.md)."""
    if out is None:
        out = _logits_buffer(hidden.shape[0], weight.shape[0], hidden)
    classes = weight.shape[0]
    split = aligned_classes(classes, hidden.element_size()) if hidden.device.type in SPLIT_DEVICES else classes
    if 0 < split < classes:
        for part in (slice(0, split), slice(split, classes)):
            _linear(hidden, weight[part], None if bias is None else bias[part], out=out[:, part])
        return out
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


def _chunk_logits(hidden, weight, bias, rows: slice, columns: slice = slice(None)):
    """One chunk's logits by its own matmul."""
    return _linear(hidden[rows], weight[columns], None if bias is None else bias[columns])


def _chunk_grad(logits, lse, column, hit, row_scale, logits_grad, steps):
    """A chunk's gradient of the logits the matmul made (_logits_grad), ``logits_grad`` (the chunk of
    the model's own gradient of the head's output, or None) added: before the steps' derivative
    where there are steps; else after, in the logits' dtype, as the unfused backward adds the two."""
    inside = () if logits_grad is None or not steps else (logits_grad,)
    (g,) = _run(_logits_grad, logits, lse, column, hit, row_scale, *inside, steps=steps)
    if logits_grad is not None and not inside:
        g += logits_grad
    return g


def _forward(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk, out_dtype, logits=None):
    """(loss, log-sum-exp of every token) for (N, C) hidden states and (N,) targets; each chunk's
    logits a slice of rows of ``logits``, the head's (N, V) matmul, where given (``steps`` applied
    to them per chunk: () where they are the model's logits already)."""
    n = hidden.shape[0]
    lse, picked = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(2))
    valid = targets != ignore_index
    target = torch.where(valid, targets, 0)
    for start, stop in spans(n, chunk):
        rows = slice(start, stop)
        logits_chunk = _chunk_logits(hidden, weight, bias, rows) if logits is None else logits[rows]
        lse[rows], picked[rows] = _run(_lse_and_target_logit, logits_chunk, target[rows], steps=steps)
        del logits_chunk
    return _loss(lse, picked, valid, reduction).to(out_dtype), lse


def _loss(lse, picked, valid, reduction, count=None):
    """The loss from every token's log-sum-exp and target logit, summed once over all tokens: the
    same bits at any chunk size, so the head's modes agree, and a few kernels per step rather than
    a few per chunk. ``count``: the valid targets, where the caller has counted them already. With
    every target ignored the mean is 0 / 0 (NaN), as cross_entropy's."""
    total = torch.where(valid, lse - picked, 0.0).sum()
    if reduction != "mean":
        return total
    return total / (valid.sum() if count is None else count)


def _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk, out_dtype):
    """(loss, and the gradients of the hidden states, the weight and the bias for a unit upstream
    gradient), computing the logits once.

    Each chunk's logits are written into one tokens x vocab buffer and become there, in one
    kernel, the chunk's loss terms and its logits' gradient in the model's dtype; two whole matmuls
    then give the gradients, each rounded once as in the unfused head. Summing a vocab x C product
    per chunk instead would cost a pass over an fp32 accumulator per chunk, slower than the matmuls
    for Llama-3's 128k vocabulary. The buffer lives only inside this function."""
    n = hidden.shape[0]
    valid = targets != ignore_index
    target = torch.where(valid, targets, 0)
    count = valid.sum()
    # With every target ignored the mean loss is 0 / 0 (NaN, as cross_entropy's) but the gradients are
    # zeros: no row is scaled by 1 / 0.
    row_scale = valid.float() / count.clamp(min=1) if reduction == "mean" else valid.float()
    lse, picked = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(2))
    logits_grad = _logits_buffer(n, weight.shape[0], hidden)
    for start, stop in spans(n, chunk):
        rows = slice(start, stop)
        logits = _linear(hidden[rows], weight, bias, out=logits_grad[rows])
        lse[rows], picked[rows] = _run(_loss_terms_and_logits_grad_, logits, target[rows], valid[rows],
                                       row_scale[rows], steps=steps)
    grad_bias = None if bias is None else logits_grad.sum(0, dtype=torch.float32).to(bias.dtype)
    return (_loss(lse, picked, valid, reduction, count).to(out_dtype), logits_grad @ weight,
            logits_grad.t() @ hidden, grad_bias)


def _backward(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, steps, chunk,
              needs_weight_grad, logits_grad=None, logits=None, columns=None):
    """Gradients of the hidden states, the weight and the bias (None where not needed).

    The walk goes over whichever axis needs the smaller fp32 accumulator: over the vocabulary
    (each slice of the weight's gradient exact, the hidden states' gradient summed, tokens x C)
    when there are fewer tokens than classes, as in training; over the tokens (the weight's
    gradient summed, vocab x C) at long context. ``chunk`` is the tokens per chunk of the forward,
    which fixes the bytes of one chunk's logits either way.

    Where the head's output (after ``steps``) is also a result of the model, ``logits_grad``, the
    gradient of that result, is added to each chunk's softmax gradient (_chunk_grad). Where the
    head's matmul is given whole (``logits``, before the steps), each chunk is a view of it instead
    of a matmul of its own, and ``columns`` (classes per slice) may widen the vocabulary's slices."""
    n, vocab = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index
    scale = grad.float()
    if reduction == "mean":
        scale = scale / valid.sum()
    row_scale = torch.where(valid, scale, 0.0)
    target = torch.where(valid, targets, 0)
    with_bias = bias is not None and needs_weight_grad
    if n < vocab:
        width = columns or vocabulary_width(n, vocab, chunk)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight) if needs_weight_grad else None
        grad_bias = torch.empty_like(bias) if with_bias else None
        for start, stop in spans(vocab, width):
            w, part = weight[start:stop], slice(start, stop)
            logits_chunk = _chunk_logits(hidden, weight, bias, slice(None), part) if logits is None else logits[:, part]
            hit = valid & (target >= start) & (target < stop)
            column = (target - start).clamp_(0, stop - start - 1)
            g = _chunk_grad(logits_chunk, lse, column, hit, row_scale,
                            None if logits_grad is None else logits_grad[:, part], steps)
            del logits_chunk
            _accumulate_product_(grad_hidden, g, w)
            if grad_weight is not None:
                torch.mm(g.t(), hidden, out=grad_weight[start:stop])
            if grad_bias is not None:
                grad_bias[start:stop] = g.float().sum(0).to(bias.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight, grad_bias
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight_grad else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if with_bias else None
    for start, stop in spans(n, chunk):
        h, rows = hidden[start:stop], slice(start, stop)
        logits_chunk = _chunk_logits(hidden, weight, bias, rows) if logits is None else logits[rows]
        g = _chunk_grad(logits_chunk, lse[rows], target[rows], valid[rows], row_scale[rows],
                        None if logits_grad is None else logits_grad[rows], steps)
        del logits_chunk
        grad_hidden[start:stop] = g @ weight
        if grad_weight is not None:
            _accumulate_product_(grad_weight, g.t(), h)
        if grad_bias is not None:
            grad_bias += g.float().sum(0)
    return (
        grad_hidden,
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, steps, chunk, gradients_in_forward):
        ctx.gradients_in_forward = gradients_in_forward
        if gradients_in_forward:
            loss, *unit = _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, steps,
                                                  chunk, torch.float32)
            # Saved, so that autograd frees them after the backward, or keeps them for another
            # with retain_graph=True.
            ctx.save_for_backward(*unit)
            return loss
        loss, lse = _forward(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk, torch.float32)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.options = (ignore_index, reduction, steps, chunk)
        return loss

    @staticmethod
    def backward(ctx, grad):
        # Autograd enables grad mode in a backward only for create_graph=True. The chunks' math runs
        # in place and records no graph, so the gradients would not be differentiable.
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy: double backward (create_graph=True) is not supported")
        if ctx.gradients_in_forward:
            # Out of place: a second backward (retain_graph=True) scales them again.
            grads = _scaled(grad, *ctx.saved_tensors)
        else:
            hidden, weight, bias, targets, lse = ctx.saved_tensors
            needs_weight_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
            grads = _backward(grad, hidden, weight, bias, targets, lse, *ctx.options, needs_weight_grad)
        return (*grads, None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    chunk_size: int | None = None,
    gradients_in_forward: bool = False,
) -> torch.Tensor:
    """``cross_entropy(linear(hidden, weight, bias), targets)`` in fp32, never holding the logits.

    Args:
        hidden: (..., C) hidden states.
        weight: (V, C) head weight; ``bias``: (V,) or None.
        targets: (...) class indices, the leading shape of ``hidden``.
        ignore_index: targets equal to it add nothing and are not counted by ``mean``.
        reduction: "mean" or "sum".
        softcap: if given, logits become ``softcap * tanh(logits / softcap)`` (Gemma's final soft-capping);
            infinity caps nothing.
        chunk_size: tokens per chunk; None picks them by ``chunk_tokens``.
        gradients_in_forward: compute the gradients in the forward with the logits it has (one
            matmul less; the logits' gradient, tokens x vocab in the model's dtype, lives during
            the forward, and the gradients until the backward) instead of recomputing the logits
            in the backward (nothing of vocabulary size saved).

    Returns the fp32 scalar loss.
    """
    options = checked_options(ignore_index, reduction, softcap, chunk_size, gradients_in_forward)
    if hidden.shape[:-1] != targets.shape or weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: expected hidden (..., C), weight (V, C) and targets (...), got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(targets.shape)}"
        )
    check_targets(targets, weight.shape[0], options.ignore_index)
    flat = hidden.reshape(-1, hidden.shape[-1])
    chunk = options.chunk_size or chunk_tokens(flat.shape[0], weight.shape[0],
                                               gradients_in_forward=gradients_in_forward, device=flat.device.type)
    return _LinearCrossEntropy.apply(flat, weight, bias, targets.reshape(-1), options.ignore_index, options.reduction,
                                     softcap_steps(options.softcap), chunk, gradients_in_forward)


# The Thunder executor and its ops. ``head_loss`` is what the loss_head pass puts in a trace; its
# grad transform picks, by ``gradients_in_forward``, the forward/backward pair that training runs:
# - False (Cut Cross-Entropy): the forward keeps the log-sum-exp, the backward recomputes each
#   chunk's logits (one more matmul; nothing of vocabulary size is saved);
# - True: the forward computes the gradients for a unit upstream gradient with the logits it has
#   and saves them; the backward scales them. They are the head's own gradients, which its backward
#   would create at once anyway; the cost is a tokens x vocab buffer during the head's forward.
# ``head_loss_and_logits`` is the head whose logits are also the model's result: one whole matmul
# makes them. False: the backward recomputes them in chunks and adds their own gradient. True: the
# forward computes the loss's gradients from slices of that matmul's output, which is whole anyway
# (no tokens x vocab buffer more), and the backward adds the logits' own gradient only where they
# have one.

linear_cross_entropy_ex = OperatorExecutor("memopt_linear_cross_entropy", version="0.1")
register_executor(linear_cross_entropy_ex)


# Every op takes ``steps`` (thunder_memopt.executors._head_math) after ``chunk``: the model's ops between
# the head's matmul and its loss, () for none.
def _loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
               gradients_in_forward=False):
    return TensorProxy(like=hidden, shape=(), dtype=out_dtype)


def _loss_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
               gradients_in_forward=False):
    return _forward_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype)[0]


def _forward_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    lse = TensorProxy(like=hidden, shape=(hidden.shape[0],), dtype=dtypes.float32, requires_grad=False)
    return _loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype), lse


def _forward_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    return _forward(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk,
                    dtypes.to_torch_dtype(out_dtype))


def _forward_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    loss, lse = _forward_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype)
    logits = TensorProxy(like=hidden, shape=(hidden.shape[0], weight.shape[0]), dtype=steps_dtype(steps, hidden.dtype))
    return loss, logits, lse


def _forward_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    # The model's logits: the same one matmul, then its ops on them, whole, as the model runs them.
    logits = _model_logits_(_linear(hidden, weight, bias), steps)
    loss, lse = _forward(hidden, weight, bias, targets, ignore_index, reduction, (), chunk,
                         dtypes.to_torch_dtype(out_dtype), logits)
    return loss, logits, lse


def _logits_with_gradients_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    grads = _backward_meta(None, hidden, weight, bias, targets, None, ignore_index, reduction, chunk, steps)
    return (*_forward_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps,
                                      out_dtype), *grads)


def _logits_with_gradients_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    """(loss, the model's logits, log-sum-exp, and the gradients for a unit upstream gradient): the
    head's one whole matmul, the loss from it, then the loss's gradients from views of it, in slices
    of gradient_slices' size (the logits are whole anyway, so no matmul is made twice), before the
    steps make the model's logits of it in place."""
    raw = _linear(hidden, weight, bias)
    loss, lse = _forward(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk,
                         dtypes.to_torch_dtype(out_dtype), raw)
    rows, columns = gradient_slices(*raw.shape, raw.element_size())
    unit = torch.ones((), dtype=torch.float32, device=hidden.device)
    grads = _backward(unit, hidden, weight, bias, targets, lse, ignore_index, reduction, steps, rows, True,
                      logits=raw, columns=columns)
    return loss, _model_logits_(raw, steps), lse, *grads


def _scale_with_logits_grad_meta(grad, logits_grad, hidden, weight, bias, targets, lse, ignore_index, reduction,
                                 chunk, steps, grad_hidden, grad_weight, grad_bias):
    return _scale_meta(grad, grad_hidden, grad_weight, grad_bias)


def _scale_with_logits_grad_impl(grad, logits_grad, hidden, weight, bias, targets, lse, ignore_index, reduction,
                                 chunk, steps, grad_hidden, grad_weight, grad_bias):
    """The unit gradients scaled by ``grad`` in place (_scale_), plus the model's own gradient of its
    logits where it has one. One wait for the device reads whether ``grad`` is 1 (the usual loss:
    then the unit gradients are the gradients, and no pass over the weight's is made) and whether
    autograd handed the logits a gradient that is not zeros, as it does for a result that nothing
    used (where the loss-head pass marked the logits, none: executors.unmade_gradients). Such a
    gradient goes through the chunks of _backward, which recompute the logits (the steps'
    derivative needs them) and add nothing of the loss's (its scale is 0)."""
    logits_grad = _model_logits_grad(logits_grad)
    checks = [grad != 1] + ([] if logits_grad is None else [_stored_elements(logits_grad).any()])
    not_unit, *added = torch.stack(checks).tolist()
    grads = (grad_hidden, grad_weight, grad_bias)
    if not_unit:
        _scale_(grad, *grads)
    if any(added):
        nothing = torch.zeros((), dtype=torch.float32, device=hidden.device)
        extra = _backward(nothing, hidden, weight, bias, targets, lse, ignore_index, reduction, steps, chunk, True,
                          logits_grad)
        for g, e in zip(grads, extra):
            if g is not None:
                g += e
    return grads


# The attribute of the zero that a gradient never made broadcasts (executors.unmade_gradients).
UNMADE = "_memopt_unmade_gradient"


def _model_logits_grad(t: torch.Tensor | None) -> torch.Tensor | None:
    """The model's own gradient of its logits, or None where there is none: none came, or it is the
    zero broadcast for logits the caller left unused (a view of a zero tagged UNMADE)."""
    if t is None:
        return None
    return None if getattr(t if t._base is None else t._base, UNMADE, False) else t


def _stored_elements(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where every stride is 0 (a broadcast scalar, as autograd hands a sum's gradient) its
    one stored element."""
    return t[(0,) * t.ndim] if t.numel() and not any(t.stride()) else t


def _loss_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
                          gradients_in_forward=False):
    return _forward_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps,
                                    out_dtype)[:2]


def _loss_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
                          gradients_in_forward=False):
    return _forward_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps,
                                    out_dtype)[:2]


def _backward_meta(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, chunk, steps,
                   logits_grad=None):
    return (TensorProxy(like=hidden), TensorProxy(like=weight), None if bias is None else TensorProxy(like=bias))


def _backward_impl(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, chunk, steps,
                   logits_grad=None):
    return _backward(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, steps, chunk, True,
                     _model_logits_grad(logits_grad))


def _with_gradients_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    grads = _backward_meta(None, hidden, weight, bias, targets, None, ignore_index, reduction, chunk, steps)
    return (_loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype), *grads)


def _with_gradients_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype):
    return _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, steps, chunk,
                                   dtypes.to_torch_dtype(out_dtype))


def _scale_meta(grad, grad_hidden, grad_weight, grad_bias):
    return (TensorProxy(like=grad_hidden), TensorProxy(like=grad_weight),
            None if grad_bias is None else TensorProxy(like=grad_bias))


def _scaled(grad, *grads):
    """The unit gradients times ``grad``, as new tensors (None stays None)."""
    products = iter(_run(scaled, grad, *(g for g in grads if g is not None)))
    return tuple(None if g is None else next(products) for g in grads)


def _scale_(grad, *grads):
    """The unit gradients computed in the forward times ``grad``, in place and in one launch, each
    product rounded once as ``scaled`` rounds it. They were saved for the op that scales them alone,
    so no other reader sees them change.

    The memory model prices the scale's outputs as new storages, as an out-of-place scale would
    allocate them: at that op it counts the gradients' bytes twice, an upper bound. Priced as the
    unit gradients themselves, the backward's schedule ran the recomputed regions of every layer
    before the head, and Phi-3's peak rose from 7.53 to 8.19 GiB (1xH100, 4 layers, T=8192): the
    model underestimates the start of that backward, by a term not found yet (the cuDNN masks'
    biases, which live as long as their masks, are one it does not hold)."""
    torch._foreach_mul_([g for g in grads if g is not None], grad)
    return grads


# Tagged as a matmul: the recompute pass replays it only below budget 1.0, like the head's linear.
_TAGS = (OpTags.MATMUL_OP, OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD)
head_loss = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy", meta=_loss_meta, fn=_loss_impl, tags=_TAGS)
head_forward = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_forward", meta=_forward_meta, fn=_forward_impl, tags=_TAGS)
head_forward_and_logits = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_forward_and_logits", meta=_forward_and_logits_meta, fn=_forward_and_logits_impl,
    tags=_TAGS)
head_loss_and_logits = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_and_logits", meta=_loss_and_logits_meta, fn=_loss_and_logits_impl, tags=_TAGS)
head_backward = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_backward", meta=_backward_meta, fn=_backward_impl, tags=(OpTags.MATMUL_OP,))
head_forward_with_gradients = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_forward_with_gradients", meta=_with_gradients_meta, fn=_with_gradients_impl,
    tags=_TAGS)
head_scale_gradients = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_scale_gradients", meta=_scale_meta, fn=_scale_)
head_forward_logits_with_gradients = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_forward_and_logits_with_gradients", meta=_logits_with_gradients_meta,
    fn=_logits_with_gradients_impl, tags=_TAGS)
head_scale_with_logits_grad = linear_cross_entropy_ex.register_operator(
    "memopt_linear_cross_entropy_scale_gradients_and_logits_grad", meta=_scale_with_logits_grad_meta,
    fn=_scale_with_logits_grad_impl)


def _grad(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
          gradients_in_forward=False):
    options = (ignore_index, reduction, chunk, steps)
    if gradients_in_forward:
        loss, *unit = head_forward_with_gradients(hidden, weight, bias, targets, *options, out_dtype)
        grads = head_scale_gradients(get_grad(loss), *unit)
    else:
        loss, lse = head_forward(hidden, weight, bias, targets, *options, out_dtype)
        grads = head_backward(get_grad(loss), hidden, weight, bias, targets, lse, *options)
    _put_head_grads(hidden, weight, bias, grads)
    return loss


def _put_head_grads(hidden, weight, bias, grads) -> None:
    inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
    put_grads(inputs, grads[: len(inputs)])


def _grad_and_logits(hidden, weight, bias, targets, ignore_index, reduction, chunk, steps, out_dtype,
                     gradients_in_forward=False):
    options = (ignore_index, reduction, chunk, steps)
    if gradients_in_forward:
        loss, logits, lse, *unit = head_forward_logits_with_gradients(hidden, weight, bias, targets, *options,
                                                                       out_dtype)
        grads = head_scale_with_logits_grad(get_grad(loss), get_grad(logits), hidden, weight, bias, targets, lse,
                                            *options, *unit)
    else:
        loss, logits, lse = head_forward_and_logits(hidden, weight, bias, targets, *options, out_dtype)
        # The backward recomputes the logits (saving them would keep tokens x vocab until it runs),
        # and adds their own gradient.
        grads = head_backward(get_grad(loss), hidden, weight, bias, targets, lse, *options, get_grad(logits))
    _put_head_grads(hidden, weight, bias, grads)
    return loss, logits


linear_cross_entropy_ex.register_implementation(head_loss, head_loss, grad_transform=_grad)
linear_cross_entropy_ex.register_implementation(head_loss_and_logits, head_loss_and_logits,
                                                grad_transform=_grad_and_logits)
