"""Fused replays (thunder_memopt.fuse): the replayed elementwise stretches of the backward compiled
into one function each, with eager rounding, shared between layers."""

import pytest
import torch
from thunder.dev_utils.check_trace import check_trace

from _train import assert_same_numerics, train_step
from thunder_memopt import MemoryOptimization
from thunder_memopt.fuse import fusible
from thunder_memopt.memory import estimate_memory

STABLECODE = "stablecode-completion-alpha-3b"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's eager-rounding mode is Triton's")


def _fusion_bsyms(trace):
    return [b for b in trace.bound_symbols if b.sym.name.startswith("MemoptReplay")]


def test_default_fuses_nothing_on_cpu():
    mo = MemoryOptimization()
    step = train_step(STABLECODE, [mo], n_layer=1, seq_len=64)
    assert mo.fuse_results == []
    assert _fusion_bsyms(step.backward_trace) == []
    assert "fuse" not in mo.pass_seconds and mo.pass_seconds["recompute"] > 0


def test_fused_replays_on_cpu():
    """Forced on CPU: the stretches are fused and shared across layers, the saved set is unchanged,
    and the gradients agree to bf16 rounding (inductor's C++ code does not emulate eager rounding)."""
    mo = MemoryOptimization(fuse_replays=True)
    fused = train_step(STABLECODE, [mo], n_layer=2)
    unfused = train_step(STABLECODE, [MemoryOptimization(fuse_replays=False)], n_layer=2)

    (result,) = mo.fuse_results
    fusions = _fusion_bsyms(fused.backward_trace)
    assert result.fusions == len(fusions) > 0
    # Each layer replays the same stretches: they share compiled functions.
    assert result.compiled < result.fusions
    assert all(fusible(sub) for f in fusions for sub in f.subsymbols)
    # Reductions stay outside: the norms' var_mean runs as in the forward.
    assert not any(sub.sym.name == "var_mean" for f in fusions for sub in f.subsymbols)
    check_trace(fused.backward_trace)

    assert fused.saved_bytes == unfused.saved_bytes
    # Fused stretches write only what the backward reads after them.
    assert estimate_memory(fused.backward_trace).peak_bytes <= estimate_memory(unfused.backward_trace).peak_bytes
    torch.testing.assert_close(fused.loss, unfused.loss)
    for name, grad in unfused.grads.items():
        torch.testing.assert_close(fused.grads[name], grad, rtol=2e-2, atol=1e-4, msg=name)


@pytest.fixture
def deterministic():
    # Embedding and attention backward use atomics on CUDA: without this, plain Thunder is not
    # bit-identical to itself.
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@cuda_only
@pytest.mark.parametrize("model_name", [STABLECODE, "Llama-3-8B", "pythia-160m"])
def test_replays_on_cuda(model_name, deterministic):
    """Unfused replays are bit-identical to plain Thunder on CUDA too; fused ones (the CUDA default)
    agree to the last bits of bf16 (benchmarks/results/fuse_numerics_h200.md)."""
    plain = train_step(model_name, [], device="cuda")
    assert_same_numerics(plain, train_step(model_name, [], device="cuda"))
    assert_same_numerics(plain, train_step(model_name, [MemoryOptimization(fuse_replays=False)], device="cuda"))

    mo = MemoryOptimization()  # fuse_replays=None: on, on CUDA
    fused = train_step(model_name, [mo], device="cuda")
    assert mo.fuse_results and mo.fuse_results[0].fusions > 0
    torch.testing.assert_close(fused.loss, plain.loss)
    for name, grad in plain.grads.items():
        torch.testing.assert_close(fused.grads[name], grad, rtol=2e-2, atol=1e-4, msg=name)


def test_a_failing_fuse_leaves_the_replays_unfused_with_one_warning(monkeypatch):
    import thunder_memopt.fuse as fuse_module

    def broken(trace, replayed):
        raise RuntimeError("boom")

    monkeypatch.setattr(fuse_module, "fuse_replays", broken)
    unfused = train_step(STABLECODE, [MemoryOptimization(fuse_replays=False)], n_layer=1, seq_len=64)
    with pytest.warns(UserWarning, match="thunder_memopt: fuse left the replays unfused") as caught:
        step = train_step(STABLECODE, [MemoryOptimization(fuse_replays=True)], n_layer=1, seq_len=64)
    assert sum("thunder_memopt" in str(w.message) for w in caught) == 1
    assert _fusion_bsyms(step.backward_trace) == []
    assert_same_numerics(unfused, step)
