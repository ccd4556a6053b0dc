"""Sliding-window causal attention on flash's local-attention kernels, in the attention executor.

transformers hands a sliding-window causal mask (Mistral, Phi-3, Gemma-2's sliding layers) to SDPA
as a T x T tensor, and every kernel that takes a mask computes all T x T scores: cuDNN reads it as
a bias. Where the causal_mask pass proves a mask such a window (``causal_mask.sliding_window``), it
calls ``window_attention`` instead, which torch 2.11's flash kernels run with
``window_size_left=w - 1, window_size_right=0`` (the path of ``torch.nn.attention.varlen``): each
query reads its own key and the ``w - 1`` before it, and blocks outside the band are skipped. The
ops are registered on ``cudnn_attention_ex`` (one executor for attention, one switch for users).

``window_supports`` says what flash serves: an sm80 or later GPU with torch's flash kernels on,
fp16 or bf16, 4-d, equal batch and heads (no grouped keys), one sequence length, head size a
multiple of 8 and at most 256, no dropout, and not under ``torch.use_deterministic_algorithms(True)``
(flash's backward adds in any order).
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads

from thunder_memopt.core.memory import OUTPUT_STRIDES
from thunder_memopt.executors.cudnn_attention import OUTPUT_LIKE_QUERY, cudnn_attention_ex, matching_layouts

__all__ = ["window_attention", "window_supports", "SERVED_DEVICES"]

_DTYPES = (dtypes.bfloat16, dtypes.float16)
_MAX_HEAD_SIZE = 256
# Where the kernels run; ``python -m thunder_memopt plan`` adds meta while it prices a GPU's programs.
SERVED_DEVICES = {"cuda"}


def window_supports(query, key, value) -> bool:
    """Whether flash's local attention serves these inputs (see the module's docstring)."""
    tensors = (query, key, value)
    if not all(isinstance(t, TensorProxy) for t in tensors) or any(t.ndim != 4 for t in tensors):
        return False
    if any(t.device.type not in SERVED_DEVICES for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return False
    if query.dtype not in _DTYPES or len({tuple(t.shape) for t in tensors}) != 1:
        return False
    d = query.shape[-1]
    if d % 8 or d > _MAX_HEAD_SIZE or torch.are_deterministic_algorithms_enabled():
        return False
    return query.device.type != "cuda" or _flash_runs_on(query.device.index)


def _flash_runs_on(device_index: int | None) -> bool:
    """Whether torch's flash kernels run there: built in, not switched off (``sdpa_kernel``,
    ``enable_flash_sdp(False)``), and an sm80 or later GPU."""
    return (torch.backends.cuda.is_flash_attention_available() and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(device_index or 0) >= (8, 0))


def _tokens_major(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) as flash reads it: (B, T, H, D), its last axis dense (a view where it is)."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _flash_forward(query, key, value, window: int, scale: float | None):
    """Flash's forward on (B, T, H, D) tensors: the output, (B, T, H, D), and the log-sum-exp, (B, H, T)."""
    s = query.shape[1]
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, None, None, s, s, 0.0, True, False,
        scale=scale, window_size_left=window - 1, window_size_right=0)
    return out, lse


def _flash_backward(grad, query, key, value, out, lse, window: int, scale: float | None):
    """Flash's backward on (B, T, H, D) tensors: the gradients of the query, key and value."""
    s = query.shape[1]
    # With no dropout the kernel reads no random state; these stand in for the forward's.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=query.device)
    unused = torch.empty(0, device=query.device)
    return torch.ops.aten._flash_attention_backward(
        grad, query, key, value, out, lse, None, None, s, s, 0.0, True, rng_state, unused,
        scale=scale, window_size_left=window - 1, window_size_right=0)


def _window_attention_meta(query, key, value, window: int, scale: float | None):
    return TensorProxy(like=query)


def _forward_meta(query, key, value, window: int, scale: float | None):
    b, h, s, _ = query.shape
    return (TensorProxy(like=query),
            TensorProxy(like=query, shape=(b, h, s), dtype=dtypes.float32, requires_grad=False))


def _forward_impl(query, key, value, window, scale):
    out, lse = _flash_forward(_tokens_major(query), _tokens_major(key), _tokens_major(value), window, scale)
    return out.transpose(1, 2), lse


def _backward_meta(grad, query, key, value, out, lse, window: int, scale: float | None):
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value)


def _backward_impl(grad, query, key, value, out, lse, window, scale):
    grads = _flash_backward(*map(_tokens_major, (grad, query, key, value, out)), lse, window, scale)
    return tuple(g.transpose(1, 2) for g in grads)


def _window_attention_impl(query, key, value, window, scale):
    return _forward_impl(query, key, value, window, scale)[0]


window_attention = cudnn_attention_ex.register_operator(
    "memopt_window_attention", meta=_window_attention_meta, fn=_window_attention_impl)
window_attention_fwd = cudnn_attention_ex.register_operator(
    "memopt_window_attention_forward", meta=_forward_meta, fn=_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,))
window_attention_bwd = cudnn_attention_ex.register_operator(
    "memopt_window_attention_backward", meta=_backward_meta, fn=_backward_impl)


def _grad(query, key, value, window, scale):
    out, lse = window_attention_fwd(query, key, value, window, scale)
    put_grads((query, key, value), window_attention_bwd(get_grad(out), query, key, value, out, lse, window, scale))
    return out


cudnn_attention_ex.register_implementation(window_attention, window_attention, grad_transform=_grad)


OUTPUT_LIKE_QUERY.update({window_attention.name, window_attention_fwd.name})
OUTPUT_STRIDES.update({op.name: matching_layouts
                       for op in (window_attention, window_attention_fwd, window_attention_bwd)})
