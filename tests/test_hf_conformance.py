"""A representative subset of the conformance matrix (benchmarks/diagnostics/hf_conformance.py, whose
``conform`` each test calls): one transformers causal LM per distinct attention, norm and head
variant, trained two AdamW steps under ``thunderfx_backend()`` against eager, on CPU, within the
matrix's fp32 tolerance.

- GPT-2: LayerNorm, Conv1D (``addmm``), learned positions, a tied head.
- Qwen3: RMSNorm, grouped-query attention, QK-norm.
- OLMo-2: QK-norm over the whole projection, norms after attention and MLP.
- Gemma-2: a sliding-window layer and a full layer, sandwich norms, attention and final logit soft-caps;
  trained with the fusion executor on the CPU, as on a GPU: Thunder copies its cheap position-id ops
  into two regions there, which the recompute pass once took apart into two producers of one name
  (an UnboundLocalError at the first step).

One layer (Gemma-2: one of each kind) and 16 tokens, so each model compiles in seconds; each is
trained once (``functools.cache``) and shared by the tests that read it. Then the backend's route
around what the matrix found Thunder cannot trace: a custom ``torch.autograd.Function`` (BLOOM).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.diagnostics

from benchmarks.diagnostics import hf_conformance  # noqa: E402
from benchmarks.diagnostics.hf_conformance import GRAD_RTOL, LOSS_RTOL, Result  # noqa: E402
from thunder_memopt import thunderfx_backend  # noqa: E402
from thunder_memopt.executors import InductorFusionExecutor, executors  # noqa: E402

# The fusion executor, which runs on CUDA only, on the CPU: the executors a GPU trains with.
CPU_FUSION = InductorFusionExecutor("memopt_fusion_conformance_cpu", devices=("cpu",))


def _with_cpu_fusion():
    return thunderfx_backend(executors=[CPU_FUSION, *executors()])

SEQ_LEN = 16
# Config overrides: Gemma-2's window shorter than the sequence, so that its sliding layer masks.
VARIANTS = {"gpt2": {}, "qwen3": {}, "olmo2": {}, "gemma2": {"sliding_window": SEQ_LEN // 2}}
BACKENDS = {"gemma2": _with_cpu_fusion}


@functools.cache
def conformed(name: str) -> Result:
    return hf_conformance.conform(name, seq_len=SEQ_LEN, layers=1, backend_factory=BACKENDS.get(name),
                                  **VARIANTS[name])


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_eager(name):
    result = conformed(name)
    assert result.status == "match", result
    assert result.loss_error <= LOSS_RTOL and all(e <= tol for e, tol in zip(result.grad_errors, GRAD_RTOL))
    assert not result.fallbacks, result.fallbacks  # no pass of thunder_memopt fell back


@pytest.mark.parametrize("name", ("gpt2", "qwen3", "olmo2"))
def test_the_head_is_fused_and_the_attention_causal(name):
    # GPT-2's loss_function warns once that its loss_type is unset: dynamo broke the graph there, and the
    # loss ran in a graph of its own, unfused (backend.loss_type_warning_skipped_when_compiling).
    result = conformed(name)
    assert result.head == "fused (logits kept)", result
    assert result.attention.startswith("is_causal 1/1"), result
    assert (result.graphs, result.regions, result.split_reasons) == (1, 1, ()), result


class _SiLU(torch.autograd.Function):
    """A custom autograd.Function, as BLOOM's GELU in training."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


def test_a_custom_autograd_function_runs_outside_thunder():
    # torch 2.11 traces it to autograd_function_apply without args_tensor_mask, which Thunder 0.2.6's
    # lookaside reads: plain ThunderCompiler fails with a KeyError; the backend hands it to inductor.
    def loss(x, w):
        return _SiLU.apply(x @ w).pow(2).sum()

    torch._dynamo.reset()
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    loss(x, w).backward()
    expected, w.grad = w.grad, None
    backend = thunderfx_backend()
    torch.compile(loss, backend=backend)(x, w).backward()
    torch.testing.assert_close(w.grad, expected)
    (reason,) = [r.info for info in backend.compiler.subgraph_infos for r in info.split_reasons]
    assert "thunder_memopt_outside_thunder_autograd_function_apply" in reason
