"""Under torch.use_deterministic_algorithms(True) cuDNN attention declines, with one warning, and
Thunder's sdpa executor (flash, deterministic there) takes attention; with warn_only it serves."""

from __future__ import annotations

import warnings

import pytest
import thunder.core.devices as devices
import thunder.core.dtypes as dtypes
import torch
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx

from thunder_memopt.executors import cudnn_supports


@pytest.fixture
def restore_determinism():
    state = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])


def _cuda_qkv():
    with tracectx(TraceCtx()):
        return tuple(TensorProxy(shape=(1, 4, 128, 64), device=devices.Device("cuda:0"), dtype=dtypes.bfloat16)
                     for _ in range(3))


def test_cudnn_attention_declines_under_deterministic_algorithms_with_one_warning(restore_determinism):
    qkv = _cuda_qkv()
    assert cudnn_supports(*qkv, is_causal=True)
    torch.use_deterministic_algorithms(True)
    with pytest.warns(UserWarning, match="not cuDNN, under torch.use_deterministic_algorithms") as caught:
        assert not cudnn_supports(*qkv, is_causal=True)
    assert sum("thunder_memopt" in str(w.message) for w in caught) == 1


def test_cudnn_attention_serves_under_warn_only_and_cpu_never_warns(restore_determinism):
    torch.use_deterministic_algorithms(True, warn_only=True)
    assert cudnn_supports(*_cuda_qkv(), is_causal=True)
    torch.use_deterministic_algorithms(True)
    with tracectx(TraceCtx()):
        cpu = tuple(TensorProxy(shape=(1, 4, 128, 64), device=devices.Device("cpu"), dtype=dtypes.bfloat16)
                    for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cudnn_supports(*cpu)
