"""The memory model against measurement: saved bytes, views, and the liveness estimate."""

import pytest
import torch
from _train import shared_train_step

from thunder_memopt.core.memory import (
    _reshape_strides,
    contiguous_strides,
    estimate_memory,
    estimate_step,
    saved_for_backward,
)
from thunder_memopt.measure import cross_entropy_compiled_as_on_gpu


@pytest.mark.parametrize("model_name", ["stablecode-completion-alpha-3b", "Llama-3-8B"])
def test_predicted_saved_bytes_match_saved_tensors_hooks(model_name):
    step = shared_train_step(model_name)
    predicted = saved_for_backward(step.forward_trace).activation_bytes
    assert abs(predicted - step.saved_bytes) <= 0.01 * step.saved_bytes, (predicted, step.saved_bytes)


def test_inventory_names_producer_and_source_line():
    step = shared_train_step("stablecode-completion-alpha-3b")
    inv = saved_for_backward(step.forward_trace)
    rows = inv.by_source()
    assert rows == sorted(rows, key=lambda r: -r[2])
    assert sum(r[2] for r in rows) == inv.activation_bytes
    assert any("litgpt/model.py" in src or "normalization.py" in src for _, src, _, _ in rows)
    assert all(t.is_parameter for t in inv.tensors if t.name.startswith("t_transformer"))


@pytest.mark.parametrize(
    "shape, permute, new_shape",
    [
        ((2, 6, 4), None, (2, 24)),
        ((2, 6, 4), (0, 2, 1), (2, 24)),
        ((2, 6, 4), (0, 2, 1), (2, 2, 2, 6)),
        ((1, 8, 12), None, (1, 8, 3, 4)),
        ((4, 1, 6), (2, 1, 0), (6, 4)),
    ],
)
def test_reshape_is_a_view_exactly_when_torch_makes_one(shape, permute, new_shape):
    t = torch.zeros(shape)
    if permute:
        t = t.permute(permute)
    strides = _reshape_strides(tuple(t.shape), tuple(t.stride()), new_shape)
    torch_view = t.reshape(new_shape)
    is_view = torch_view.data_ptr() == t.data_ptr() and torch_view._base is not None
    assert (strides is not None) == is_view
    if is_view:
        assert strides == torch_view.stride()


def test_contiguous_strides():
    assert contiguous_strides((2, 3, 4)) == torch.zeros(2, 3, 4).stride()


def test_liveness_peak_is_where_outputs_meet_live_inputs():
    step = shared_train_step("Llama-3-8B")
    fw = estimate_memory(step.forward_trace)
    bw = estimate_memory(step.backward_trace)
    assert fw.peak_bytes >= fw.input_bytes + saved_for_backward(step.forward_trace).activation_bytes
    assert bw.peak_index >= 0 and bw.peak_op is not None
    assert len(bw.live_bytes) > 0 and max(bw.live_bytes) == bw.peak_bytes
    step_estimate = estimate_step(step.forward_trace, step.backward_trace)
    assert step_estimate.peak_bytes > 0
    assert step_estimate.peak_phase in {"forward", "backward"}


@pytest.fixture
def cross_entropy_compiled_on_cpu():
    with cross_entropy_compiled_as_on_gpu():
        yield


@pytest.mark.parametrize(
    "cross_entropy, n_embd",
    [("eager", 256), ("torch.compile region", 256), ("eager", 64)],  # 64: the report's tiny widths too
)
@pytest.mark.parametrize("optimized", [False, True], ids=["plain", "MemoryOptimization"])
def test_estimated_step_peak_is_the_measured_peak_of_live_tensors(cross_entropy, n_embd, optimized, request):
    """estimate_step against the profiler's live tensor bytes of a real forward+backward: a saved
    tensor and its view are one storage, a saved slice keeps its base, a saved expand keeps only
    what it expands, and aliasing outputs of a torch.compile region are one storage."""
    import thunder

    from thunder_memopt import MemoryOptimization
    from thunder_memopt.measure import peak_live_bytes
    from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch

    if cross_entropy == "torch.compile region":
        request.getfixturevalue("cross_entropy_compiled_on_cpu")
    config = narrow_config("stablecode-completion-alpha-3b", n_layer=2, n_embd=n_embd, block_size=256, vocab_size=8192)
    model = build_model(config)
    x, y = random_batch(config, batch_size=1, seq_len=256)
    jitted = thunder.jit(GPTWithLoss(model, upcast_logits=True), transforms=[MemoryOptimization()] if optimized else [])
    loss = jitted(x, y)  # compiles the forward and its backward
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    compiled_regions = [b for b in backward.bound_symbols if b.sym.name.startswith("TorchCompile")]
    assert bool(compiled_regions) == (cross_entropy == "torch.compile region")
    if compiled_regions:  # a torch.compile region compiles at its first call: the backward's before the measured step
        loss.backward()  # (without regions a warm-up backward measured the same peaks, to the byte)
    del loss
    model.zero_grad(set_to_none=True)
    measured = peak_live_bytes(lambda: jitted(x, y).backward())
    estimated = estimate_step(forward, backward).peak_bytes
    assert estimated == pytest.approx(measured, rel=0.01), (estimated, measured)
