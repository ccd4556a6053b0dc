"""What the fused loss head's ops hold and compile beyond what their traces show.

- ``WORKSPACE_BYTES`` (core.storages), per op: its chunks of logits and of their gradient, its
  accumulator, and with the gradients in the forward the logits' gradient buffer; eagerly (off
  CUDA) each chunk's math adds its temporaries.
- ``COMPILED_FUNCTIONS_OF`` (executors.fusion), per op: the compiled chunk functions it will call,
  so that they compile ahead of the first step with the regions.

Registered by importing this module (thunder_memopt.executors does).
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes
from thunder.core.proxies import TensorProxy

from thunder_memopt.core.memory import WORKSPACE_BYTES
from thunder_memopt.executors._head_math import steps_applied_, steps_dtype
from thunder_memopt.executors._head_shapes import gradient_slices, spans, vocabulary_width
from thunder_memopt.executors import chunked_cross_entropy as cce
from thunder_memopt.executors.chunked_cross_entropy import (
    _accumulation_temporary_bytes, _compiled, _lse_and_target_logit, _logits_grad, _loss_terms_and_logits_grad_,
    head_backward, head_forward, head_forward_and_logits, head_forward_logits_with_gradients,
    head_forward_with_gradients, head_loss, head_loss_and_logits)
from thunder_memopt.executors.fusion import COMPILED_FUNCTIONS_OF, TensorMetadata, torch_metadata

__all__ = ["PRICED_AS_COMPILED"]

# Device types priced as if the head compiled its chunk math there, though it runs it eagerly:
# meta's, while ``python -m thunder_memopt plan`` traces as the GPU's executors run
# (``plan._executors_claim_meta``).
PRICED_AS_COMPILED: set[str] = set()


def _eager_temporaries(hidden: TensorProxy, rows: int, columns: int, steps, *, gradient: bool) -> int:
    """A chunk's fp32 copy, the model-dtype results of its steps and, for its gradient, the
    model-dtype result and each tanh's fp32 derivative; none where the math is one compiled kernel
    (``chunked_cross_entropy.COMPILED_DEVICES``, and ``PRICED_AS_COMPILED``)."""
    if hidden.device.type in cce.COMPILED_DEVICES or hidden.device.type in PRICED_AS_COMPILED:
        return 0
    per_element = 4 + (hidden.dtype.bytes if steps else 0)
    if gradient:
        per_element += hidden.dtype.bytes + 4 * sum(op == "tanh" for op, _ in steps)
    return rows * columns * per_element


def _forward_workspace(bsym) -> int:
    hidden, weight, chunk, steps = bsym.args[0], bsym.args[1], bsym.args[6], bsym.args[7]
    rows, vocab = min(chunk, hidden.shape[0]), weight.shape[0]
    if bsym.sym.name in _WITH_LOGITS:
        # A chunk's logits are a view of the op's output, which the steps make from the matmul's,
        # in place unless one is a cast.
        cast = any(op == "to" for op, _ in steps)
        return hidden.shape[0] * vocab * hidden.dtype.bytes * cast + _eager_temporaries(hidden, rows, vocab, (),
                                                                                       gradient=False)
    return rows * vocab * hidden.dtype.bytes + _eager_temporaries(hidden, rows, vocab, steps, gradient=False)


def _with_gradients_workspace(bsym) -> int:
    hidden, weight, chunk, steps = bsym.args[0], bsym.args[1], bsym.args[6], bsym.args[7]
    (n, _), vocab = hidden.shape, weight.shape[0]
    return n * vocab * hidden.dtype.bytes + _eager_temporaries(hidden, min(chunk, n), vocab, steps, gradient=True)


def _logits_with_gradients_workspace(bsym) -> int:
    """The matmul's logits where a cast makes the model's logits a new tensor; then the larger of the
    loss's chunks and the gradients' walk over slices of the matmul: a slice's gradient and the
    accumulator. The backward's op adds nothing where the model's logits get no gradient."""
    hidden, weight, chunk, steps = bsym.args[0], bsym.args[1], bsym.args[6], bsym.args[7]
    (n, width), vocab = hidden.shape, weight.shape[0]
    rows, columns = gradient_slices(n, vocab, hidden.dtype.bytes)
    accumulator = n * width if n < vocab else vocab * width
    loss = _eager_temporaries(hidden, min(chunk, n), vocab, steps, gradient=False)
    walk = (rows * columns * hidden.dtype.bytes + _eager_temporaries(hidden, rows, columns, steps, gradient=True)
            + accumulator * (4 + _accumulation_temporary_bytes(hidden.device, hidden.dtype)))
    cast = any(op == "to" for op, _ in steps)
    return n * vocab * hidden.dtype.bytes * cast + max(loss, walk)


def _backward_workspace(bsym) -> int:
    hidden, weight, chunk, steps = bsym.args[1], bsym.args[2], bsym.args[8], bsym.args[9]
    (n, width), vocab = hidden.shape, weight.shape[0]
    if n < vocab:  # vocabulary chunks; the hidden states' gradient summed in fp32
        rows, columns, accumulator = n, vocabulary_width(n, vocab, chunk), n * width
    else:
        rows, columns, accumulator = min(chunk, n), vocab, vocab * width
    logits_and_gradient = 2 * rows * columns * hidden.dtype.bytes  # a chunk's
    return (logits_and_gradient + _eager_temporaries(hidden, rows, columns, steps, gradient=True)
            + accumulator * (4 + _accumulation_temporary_bytes(hidden.device, hidden.dtype)))


def _functions_called(bsym) -> list:
    """The compiled functions an op of the head will call (``_run``), for compile_ahead: one per
    function and chunk size, on the shapes its loops give them, for contiguous inputs. With steps,
    the backward's chunk function also takes the model's gradient of the logits, a slice of columns
    where it walks the vocabulary: that one is compiled at its first call, for the slice's strides."""
    name = bsym.sym.name
    backward = name == head_backward.name
    hidden, weight, targets = bsym.args[1:3] + bsym.args[4:5] if backward else bsym.args[:2] + bsym.args[3:4]
    chunk, steps = bsym.args[8:10] if backward else bsym.args[6:8]
    (n, _), vocab = hidden.shape, weight.shape[0]
    _, dtype, device = torch_metadata(hidden)
    index = dtypes.to_torch_dtype(targets.dtype)
    stepped = dtypes.to_torch_dtype(steps_dtype(steps, hidden.dtype))  # the dtype of the model's logits
    # The ops that return the model's logits make them over their matmul (_model_logits_).
    over_matmul = [_compiled(steps_applied_, [((n, vocab), dtype, device)], steps=steps)
                   if name in _MAKES_MODEL_LOGITS and steps and stepped == dtype else None]
    if name in _WITH_LOGITS:  # the chunks are views of the model's logits, after the steps
        steps, dtype = (), stepped

    def rows(r: int, columns: int = vocab) -> list[TensorMetadata]:  # logits, then per-row tensors
        return [((r, columns), dtype, device)] + [((r,), t, device) for t in kinds]

    sizes = sorted({stop - start for start, stop in spans(n, chunk)})
    if name == head_forward_with_gradients.name:
        kinds, f = (index, torch.bool, torch.float32), _loss_terms_and_logits_grad_
        calls = [(f, rows(r)) for r in sizes]
    elif not backward:
        kinds, f = (index,), _lse_and_target_logit
        calls = [(f, rows(r)) for r in sizes]
        if name == head_forward_logits_with_gradients.name and n >= vocab:  # its walk over rows of its matmul
            kinds, step = (torch.float32, index, torch.bool, torch.float32), gradient_slices(n, vocab, dtype.itemsize)[0]
            calls += [(_logits_grad, rows(r)) for r in sorted({stop - start for start, stop in spans(n, step)})]
    else:
        kinds = (torch.float32, index, torch.bool, torch.float32)
        added = bool(steps) and len(bsym.args) > 10 and bsym.args[10] is not None  # as _chunk_grad
        if n < vocab:  # as _backward walks the vocabulary
            widths = sorted({stop - start for start, stop in spans(vocab, vocabulary_width(n, vocab, chunk))})
            calls = [] if added else [(_logits_grad, rows(n, c)) for c in widths]
        else:
            calls = [(_logits_grad, rows(r) + ([((r, vocab), stepped, device)] if added else [])) for r in sizes]
    return [c for c in over_matmul if c is not None] + [
        c for f, tensors in calls if (c := _compiled(f, tensors, steps=steps)) is not None]


COMPILED_FUNCTIONS_OF.update({op.name: _functions_called for op in (
    head_loss, head_forward, head_forward_with_gradients, head_backward, head_loss_and_logits,
    head_forward_and_logits, head_forward_logits_with_gradients)})


_WITH_LOGITS = {head_loss_and_logits.name, head_forward_and_logits.name}
_MAKES_MODEL_LOGITS = _WITH_LOGITS | {head_forward_logits_with_gradients.name}
WORKSPACE_BYTES.update({
    head_loss.name: _forward_workspace,
    head_forward.name: _forward_workspace,
    head_loss_and_logits.name: _forward_workspace,
    head_forward_and_logits.name: _forward_workspace,
    head_forward_with_gradients.name: _with_gradients_workspace,
    head_forward_logits_with_gradients.name: _logits_with_gradients_workspace,
    head_backward.name: _backward_workspace,
})
