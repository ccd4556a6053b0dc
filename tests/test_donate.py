"""The donate pass (passes/donate.py) on CPU, with inductor's C++ code for the regions: regions of
elementwise ops write outputs into inputs that die there. The step is bit for bit the one without
it, the memory model counts each donated output as its input's storage, only inputs that nothing
reads afterwards and the trace does not return are taken, and where SwiGLU's gradient region
donates, the measured peak falls."""

import functools

import pytest
import thunder
import torch
from _train import Step, assert_same_numerics, train_step
from litgpt.model import LLaMAMLP
from thunder.dev_utils.check_trace import check_trace

from thunder_memopt import PASSES, MemoryOptimization
from thunder_memopt.core.memory import estimate_step, storage_roots
from thunder_memopt.core.trace import is_bookkeeping, tensor_args
from thunder_memopt.executors.fusion import InductorFusionExecutor
from thunder_memopt.measure import peak_live_bytes
from thunder_memopt.models import narrow_config
from thunder_memopt.passes import donate

CPU_FUSION = InductorFusionExecutor("memopt_fusion_donate_cpu", devices=("cpu",))
SHAPE = {"n_layer": 2, "seq_len": 128}


def _step(model_name: str, passes, **options):
    memopt = MemoryOptimization(passes=passes, **options)
    return memopt, train_step(model_name, [memopt], executors=[CPU_FUSION, *thunder.get_default_executors()], **SHAPE)


@functools.cache
def _every_pass_step(model_name: str) -> tuple[MemoryOptimization, Step]:
    """``_step`` with every pass and no options, shared by the tests that only read it."""
    return _step(model_name, PASSES)


def _donations(trace):
    """(index of the region, the region, its copy into a donated input) of each donated output."""
    return [(i, b, sub) for i, b in enumerate(trace.bound_symbols) if CPU_FUSION.is_own_fusion(b)
            for sub in b.subsymbols if sub.sym.name == "copy_"]


@pytest.mark.parametrize("model_name", ["stablecode-completion-alpha-3b", "Llama-3-8B"])
def test_donated_steps_are_bit_identical_and_write_only_into_inputs_that_die_there(model_name):
    _, without = _step(model_name, [p for p in PASSES if p != "donate"])
    memopt, step = _every_pass_step(model_name)
    assert_same_numerics(without, step)
    donations = _donations(step.forward_trace) + _donations(step.backward_trace)
    assert donations and memopt.donated_outputs >= len(donations)
    for trace in (step.forward_trace, step.backward_trace):
        check_trace(trace)
        infos = storage_roots(trace)
        returned = {a.name for a in tensor_args(trace.bound_symbols[-1])}
        for i, region, copy in _donations(trace):
            _, target = copy.flat_proxy_args
            storage = infos[target.name].storage
            # The input's storage before the region (after it, the output and its views live there).
            sharing = {name for name, info in infos.items() if info.storage == storage
                       and (info.producer_index is None or info.producer_index < i)}
            assert target.name in {a.name for a in tensor_args(region)} and not sharing & returned
            # Neither the input nor another tensor of its storage is read after the region.
            assert not any(sharing & {a.name for a in tensor_args(b)}
                           for b in trace.bound_symbols[i + 1:] if not is_bookkeeping(b))
            # The memory model: the output lives in the input's storage, no bytes of its own.
            assert infos[copy.output.name].storage == storage
    # Region outputs that take no memory of their own never raise the estimated peak.
    assert (estimate_step(step.forward_trace, step.backward_trace).peak_bytes
            <= estimate_step(without.forward_trace, without.backward_trace).peak_bytes)


def _mlp_step(passes):
    """Forward and backward of litgpt's LLaMAMLP (SwiGLU; C=64, intermediate 2048, T=512) under
    MemoryOptimization: (measured peak of the step's live tensor bytes, gradients, the pair's
    estimated peak, the MemoryOptimization, the backward trace)."""
    torch.manual_seed(0)
    config = narrow_config("Llama-3-8B", n_layer=1, n_embd=64, block_size=512)
    config.intermediate_size = 2048
    mlp = LLaMAMLP(config).to(torch.bfloat16)
    x = torch.randn(1, 512, config.n_embd, dtype=torch.bfloat16, requires_grad=True)
    memopt = MemoryOptimization(passes=passes)
    jitted = thunder.jit(mlp, transforms=[memopt], executors=[CPU_FUSION, *thunder.get_default_executors()])

    def step():
        jitted(x).float().pow(2).mean().backward()

    step()  # compiles
    x.grad = None
    for p in mlp.parameters():
        p.grad = None
    peak = peak_live_bytes(step)
    grads = [x.grad, *(p.grad for p in mlp.parameters())]
    forward, backward = thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]
    return peak, grads, estimate_step(forward, backward).peak_bytes, memopt, backward


def test_swiglus_gradient_region_writes_into_the_gradient_it_reads_and_the_measured_peak_falls():
    """The gradient entering SwiGLU's backward region is the proj matmul's output reshaped (a view of
    all of its storage), which dies there: an output written into it lowers the step's measured peak
    (the profiler's live tensor bytes, on CPU) and the estimate, at the same numerics bit for bit."""
    peak_without, grads_without, estimate_without, _, _ = _mlp_step([p for p in PASSES if p != "donate"])
    peak, grads, estimate, memopt, backward = _mlp_step(PASSES)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_without))
    infos = storage_roots(backward)
    targets = [copy.flat_proxy_args[1].name for _, _, copy in _donations(backward)]
    assert any(infos[name].storage != name for name in targets)  # a view donated
    assert memopt.donated_outputs >= len(targets) >= 2
    assert peak < peak_without and estimate < estimate_without


def test_a_backward_donates_only_saved_tensors_that_its_forward_made_for_it_alone():
    """Llama's SwiGLU gradient region takes saved MLP tensors. What the forward received or returns
    to its caller is held elsewhere: never donated."""
    _, step = _every_pass_step("Llama-3-8B")
    taken = {copy.flat_proxy_args[1].name for _, _, copy in _donations(step.backward_trace)}
    donatable = donate.donatable_saved(step.forward_trace)
    assert taken & donatable
    saved = {t.name for t in step.backward_trace.args[0][0]}
    received = {t.name for t in thunder.core.pytree.tree_flatten(step.forward_trace.args)[0]
                if hasattr(t, "name")}
    assert donatable and donatable <= saved and not donatable & received


def test_what_a_copy_to_the_host_reads_is_never_donated(monkeypatch):
    """A copy to the host runs on a side stream and may still read its tensor when a later region
    runs: with offload, no donated input is one that is copied, and the step is still bit-identical."""
    import thunder_memopt.passes.offload as offload_pass
    from thunder_memopt.core.cost import DeviceRates

    monkeypatch.setattr(offload_pass, "MIN_BYTES", 1)
    rates = DeviceRates(to_host=1e18, to_device=1e18, flops=600e12, memory=4e12)  # every copy hides
    options = {"offload": "auto", "offload_rates": rates}
    _, without = _step("Llama-3-8B", [p for p in PASSES if p != "donate"], **options)
    memopt, step = _step("Llama-3-8B", PASSES, **options)
    assert_same_numerics(without, step)
    assert any(plan.offloaded for plan in memopt.offload_plans)
    copied = {a.name for b in step.forward_trace.bound_symbols if b.sym.name == "memopt_offload"
              for a in tensor_args(b)}
    assert copied and not copied & {copy.flat_proxy_args[1].name for _, _, copy in _donations(step.forward_trace)}


def test_only_an_input_of_the_outputs_layout_whose_elements_own_their_memory_is_donated():
    """An expanded input (stride 0) holds one element's memory for many: never a donation target."""
    from thunder.core import devices, dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    with tracectx(TraceCtx()):
        a = TensorProxy(shape=(4, 8), device=devices.Device("cpu"), dtype=dtypes.bfloat16)
        o = TensorProxy(like=a)
        other_dtype = TensorProxy(shape=(4, 8), device=devices.Device("cpu"), dtype=dtypes.float32)
    dense = {a.name: (8, 1), o.name: (8, 1), other_dtype.name: (8, 1)}
    assert donate._same_layout(o, a, dense)
    assert not donate._same_layout(o, a, {a.name: (0, 1), o.name: (0, 1)})
    assert not donate._same_layout(o, a, {a.name: (1, 4), o.name: (8, 1)})
    assert not donate._same_layout(other_dtype, a, dense)


def test_only_views_that_add_or_drop_dimensions_of_size_1_keep_a_region_index_preserving():
    """A region with such views still reads and writes each element at one index; any other view
    (a transpose, a reshape that regroups) reads elsewhere, and its region donates nothing."""
    from thunder.core import devices, dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.torch import reshape, transpose

    trace = TraceCtx()
    with tracectx(trace):
        x = TensorProxy(shape=(1, 4, 8), device=devices.Device("cpu"), dtype=dtypes.bfloat16)
        unit = reshape.bind(x, (4, 8), output=TensorProxy(shape=(4, 8), like=x))
        regroup = reshape.bind(x, (8, 4), output=TensorProxy(shape=(8, 4), like=x))
        swap = transpose.bind(x, 1, 2, output=TensorProxy(shape=(1, 8, 4), like=x))
    assert donate._adds_or_drops_unit_dims(unit)
    assert not donate._adds_or_drops_unit_dims(regroup)
    assert not donate._adds_or_drops_unit_dims(swap)
