"""The cuDNN attention executor's additive bias of a boolean mask (executors/cudnn_attention.py).

cuDNN takes a mask as an additive bias; torch's SDPA makes it as ``where(mask, 0.0, -65504.0)`` in
the query's dtype. The executor makes it once per mask, shared by every layer's forward and
backward (which reads it through other tensor objects), and again only when the mask is written in
place; it drops it with the mask's storage. The
conversion runs on CPU tensors here (the kernels it feeds run on CUDA only).
"""

from __future__ import annotations

import gc

import pytest
import torch

from thunder_memopt.executors import cudnn_attention


def _torchs_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(mask, 0.0, -65504.0).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_bias_per_mask_with_torchs_bits_made_again_when_written_and_dropped_with_it(dtype):
    cache = cudnn_attention._bias_of_mask
    before = len(cache)
    mask = torch.rand(1, 1, 64, 64, generator=torch.Generator().manual_seed(0)) > 0.3
    bias = cudnn_attention._additive_bias(mask, dtype)
    assert bias.dtype == dtype and torch.equal(bias, _torchs_bias(mask, dtype))
    assert cudnn_attention._additive_bias(mask, dtype) is bias  # every later layer, forward and backward
    assert len(cache) == before + 1
    # The backward reads the mask through other tensor objects (those saved for it), after the
    # forward's is gone: the bias lives with the storage.
    saved = mask.detach()
    forwards = mask
    del mask
    gc.collect()
    assert cudnn_attention._additive_bias(saved, dtype) is bias
    mask = saved
    del forwards, saved
    gc.collect()
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]  # written in place: its version moves
    written = cudnn_attention._additive_bias(mask, dtype)
    assert written is not bias and torch.equal(written, _torchs_bias(mask, dtype))
    other = mask.clone()
    assert cudnn_attention._additive_bias(other, dtype) is not written
    del mask, other
    gc.collect()
    assert len(cache) == before
    additive = torch.zeros(1, 1, 4, 4, dtype=dtype)
    assert cudnn_attention._additive_bias(additive, dtype) is additive
