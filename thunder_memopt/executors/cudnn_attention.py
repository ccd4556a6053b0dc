"""The cuDNN attention executor: scaled dot-product attention through torch's own cuDNN kernels.

Thunder's sdpa executor picks flash-attention v2, where eager PyTorch picks cuDNN on Hopper: for
(1, 32, 8192, 80) causal bf16 forward and backward take 5.95 ms with flash and 3.43 ms with cuDNN on
an H200. Thunder's own cuDNN executor needs ``nvidia-cudnn-frontend`` and fails with its current
releases; torch 2.11 ships ``aten._scaled_dot_product_cudnn_attention`` and its backward, which
need neither.

The checker claims only what cuDNN serves: CUDA tensors of one dtype, fp16 or bf16, 4-d, with equal
batch, heads and head size (a multiple of 8, at most 128, or 256 where torch 2.11 allows it: cuDNN
9.10 or later on sm90), no dropout, and no mask or a mask that broadcasts to the scores without a
gradient: boolean, made additive as torch's SDPA makes it for cuDNN (``_additive_bias``), or of the
query's dtype. Thunder's sdpa executor runs a masked attention on the memory-efficient kernel:
45 ms a layer forward and backward for Gemma-2-2B's sliding-window layers at T=8192, where cuDNN
takes 9 (1xH100, benchmarks/results/hf_gemma_2_2b_4l_none_1xH100_T8192_profile.md). Everything
else falls through to the next executor in the list (Thunder's sdpa executor). So does everything under
``torch.use_deterministic_algorithms(True)``, with one warning: there torch 2.11's cuDNN backward
still does not repeat its bits (benchmarks/results/determinism_h200.md), where flash's does. The forward saves what
flash saves (q, k, v, the output, the log-sum-exp and the RNG seed and offset), and its symbols
are named as attention, so the recompute pass prices them as attention: replayed only below
budget 1.0.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import thunder.core.dtypes as dtypes
import thunder.torch as ltorch
from thunder.core.prims import OpTags
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.extend import OperatorExecutor, register_executor

from thunder_memopt.core.memory import OUTPUT_STRIDES, dense_strides_like

__all__ = ["cudnn_attention_ex", "cudnn_supports", "max_head_size", "matching_layouts", "OUTPUT_LIKE_QUERY"]

cudnn_attention_ex = OperatorExecutor("memopt_cudnn_attention", version=torch.__version__)
register_executor(cudnn_attention_ex)

MAX_HEAD_SIZE = 128
# torch 2.11's check_cudnn_tensor_shapes (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
# head sizes up to 256 with cuDNN 9.10 or later on sm90 exactly.
HOPPER_MAX_HEAD_SIZE = 256
_HOPPER_CUDNN = 91000
_DTYPES = (dtypes.bfloat16, dtypes.float16)
# What torch's SDPA puts where a boolean mask is False before it calls cuDNN
# (convert_boolean_attn_mask_cudnn, in aten/src/ATen/native/transformers/attention.cpp).
_MASKED_BIAS = -65504.0


def max_head_size(device_index: int | None) -> int:
    """The largest head size cuDNN attention takes on that CUDA device, as torch 2.11 decides it."""
    if not torch.cuda.is_available() or (torch.backends.cudnn.version() or 0) < _HOPPER_CUDNN:
        return MAX_HEAD_SIZE
    hopper = torch.cuda.get_device_capability(device_index or 0) == (9, 0)
    return HOPPER_MAX_HEAD_SIZE if hopper else MAX_HEAD_SIZE


def _mask_served(attn_mask, query: TensorProxy, key: TensorProxy) -> bool:
    """No mask, or a mask of the scores' shape (batch and heads may broadcast) that is boolean or of
    the query's dtype, on the query's device, and takes no gradient."""
    if attn_mask is None:
        return True
    if not isinstance(attn_mask, TensorProxy) or attn_mask.ndim != 4 or attn_mask.requires_grad:
        return False
    if not (dtypes.is_boolean_dtype(attn_mask.dtype) or attn_mask.dtype == query.dtype) or attn_mask.device != query.device:
        return False
    (b, h, s_q, _), s_k = query.shape, key.shape[2]
    mb, mh, ms_q, ms_k = attn_mask.shape
    return mb in (1, b) and mh in (1, h) and (ms_q, ms_k) == (s_q, s_k)


def cudnn_supports(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   *, scale: float | None = None) -> bool:
    """Whether cuDNN attention serves these inputs (the executor's checker)."""
    tensors = (query, key, value)
    if not all(isinstance(t, TensorProxy) for t in tensors):
        return False
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0.0 or not isinstance(is_causal, bool):
        return False
    if any(t.device.type != "cuda" for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return False
    if query.dtype not in _DTYPES or any(t.ndim != 4 for t in tensors):
        return False
    (b, h, _, d), (bk, hk, sk, dk), (bv, hv, sv, dv) = (tuple(t.shape) for t in tensors)
    if not (b == bk == bv and h == hk == hv and sk == sv and d == dk == dv):
        return False
    if d % 8 or d > max_head_size(query.device.index):
        return False
    if not _mask_served(attn_mask, query, key):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        # A different kernel, so said; with warn_only torch keeps cuDNN and warns itself.
        warnings.warn("thunder_memopt: attention runs on Thunder's sdpa executor (flash), not cuDNN, under "
                      "torch.use_deterministic_algorithms(True): cuDNN's backward does not repeat its bits")
        return False
    return True


class _BiasOfMask:
    """The additive bias of each boolean mask alive, made once while the mask is unchanged.

    Every layer's attention, forward and backward, reads the one mask the model made for the step,
    so one conversion serves them all; each op converting its own made 8 T x T passes a step for a
    4-layer model (benchmarks/results/hf_phi_3_mini_4l_none_1xH100_T8192_profile.md). A bias lives
    as long as its mask's storage (a weak reference to it drops the bias), which the backward reads
    through other tensor objects (the saved ones), and is made again if the mask is written. Making
    one waits for nothing: its two values are filled on the device, not copied from the host."""

    def __init__(self) -> None:
        self._biases: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __call__(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.device, dtype)
        held = self._biases.get(key)
        if held is not None and held[0]() is not None and held[1] == mask._version:
            return held[2]
        # 0-d operands of the query's dtype: one pass, no fp32 copy, and the bits of torch's
        # where(mask, 0.0, _MASKED_BIAS).to(dtype).
        zero, masked = (torch.full((), v, dtype=dtype, device=mask.device) for v in (0.0, _MASKED_BIAS))
        bias = torch.where(mask, zero, masked)
        storage = weakref.ref(mask.untyped_storage(), lambda _: self._biases.pop(key, None))
        self._biases[key] = (storage, mask._version, bias)
        return bias

    def __len__(self) -> int:
        return len(self._biases)


_bias_of_mask = _BiasOfMask()


def _additive_bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as cuDNN takes it: a boolean one as torch's SDPA makes it for cuDNN (0 where True,
    _MASKED_BIAS where False, in the query's dtype), once per mask (_BiasOfMask); an additive one
    as it is."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return _bias_of_mask(attn_mask, dtype)


def _forward_meta(query: TensorProxy, key: TensorProxy, value: TensorProxy, attn_mask, is_causal: bool,
                  scale: float | None):
    b, h, s, _ = query.shape
    return (
        TensorProxy(like=query, shape=(b, h, s, value.shape[-1])),
        TensorProxy(like=query, shape=(b, h, s, 1), dtype=dtypes.float32, requires_grad=False),
        TensorProxy(like=query, shape=(), dtype=dtypes.int64, requires_grad=False),
        TensorProxy(like=query, shape=(), dtype=dtypes.int64, requires_grad=False),
    )


def _forward_impl(query, key, value, attn_mask, is_causal, scale):
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, _additive_bias(attn_mask, query.dtype), True, 0.0, is_causal, False, scale=scale
    )
    return out, lse, seed, offset


cudnn_sdpa_fwd = cudnn_attention_ex.register_operator(
    "memopt_cudnn_sdpa_attention_forward", meta=_forward_meta, fn=_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)


def _backward_meta(grad, query, key, value, out, lse, seed, offset, attn_mask, is_causal, scale):
    return (TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value))


def _backward_impl(grad, query, key, value, out, lse, seed, offset, attn_mask, is_causal, scale):
    s_q, s_k = query.shape[-2], key.shape[-2]
    if grad.stride() != out.stride():  # cuDNN reads the output's gradient in the output's layout
        grad = torch.empty_like(out).copy_(grad)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, query, key, value, out, lse, seed, offset, _additive_bias(attn_mask, query.dtype), None, None,
        s_q, s_k, 0.0, is_causal, scale=scale
    )


cudnn_sdpa_bwd = cudnn_attention_ex.register_operator(
    "memopt_cudnn_sdpa_attention_backward", meta=_backward_meta, fn=_backward_impl,
)


def _tokens_major(t: TensorProxy) -> TensorProxy:
    """``t``, (B, H, T, D), with its elements stored in (B, T, H, D) order, as a projection makes
    them. cuDNN writes the output in the query's order (pytorch#138354), so the model's
    ``transpose(1, 2).reshape(B, T, H * D)`` of the output is then a view, not a copy, and the
    output's gradient arrives in the output's own order, which cuDNN's backward reads as it is
    (``_backward_impl``). The copy is made by the fusion region that makes the query (the rotary
    embedding's concatenation), in place of the contiguous (B, H, T, D) one it would write."""
    return ltorch.transpose(ltorch.contiguous(ltorch.transpose(t, 1, 2)), 1, 2)


def _execution(query: Proxy, key: Proxy, value: Proxy, attn_mask=None, dropout_p: float = 0.0,
               is_causal: bool = False, *, scale: float | None = None):
    out, _, _, _ = cudnn_sdpa_fwd(_tokens_major(query), key, value, attn_mask, is_causal, scale)
    return out


def _grad(query: Proxy, key: Proxy, value: Proxy, attn_mask=None, dropout_p: float = 0.0,
          is_causal: bool = False, *, scale: float | None = None):
    # The same values as the query, so its gradient is the query's.
    tokens_major = _tokens_major(query)
    out, lse, seed, offset = cudnn_sdpa_fwd(tokens_major, key, value, attn_mask, is_causal, scale)
    grads = cudnn_sdpa_bwd(get_grad(out), tokens_major, key, value, out, lse, seed, offset, attn_mask, is_causal,
                           scale)
    put_grads((query, key, value), grads)
    return out


def matching_layouts(bsym, strides) -> dict:
    """cuDNN allocates the output like the query, and each input's gradient like that input: dense,
    with the input's order of dimensions in memory (ATen's ``alloc_with_matching_layout``). So the
    gradient of a value that views the fused qkv projection is (B, T, H, D) in memory, and a region
    that reads it is compiled ahead for that. Flash allocates alike (``empty_like``)."""
    if bsym.sym.name in OUTPUT_LIKE_QUERY:
        like = ((bsym.flat_proxy_outs[0], bsym.args[0]),)
    else:  # a backward: the gradients of its 2nd to 4th arguments, q, k and v
        like = zip(bsym.output, bsym.args[1:4])
    return {out.name: dense_strides_like(out.shape, strides[inp.name])
            for out, inp in like if inp.name in strides}


# The attention ops whose (first) output is allocated like their query.
OUTPUT_LIKE_QUERY = {cudnn_sdpa_fwd.name}
OUTPUT_STRIDES.update({cudnn_sdpa_fwd.name: matching_layouts, cudnn_sdpa_bwd.name: matching_layouts})

cudnn_attention_ex.register_implementation(
    ltorch.scaled_dot_product_attention, checker=cudnn_supports, execution_transform=_execution, grad_transform=_grad,
)
