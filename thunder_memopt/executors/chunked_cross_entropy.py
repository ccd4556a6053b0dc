"""The fused loss head: a linear layer and its cross-entropy, without ever holding the logits.

The head's output is tokens x vocabulary: for stablecode (vocab 49152) at T=8192 that is 768 MiB in
bf16, and the unfused loss saves it, and its log-softmax, for the backward, then builds a gradient
of the same size. Following Apple's Cut Cross-Entropy, this head walks the tokens in chunks:

- forward: each chunk's logits, their log-sum-exp and the target's logit; only the log-sum-exp
  (4 bytes a token) is kept;
- backward: each chunk's logits again (one more matmul), the softmax gradient, and from it the
  gradients of the hidden states and of the head's weight and bias. One of the two is summed over
  the chunks in fp32 and cast once at the end: the weight's when the chunks are of tokens, the
  hidden states' when they are of the vocabulary, whichever accumulator is smaller.

So the backward needs the hidden states, the weight, the targets and the log-sum-exp, and no
tensor of vocabulary size lives longer than a chunk. The logits are computed by the same matmul
in the model's dtype as the unfused head and upcast per chunk, so the loss is the fp32 loss of the
same logits; only the order of summation differs.

Two ways in:
- ``linear_cross_entropy(hidden, weight, targets, ...)``, a torch function (an autograd.Function)
  for loops that compute the loss outside the compiled model;
- the Thunder symbol ``memopt_linear_cross_entropy`` of ``linear_cross_entropy_ex``, which
  MemoryOptimization's ``loss_head`` pass puts in place of ``linear -> cross_entropy`` in a trace
  (thunder_memopt.passes.loss_head). Its grad transform saves what the backward above needs.
  Where the model also returns the logits (transformers), ``memopt_linear_cross_entropy_and_logits``
  makes them whole, the model's result, but does not save them: its backward recomputes them in
  chunks like the other forms and adds their own gradient. Saved, they would be the step's largest
  tensor (2 GiB for Llama-3 at T=8192, more than two layers' saved activations) to spare one matmul.
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from thunder_memopt.core.memory import WORKSPACE_BYTES
from thunder_memopt.executors._loss_checks import REDUCTIONS, check_targets, checked_options
from thunder_memopt.executors.fusion import COMPILED_FUNCTIONS_OF, TensorMetadata, compiled_function, torch_metadata

__all__ = ["linear_cross_entropy", "linear_cross_entropy_ex", "chunk_tokens", "REDUCTIONS"]

# Bytes of one chunk's fp32 logits: big enough for efficient matmuls, small next to the activations.
_CHUNK_LOGIT_BYTES = 128 * 2**20
_CHUNK_MULTIPLE = 128
_MIN_CHUNKS = 8


def chunk_tokens(tokens: int, vocab: int, *, gradients_in_forward: bool = False, device: str = "cpu") -> int:
    """Tokens per chunk: fp32 logits of about 128 MiB, and at least eight chunks where that would
    leave fewer (so that a small head's chunk is still small next to its logits), a multiple of
    128 tokens, at most all (and at least one, so that no input makes a step of zero).

    With the gradients in the forward on CUDA, all tokens: there the logits are written into the
    logits' gradient buffer, tokens x vocab anyway, and each chunk's math is one compiled kernel
    without an fp32 copy, so one chunk costs no memory and makes one whole matmul."""
    if gradients_in_forward and device == "cuda":
        return max(1, tokens)
    by_bytes = _CHUNK_LOGIT_BYTES // (4 * vocab)
    by_count = -(-tokens // _MIN_CHUNKS)
    per_chunk = max(_CHUNK_MULTIPLE, min(by_bytes, by_count) // _CHUNK_MULTIPLE * _CHUNK_MULTIPLE)
    return max(1, min(tokens, per_chunk))


def _upcast(logits, softcap):
    """A chunk's model-dtype logits in fp32, soft-capped if asked; a new tensor, free to overwrite."""
    logits = logits.to(torch.float32, copy=True)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _lse_and_target_logit(logits, target, softcap):
    """Each row's log-sum-exp and its target's logit, from one chunk's model-dtype logits."""
    z = _upcast(logits, softcap)
    picked = z.gather(1, target.unsqueeze(1)).squeeze(1)
    # In place: one chunk of fp32 logits is all the transient memory, when run eagerly.
    top = z.amax(dim=-1, keepdim=True)
    lse = z.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
    return lse, picked


def _logits_grad(logits, lse, column, hit, row_scale, softcap, compiled=False):
    """(d loss / d logits,) of one chunk, in the logits' dtype: softmax - one_hot(target), times each
    row's scale (zero for ignored tokens). ``column`` is each row's target column in the chunk, and
    ``hit`` says whether the target falls in it. ``compiled``: traced for inductor. A tuple, as every
    compiled function returns."""
    z = _upcast(logits, softcap)
    # d(c tanh(x/c))/dx, from the capped logits, before they are overwritten.
    capped = None if softcap is None else z.div(softcap).square_().neg_().add_(1.0)
    g = z.sub_(lse[:, None]).exp_()
    # Minus the one-hot target. Eagerly an indexed update in place allocates nothing; compiled, it
    # would make inductor materialize the chunk in fp32, where a mask is pointwise and fuses. Both
    # subtract 1 at the target and nothing elsewhere.
    if compiled:
        g.sub_(((torch.arange(g.shape[1], device=g.device) == column[:, None]) & hit[:, None]).to(torch.uint8))
    else:
        g[torch.arange(g.shape[0], device=g.device), column] -= hit.to(g.dtype)
    g *= row_scale[:, None]
    if capped is not None:
        g *= capped
    return (g.to(logits.dtype),)


def _loss_terms_and_logits_grad_(logits, target, hit, row_scale, softcap, compiled=False):
    """A chunk's loss terms (log-sum-exp, target logit), its logits overwritten by their gradient."""
    lse, picked = _lse_and_target_logit(logits, target, softcap)
    logits.copy_(_logits_grad(logits, lse, target, hit, row_scale, softcap, compiled)[0])
    return lse, picked


def _scaled(grad, *grads):
    """The unit-upstream gradients computed in the forward, times the upstream gradient."""
    return tuple(g * grad for g in grads)


# On CUDA each chunk's math is one inductor kernel that reads the model-dtype logits once, instead
# of several passes over fp32 copies, and so is the scaling of the gradients (a bf16 tensor times
# an fp32 scalar tensor takes ATen's slow mixed-dtype path); elsewhere they run eagerly, in place.
# They are compiled as the fusion executor compiles its regions (no dynamo, no AOTAutograd, no
# autotuning), and ahead of the first step with the regions (COMPILED_FUNCTIONS_OF below).
COMPILED_DEVICES = {"cuda"}
_TAKES_COMPILED = (_logits_grad, _loss_terms_and_logits_grad_)


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


def _vocabulary_width(tokens: int, vocab: int, chunk: int) -> int:
    """Classes per slice when the backward walks the vocabulary (fewer tokens than classes): the
    bytes of one forward chunk of ``chunk`` tokens' logits (all classes when there are no tokens)."""
    return max(1, chunk * vocab // tokens) if tokens else vocab


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive chunks of ``step`` (the last one shorter) covering ``total``."""
    return [(start, min(total, start + step)) for start in range(0, total, step)]


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


def _chunk_logits(hidden, weight, bias, rows: slice, columns: slice = slice(None)):
    """One chunk's logits, dense, by its own matmul."""
    return torch.nn.functional.linear(hidden[rows], weight[columns], None if bias is None else bias[columns])


def _forward(hidden, weight, bias, targets, ignore_index, reduction, softcap, chunk, out_dtype, logits=None):
    """(loss, log-sum-exp of every token) for (N, C) hidden states and (N,) targets; each chunk's
    logits a slice of rows of ``logits``, the head's (N, V) output, where given (a dense view)."""
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, stop in _spans(n, chunk):
        rows = slice(start, stop)
        logits_chunk = _chunk_logits(hidden, weight, bias, rows) if logits is None else logits[rows]
        t = targets[start:stop]
        valid = t != ignore_index
        lse[start:stop], picked = _run(_lse_and_target_logit, logits_chunk, torch.where(valid, t, 0), softcap=softcap)
        del logits_chunk
        total += torch.where(valid, lse[start:stop] - picked, 0.0).sum()
    if reduction == "mean":
        total = total / (targets != ignore_index).sum()
    return total.to(out_dtype), lse


def _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, softcap, chunk, out_dtype):
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
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    logits_grad = torch.empty((n, weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
    for start, stop in _spans(n, chunk):
        logits = logits_grad[start:stop]
        if bias is None:
            torch.mm(hidden[start:stop], weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden[start:stop], weight.t(), out=logits)
        lse, picked = _run(_loss_terms_and_logits_grad_, logits, target[start:stop], valid[start:stop],
                           row_scale[start:stop], softcap=softcap)
        total += torch.where(valid[start:stop], lse - picked, 0.0).sum()
    if reduction == "mean":
        total = total / count
    grad_bias = None if bias is None else logits_grad.sum(0, dtype=torch.float32).to(bias.dtype)
    return total.to(out_dtype), logits_grad @ weight, logits_grad.t() @ hidden, grad_bias


def _backward(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, softcap, chunk,
              needs_weight_grad, logits_grad=None):
    """Gradients of the hidden states, the weight and the bias (None where not needed).

    The walk goes over whichever axis needs the smaller fp32 accumulator: over the vocabulary
    (each slice of the weight's gradient exact, the hidden states' gradient summed, tokens x C)
    when there are fewer tokens than classes, as in training; over the tokens (the weight's
    gradient summed, vocab x C) at long context. ``chunk`` is the tokens per chunk of the forward,
    which fixes the bytes of one chunk's logits either way.

    Where the head's output is also a result of the model, ``logits_grad``, the gradient of that
    result, is added to each chunk's softmax gradient in the logits' dtype, as the unfused backward
    adds the two."""
    n, vocab = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index
    scale = grad.float()
    if reduction == "mean":
        scale = scale / valid.sum()
    row_scale = torch.where(valid, scale, 0.0)
    target = torch.where(valid, targets, 0)
    with_bias = bias is not None and needs_weight_grad
    if n < vocab:
        width = _vocabulary_width(n, vocab, chunk)
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight) if needs_weight_grad else None
        grad_bias = torch.empty_like(bias) if with_bias else None
        for start, stop in _spans(vocab, width):
            w = weight[start:stop]
            columns = slice(start, stop)
            logits_chunk = _chunk_logits(hidden, weight, bias, slice(None), columns)
            hit = valid & (target >= start) & (target < stop)
            column = (target - start).clamp_(0, stop - start - 1)
            (g,) = _run(_logits_grad, logits_chunk, lse, column, hit, row_scale, softcap=softcap)
            del logits_chunk
            if logits_grad is not None:
                g += logits_grad[:, columns]
            _accumulate_product_(grad_hidden, g, w)
            if grad_weight is not None:
                grad_weight[start:stop] = g.t() @ hidden
            if grad_bias is not None:
                grad_bias[start:stop] = g.float().sum(0).to(bias.dtype)
        return grad_hidden.to(hidden.dtype), grad_weight, grad_bias
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight_grad else None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if with_bias else None
    for start, stop in _spans(n, chunk):
        h, rows = hidden[start:stop], slice(start, stop)
        logits_chunk = _chunk_logits(hidden, weight, bias, rows)
        (g,) = _run(_logits_grad, logits_chunk, lse[rows], target[rows], valid[rows], row_scale[rows],
                    softcap=softcap)
        del logits_chunk
        if logits_grad is not None:
            g += logits_grad[rows]
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
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, softcap, chunk, gradients_in_forward):
        ctx.gradients_in_forward = gradients_in_forward
        if gradients_in_forward:
            loss, *unit = _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, softcap,
                                                  chunk, torch.float32)
            # Saved, so that autograd frees them after the backward, or keeps them for another
            # with retain_graph=True.
            ctx.save_for_backward(*unit)
            return loss
        loss, lse = _forward(hidden, weight, bias, targets, ignore_index, reduction, softcap, chunk, torch.float32)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.options = (ignore_index, reduction, softcap, chunk)
        return loss

    @staticmethod
    def backward(ctx, grad):
        # Autograd enables grad mode in a backward only for create_graph=True. The chunks' math runs
        # in place and records no graph, so the gradients would not be differentiable.
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy: double backward (create_graph=True) is not supported")
        if ctx.gradients_in_forward:
            grads = _scale_impl(grad, *ctx.saved_tensors)
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
                                     options.softcap, chunk, gradients_in_forward)


# The Thunder executor and its symbols. ``head_loss`` is what the loss_head pass puts in a trace; its
# grad transform picks, by ``gradients_in_forward``, the forward/backward pair that training runs:
# - False (Cut Cross-Entropy): the forward keeps the log-sum-exp, the backward recomputes each
#   chunk's logits (one more matmul; nothing of vocabulary size is saved);
# - True: the forward computes the gradients for a unit upstream gradient with the logits it has
#   (no matmul is repeated) and saves them; the backward scales them. They are the head's own
#   parameter and input gradients, which the backward would create at once anyway; the cost is the
#   logits' gradient (tokens x vocab, model dtype) during the head's forward.
# ``head_loss_and_logits`` is the head whose logits are also a result of the model (transformers'
# ``CausalLMOutput.logits``): one whole matmul makes them, as the unfused head does; the backward
# recomputes them in chunks, as head_backward does for head_loss, and adds their own gradient. What
# it never holds whole is the fp32 logits, their log-softmax and the loss's gradient of the logits,
# and it saves nothing of vocabulary size for the backward.

linear_cross_entropy_ex = OperatorExecutor("memopt_linear_cross_entropy", version="0.1")
register_executor(linear_cross_entropy_ex)


def _loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype, gradients_in_forward=False):
    return TensorProxy(like=hidden, shape=(), dtype=out_dtype)


def _loss_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype, gradients_in_forward=False):
    return _forward_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype)[0]


def _forward_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    lse = TensorProxy(like=hidden, shape=(hidden.shape[0],), dtype=dtypes.float32, requires_grad=False)
    return _loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype), lse


def _forward_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    return _forward(hidden, weight, bias, targets, ignore_index, reduction, None, chunk,
                    dtypes.to_torch_dtype(out_dtype))


def _forward_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    loss, lse = _forward_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype)
    return loss, TensorProxy(like=hidden, shape=(hidden.shape[0], weight.shape[0])), lse


def _forward_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    loss, lse = _forward(hidden, weight, bias, targets, ignore_index, reduction, None, chunk,
                         dtypes.to_torch_dtype(out_dtype), logits)
    return loss, logits, lse


def _loss_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    return _forward_and_logits_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype)[:2]


def _loss_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    return _forward_and_logits_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype)[:2]


def _backward_meta(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, chunk, logits_grad=None):
    return (TensorProxy(like=hidden), TensorProxy(like=weight), None if bias is None else TensorProxy(like=bias))


def _backward_impl(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, chunk, logits_grad=None):
    return _backward(grad, hidden, weight, bias, targets, lse, ignore_index, reduction, None, chunk, True,
                     logits_grad)


def _with_gradients_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    grads = _backward_meta(None, hidden, weight, bias, targets, None, ignore_index, reduction, chunk)
    return (_loss_meta(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype), *grads)


def _with_gradients_impl(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    return _forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, None, chunk,
                                   dtypes.to_torch_dtype(out_dtype))


def _scale_meta(grad, grad_hidden, grad_weight, grad_bias):
    return (TensorProxy(like=grad_hidden), TensorProxy(like=grad_weight),
            None if grad_bias is None else TensorProxy(like=grad_bias))


def _scale_impl(grad, grad_hidden, grad_weight, grad_bias):
    scaled = iter(_run(_scaled, grad, *(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None)))
    return tuple(None if g is None else next(scaled) for g in (grad_hidden, grad_weight, grad_bias))


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
    "memopt_linear_cross_entropy_scale_gradients", meta=_scale_meta, fn=_scale_impl)


def _grad(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype, gradients_in_forward=False):
    if gradients_in_forward:
        loss, *unit = head_forward_with_gradients(hidden, weight, bias, targets, ignore_index, reduction, chunk,
                                                  out_dtype)
        grads = head_scale_gradients(get_grad(loss), *unit)
    else:
        loss, lse = head_forward(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype)
        grads = head_backward(get_grad(loss), hidden, weight, bias, targets, lse, ignore_index, reduction, chunk)
    _put_head_grads(hidden, weight, bias, grads)
    return loss


def _put_head_grads(hidden, weight, bias, grads) -> None:
    inputs = (hidden, weight) if bias is None else (hidden, weight, bias)
    put_grads(inputs, grads[: len(inputs)])


def _grad_and_logits(hidden, weight, bias, targets, ignore_index, reduction, chunk, out_dtype):
    loss, logits, lse = head_forward_and_logits(hidden, weight, bias, targets, ignore_index, reduction, chunk,
                                                out_dtype)
    # The backward recomputes the logits (saving them would keep tokens x vocab until it runs), and
    # adds their own gradient.
    grads = head_backward(get_grad(loss), hidden, weight, bias, targets, lse, ignore_index, reduction, chunk,
                          get_grad(logits))
    _put_head_grads(hidden, weight, bias, grads)
    return loss, logits


linear_cross_entropy_ex.register_implementation(head_loss, head_loss, grad_transform=_grad)
linear_cross_entropy_ex.register_implementation(head_loss_and_logits, head_loss_and_logits,
                                                grad_transform=_grad_and_logits)


# What the memory model cannot see: each op's chunks of logits (and of their gradient), its
# accumulator and, with the gradients in the forward, the logits' gradient buffer that the logits
# are written into. Eagerly (off CUDA) a chunk's math adds its temporaries.
def _eager_temporaries(hidden: TensorProxy, rows: int, columns: int, *, gradient: bool) -> int:
    """A chunk's fp32 copy and, for its gradient, the model-dtype result; none on CUDA, where the
    math is one compiled kernel."""
    if hidden.device.type == "cuda":
        return 0
    return rows * columns * (4 + (hidden.dtype.bytes if gradient else 0))


def _forward_workspace(bsym) -> int:
    hidden, weight, chunk = bsym.args[0], bsym.args[1], bsym.args[6]
    rows, vocab = min(chunk, hidden.shape[0]), weight.shape[0]
    # Where the op makes the whole logits (its output), a chunk's logits are a view of them.
    matmul = 0 if bsym.sym.name in _WITH_LOGITS else rows * vocab * hidden.dtype.bytes
    return matmul + _eager_temporaries(hidden, rows, vocab, gradient=False)


def _with_gradients_workspace(bsym) -> int:
    hidden, weight, chunk = bsym.args[0], bsym.args[1], bsym.args[6]
    (n, _), vocab = hidden.shape, weight.shape[0]
    return n * vocab * hidden.dtype.bytes + _eager_temporaries(hidden, min(chunk, n), vocab, gradient=True)


def _backward_workspace(bsym) -> int:
    hidden, weight, chunk = bsym.args[1], bsym.args[2], bsym.args[8]
    (n, width), vocab = hidden.shape, weight.shape[0]
    if n < vocab:  # vocabulary chunks; the hidden states' gradient summed in fp32
        rows, columns, accumulator = n, _vocabulary_width(n, vocab, chunk), n * width
    else:
        rows, columns, accumulator = min(chunk, n), vocab, vocab * width
    logits_and_gradient = 2 * rows * columns * hidden.dtype.bytes  # a chunk's
    return (logits_and_gradient + _eager_temporaries(hidden, rows, columns, gradient=True)
            + accumulator * (4 + _accumulation_temporary_bytes(hidden.device, hidden.dtype)))


def _functions_called(bsym) -> list:
    """The compiled functions an op of the head will call (``_run``), for compile_ahead: one per
    function and chunk size, on the shapes its loops give them; all their inputs are contiguous."""
    name = bsym.sym.name
    if name == head_scale_gradients.name:
        calls = [(_scaled, [torch_metadata(a) for a in bsym.args if a is not None])]
    else:
        backward = name == head_backward.name
        hidden, weight, targets = bsym.args[1:3] + bsym.args[4:5] if backward else bsym.args[:2] + bsym.args[3:4]
        chunk = bsym.args[8] if backward else bsym.args[6]
        (n, _), vocab = hidden.shape, weight.shape[0]
        _, dtype, device = torch_metadata(hidden)
        index = dtypes.to_torch_dtype(targets.dtype)

        def rows(r: int, columns: int = vocab) -> list[TensorMetadata]:  # logits, then per-row tensors
            return [((r, columns), dtype, device)] + [((r,), t, device) for t in kinds]

        sizes = sorted({stop - start for start, stop in _spans(n, chunk)})
        if name == head_forward_with_gradients.name:
            kinds, f = (index, torch.bool, torch.float32), _loss_terms_and_logits_grad_
            calls = [(f, rows(r)) for r in sizes]
        elif not backward:
            kinds, f = (index,), _lse_and_target_logit
            calls = [(f, rows(r)) for r in sizes]
        else:
            kinds = (torch.float32, index, torch.bool, torch.float32)
            if n < vocab:  # as _backward walks the vocabulary
                widths = sorted({stop - start for start, stop in _spans(vocab, _vocabulary_width(n, vocab, chunk))})
                calls = [(_logits_grad, rows(n, c)) for c in widths]
            else:
                calls = [(_logits_grad, rows(r)) for r in sizes]
    # The ops' implementations pass no soft-capping (the public function's own path is not a Thunder op).
    constants = {} if name == head_scale_gradients.name else {"softcap": None}
    return [c for f, tensors in calls if (c := _compiled(f, tensors, **constants)) is not None]


COMPILED_FUNCTIONS_OF.update({op.name: _functions_called for op in (
    head_loss, head_forward, head_forward_with_gradients, head_backward, head_scale_gradients,
    head_loss_and_logits, head_forward_and_logits)})


_WITH_LOGITS = {head_loss_and_logits.name, head_forward_and_logits.name}
WORKSPACE_BYTES.update({
    head_loss.name: _forward_workspace,
    head_forward.name: _forward_workspace,
    head_loss_and_logits.name: _forward_workspace,
    head_forward_and_logits.name: _forward_workspace,
    head_forward_with_gradients.name: _with_gradients_workspace,
    head_backward.name: _backward_workspace,
})
