"""Gradients the caller never used, not made.

Thunder connects a compiled function's outputs to autograd through one ``torch.autograd.Function``,
which autograd hands zeros of an output's size where nothing used that output. A transformers model
returns its logits beside its loss, and ``model(...).loss`` leaves them unused: their gradient is
then tokens x vocabulary zeros (2.3 GiB at Qwen3-8B's vocabulary, T=8192), written at the start of
the backward and read whole by the fused head to learn that it is zero.

Where the backward reads such an output's gradient in the fused head alone (``core.trace.
unmade_cotangents``), the forward marks the output (``unused_gradient_unmade``, which the loss-head
pass puts before its return). Thunder's connection then takes the gradients unmade, and hands a
marked output's missing one as a single zero broadcast to its shape, tagged so that the head takes
it for no gradient (no memory, nothing read); every other output gets its zeros as before
(``connect_to_autograd``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import thunder
import thunder.executors.torch_autograd as torch_autograd
import torch
from thunder.core.prims import OpTags

from thunder_memopt.executors.chunked_cross_entropy import UNMADE, linear_cross_entropy_ex

__all__ = ["unused_gradient_unmade", "connect_to_autograd", "missing_gradients", "made_gradients"]

_marked = threading.local()  # the outputs marked by the forward that runs now, until it connects them


def _mark_meta(t):
    return None


def _mark_impl(t: torch.Tensor) -> None:
    _marked.outputs = [*getattr(_marked, "outputs", ()), t]


unused_gradient_unmade = linear_cross_entropy_ex.register_operator(
    "memopt_unused_gradient_unmade", meta=_mark_meta, fn=_mark_impl, tags=(OpTags.DONT_DCE,))

# Per output of the connecting Function: None (not a tensor), or its shape, dtype, device and mark.
_Missing = tuple[torch.Size, torch.dtype, torch.device, bool] | None


def missing_gradients(outputs: Sequence, marked: Sequence[torch.Tensor]) -> list[_Missing]:
    """What made_gradients needs to make each output's gradient, should none come: for a Function's
    ``forward`` that turned materialized gradients off, ``marked`` its outputs to get a broadcast zero."""
    return [(t.shape, t.dtype, t.device, any(t is m for m in marked)) if isinstance(t, torch.Tensor) else None
            for t in outputs]


def made_gradients(grads: Sequence, missing: Sequence[_Missing]) -> list:
    """The gradients as autograd materializes them (zeros for an unused output), but a single
    broadcast zero for a marked output."""
    made = list(grads)
    for i, (g, m) in enumerate(zip(grads, missing)):
        if g is None and m is not None:
            shape, dtype, device, marked = m
            if marked:
                zero = torch.zeros((), dtype=dtype, device=device)
                setattr(zero, UNMADE, True)  # the head reads no gradient from it (no wait for the device)
                made[i] = zero.expand(shape)
            else:
                made[i] = torch.zeros(shape, dtype=dtype, device=device)
    return made


# Thunder's own, which _functions_replaced swaps for the subclasses below during a connection.
_THUNDER_FUNCTION, _THUNDER_OUTPUT_FUNCTION = torch_autograd.ThunderFunction, torch_autograd.ThunderOutputFunction


class _ThunderFunction(_THUNDER_FUNCTION):
    """Thunder's Function without its gradients materialized (split autograd off, as under thunderfx)."""

    @staticmethod
    def forward(ctx, return_none_instead_of_grads, compiled_backward, side_channel, saved_tensors, saved_other,
                is_differentiable_outputs, flat_output, *flat_args):
        ctx.set_materialize_grads(False)
        out = _THUNDER_FUNCTION.forward(ctx, return_none_instead_of_grads, compiled_backward, side_channel,
                                        saved_tensors, saved_other, is_differentiable_outputs, flat_output,
                                        *flat_args)
        # Split autograd: one placeholder output, whose gradient ThunderOutputFunction returns.
        ctx.missing = missing_gradients(out if isinstance(out, tuple) else (out,), getattr(_marked, "outputs", ()))
        return out

    @staticmethod
    def backward(ctx, *grads):
        return _THUNDER_FUNCTION.backward(ctx, *made_gradients(grads, ctx.missing))


class _ThunderOutputFunction(_THUNDER_OUTPUT_FUNCTION):
    """The Function that connects the outputs where autograd is split (thunder.jit), likewise."""

    @staticmethod
    def forward(ctx, dummy, side_channel, *args):
        ctx.set_materialize_grads(False)
        ctx.missing = missing_gradients(side_channel["fw"], getattr(_marked, "outputs", ()))
        return _THUNDER_OUTPUT_FUNCTION.forward(ctx, dummy, side_channel, *args)

    @staticmethod
    def backward(ctx, *grads):
        return _THUNDER_OUTPUT_FUNCTION.backward(ctx, *made_gradients(grads, ctx.missing))


@contextlib.contextmanager
def _functions_replaced() -> Iterator[None]:
    torch_autograd.ThunderFunction, torch_autograd.ThunderOutputFunction = _ThunderFunction, _ThunderOutputFunction
    try:
        yield
    finally:
        torch_autograd.ThunderFunction = _THUNDER_FUNCTION
        torch_autograd.ThunderOutputFunction = _THUNDER_OUTPUT_FUNCTION


_thunder_connect_to_autograd = torch_autograd.connect_to_autograd


def connect_to_autograd(**kwargs) -> None:
    """Thunder's ``connect_to_autograd``; where the forward marked an output, with its Functions
    replaced by those above for this call."""
    marked = getattr(_marked, "outputs", ())
    if not marked:
        return _thunder_connect_to_autograd(**kwargs)
    try:
        with _functions_replaced():
            return _thunder_connect_to_autograd(**kwargs)
    finally:
        _marked.outputs = ()


thunder.connect_to_autograd = connect_to_autograd  # the name thunder.jit's compiled functions call
