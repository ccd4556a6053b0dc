"""thunder_memopt's executors (thunder_memopt.executors): the inductor fusion executor, forced onto
CPU where inductor's C++ backend serves, with and without MemoryOptimization; the cuDNN attention
executor's checker; the executor list's nvFuser guard; the torch.compile backend's defaults."""

from concurrent.futures import Future

import pytest
import thunder
import torch
from thunder.core import devices, dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.trace import TraceCtx, tracectx
from thunder.dev_utils.check_trace import check_trace
from thunder.extend import FusionExecutor

import thunder_memopt.stages as stages_module
import thunder_memopt.transform as transform_module
from _train import assert_same_numerics, shared_train_step, train_step
from thunder_memopt import MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.core.memory import tensor_nbytes
from thunder_memopt.core.ops import unclassified_names
from thunder_memopt.core.trace import is_bookkeeping
from thunder_memopt.executors import (
    InductorFusionExecutor,
    cudnn_attention_ex,
    cudnn_supports,
    fusion_ex,
    linear_cross_entropy_ex,
)

STABLECODE = "stablecode-completion-alpha-3b"
# Inductor's C++ code rounds differently from ATen's kernels (the norms' reductions run in another
# order): each gradient within a few bf16 epsilons (7.8e-3) of plain Thunder's, in norm.
GRAD_RELATIVE_ERROR = 2e-2
CPU_FUSION = InductorFusionExecutor("memopt_fusion_test_cpu", devices=("cpu",))
# The fused steps' shape. Two layers are enough for identical layers to share compiled functions
# (11 forward regions, 6 functions). The tests that fuse share these shapes (and, this file's tests
# running in one process, the compiled regions), so that inductor compiles each region once:
# inductor's FX graph cache does not serve the fusion executor's compilations ('No shape env').
FUSED_SHAPE = {"n_layer": 2, "seq_len": 128}
# The unfused steps that check what the fusion executor leaves alone on CPU.
UNFUSED_SHAPE = {"n_layer": 1, "seq_len": 64}


def _cpu_executors():
    return [CPU_FUSION, *thunder.get_default_executors()]


def _regions(trace):
    return [b for b in trace.bound_symbols if CPU_FUSION.is_own_fusion(b)]


def _compiled_regions(jitted) -> list:
    """The distinct compiled functions behind the regions of a jitted function's last forward and
    backward."""
    regions = _regions(thunder.last_traces(jitted)[-1]) + _regions(thunder.last_backward_traces(jitted)[-1])
    return list({id(fn): fn for b in regions for fn in b._call_ctx.values()}.values())


def _written_bytes(regions):
    return sum(tensor_nbytes(o) for b in regions for o in b.flat_proxy_outs if isinstance(o, TensorProxy))


def _functions(regions):
    return {id(fn) for b in regions for fn in b._call_ctx.values()}


def test_fusion_with_and_without_memopt_is_close_to_plain_thunder_and_saves_no_more():
    plain = shared_train_step(STABLECODE, **FUSED_SHAPE)
    fused = shared_train_step(STABLECODE, **FUSED_SHAPE, executors=_cpu_executors())
    memopt = shared_train_step(STABLECODE, {}, **FUSED_SHAPE)
    both = shared_train_step(STABLECODE, {}, **FUSED_SHAPE, executors=_cpu_executors())

    for step in (fused, both):
        torch.testing.assert_close(step.loss, plain.loss, rtol=1e-3, atol=0)
        for name, grad in plain.grads.items():
            error = (step.grads[name].float() - grad.float()).norm() / grad.float().norm()
            assert error <= GRAD_RELATIVE_ERROR, (name, error.item())
        check_trace(step.forward_trace)
        check_trace(step.backward_trace)
        for trace in (step.forward_trace, step.backward_trace):  # regions are named by what they hold
            assert [n for b in trace.bound_symbols if not is_bookkeeping(b) for n in unclassified_names(b)] == []
        forward, backward = _regions(step.forward_trace), _regions(step.backward_trace)
        assert forward and backward
        # Every layer's regions are the same ops on the same shapes: they share compiled functions.
        assert len(_functions(forward)) < len(forward) and len(_functions(backward)) < len(backward)
        # Nothing but the cheap ops is claimed: matmuls and the embedding stay outside regions.
        inside = {sub.sym.name for b in forward + backward for sub in b.subsymbols}
        assert not inside & {"linear", "matmul", "embedding", "embedding_backward"}

    # Recompute cuts between ops, not regions: fusion saves no more than the unfused plan.
    assert both.saved_bytes <= memopt.saved_bytes < fused.saved_bytes <= plain.saved_bytes
    # And the replays keep the forward's regions whole: they write no more than the fused step's
    # regions, which also write what that step saves.
    assert _written_bytes(_regions(both.forward_trace)) <= _written_bytes(_regions(fused.forward_trace))
    # The backward replays the forward's regions, running the very functions the forward ran: the
    # step is the fused step's, bit for bit.
    assert _functions(_regions(both.forward_trace)) & _functions(_regions(both.backward_trace))
    assert_same_numerics(fused, both)


def test_a_region_is_compiled_again_for_inputs_of_another_layout(monkeypatch):
    """Regions run inductor's code without dynamo's guards: the code is specialized to its inputs'
    strides, so a transposed input must get code of its own, not the contiguous input's. (The
    compilation is stubbed: what is tested is which layouts get their own.)"""
    from thunder_memopt.executors import fusion

    compiled_for = []

    def compile_stub(fn, args):
        compiled_for.append(tuple(a.stride() for a in args))
        return fn

    monkeypatch.setattr(fusion, "_inductor_compiled", compile_stub)

    def scale_and_round(x):
        return ((x.float() * 3.0).to(torch.bfloat16),)

    with tracectx(TraceCtx()):
        x_proxy = TensorProxy(shape=(8, 16), device=devices.Device("cpu"), dtype=dtypes.bfloat16)
    region = fusion._CompiledRegion(lambda: scale_and_round, [fusion.torch_metadata(x_proxy)])
    rows, columns = torch.randn(8, 16).bfloat16(), torch.randn(16, 8).bfloat16().t()  # both 8 x 16
    for x in (rows, columns, rows.clone(), columns):
        assert torch.equal(region(x)[0], scale_and_round(x)[0])
    assert compiled_for == [((16, 1),), ((1, 8),)] and region.seconds >= 0


def test_code_compiled_for_one_stride_of_a_size_1_dimension_runs_for_another():
    """Layouts leave out the strides of dimensions of size 1 (``fusion._strides``): inductor's code
    does not read them and its input checks skip them. If a torch release changed that, this fails."""
    from thunder_memopt.executors import fusion

    def double_sin(a):
        return ((a.float() * 2).sin().to(torch.bfloat16),)

    with fusion._fake_mode():
        example = torch.empty_strided((1, 32, 16), (0, 16, 1), dtype=torch.bfloat16)
    compiled = fusion._inductor_compiled(double_sin, [example])
    x = torch.randn(1, 32, 16).bfloat16()  # strides (512, 16, 1)
    assert fusion._strides(x) == fusion._strides(example) and x.stride() != example.stride()
    assert torch.equal(compiled(x)[0], double_sin(x)[0])


class _NormMlp(torch.nn.Module):
    """A block of cheap ops around two matmuls, of shapes no other test fuses: its regions are
    compiled afresh here, not shared with another test's."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 2 * width)
        self.proj = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.norm(x))))


def _norm_mlp_step(width: int = 96, **jit_options) -> tuple[thunder.ThunderModule, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _NormMlp(width).bfloat16()
    x = torch.randn(3, 40, width, dtype=torch.bfloat16)
    jitted = thunder.jit(model, **jit_options)
    jitted(x).float().square().mean().backward()
    return jitted, [p.grad for p in model.parameters()]


def test_a_region_compiles_straight_to_inductors_graph_compiler_without_autotuning(monkeypatch):
    """A region's graph goes to ``compile_fx_inner`` under the options that fix every kernel's launch
    configuration (NO_AUTOTUNING) and round as ATen does (EAGER_NUMERICS), never through
    ``compile_fx`` and its AOTAutograd; what it compiles computes what the function does."""
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config

    from thunder_memopt.executors import fusion

    options = []
    real = compile_fx_module.compile_fx_inner

    def spy(graph, inputs, **kwargs):
        options.append((config.deterministic, config.triton.autotune_pointwise, config.emulate_precision_casts))
        return real(graph, inputs, **kwargs)

    def no_aot(*args, **kwargs):
        raise AssertionError("compile_fx (AOTAutograd) called")

    monkeypatch.setattr(compile_fx_module, "compile_fx_inner", spy)
    monkeypatch.setattr(compile_fx_module, "compile_fx", no_aot)

    def region(x, w):
        return [(x.float() * w + 1).to(torch.bfloat16), x.reshape(-1)]

    x, w = torch.randn(8, 16).to(torch.bfloat16), torch.randn(16)
    mode = fusion._fake_mode()
    with torch.no_grad():
        compiled = fusion._inductor_compiled(region, [mode.from_tensor(x), mode.from_tensor(w)])
        out, flat = compiled(x, w)
    assert options == [(True, False, True)]
    assert torch.equal(out, region(x, w)[0])
    assert flat.data_ptr() == x.data_ptr()  # a view of an input stays one


def test_memopt_compiles_the_final_traces_regions_ahead_through_inductors_cache():
    """MemoryOptimization compiles the regions of a forward and its backward together, ahead of
    their first calls, for the strides the memory model expects of their inputs, which are the
    strides they meet (no layout is compiled at a first call); inductor's FX graph cache serves
    them rather than being bypassed."""
    from torch._dynamo.utils import counters

    from thunder_memopt.executors import fusion

    counters["inductor"].clear()
    jitted, _ = _norm_mlp_step(executors=_cpu_executors(), transforms=[MemoryOptimization()])
    functions = _compiled_regions(jitted)
    assert functions and all(isinstance(fn, fusion._CompiledRegion) for fn in functions)
    assert all(fn.layouts_ahead == 1 and fn.layouts_at_call == 0 for fn in functions)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] >= len(functions)


def test_the_memory_model_foresees_the_strides_every_region_meets():
    """compile_ahead compiles for ``memory.simulated_strides``: on stablecode's fused traces (a
    region returns a broadcast mask, stride 0 where it is expanded; a backward receives what its
    forward saved) every region has run for the layout it predicts."""
    from thunder_memopt.core.memory import simulated_strides

    both = shared_train_step(STABLECODE, {}, **FUSED_SHAPE, executors=_cpu_executors())
    forward = simulated_strides(both.forward_trace)
    backward = simulated_strides(both.backward_trace, received=forward)
    checked = 0
    for trace, strides in ((both.forward_trace, forward), (both.backward_trace, backward)):
        for b in _regions(trace):
            if not all(isinstance(a, TensorProxy) for a in b.args):
                continue
            (fn,) = b._call_ctx.values()
            layout = tuple(tuple(s if n > 1 else 0 for n, s in zip(a.shape, strides[a.name])) for a in b.args)
            assert layout in fn._by_layout and layout not in fn._not_run_yet, b.sym.name
            checked += 1
    assert checked >= 10
    shapes = {o.name: o.shape for b in both.forward_trace.bound_symbols for o in b.flat_proxy_outs
              if isinstance(o, TensorProxy)}
    assert any(s == 0 and n > 1 for name, shape in shapes.items() for s, n in zip(forward[name], shape))  # the mask


def test_the_memory_model_gives_cudnn_attentions_outputs_the_layouts_cudnn_allocates():
    """cuDNN allocates the output like the query and each gradient like its input: dense, in the
    input's order of dimensions. A value that views the fused qkv projection, (B, T, H, D) in memory,
    gets its gradient in that order, not contiguous (on one H200 the region that reads it was
    compiled again at its first call, 1.2 s of the first step)."""
    import thunder.torch as ltorch

    from thunder_memopt.core.memory import simulated_strides
    from thunder_memopt.executors.cudnn_attention import cudnn_sdpa_bwd, cudnn_sdpa_fwd

    def attention(qkv, grad):
        q, k, v = (ltorch.transpose(ltorch.reshape(t, (1, 128, 4, 64)), 1, 2) for t in ltorch.split(qkv, 256, -1))
        q, k = ltorch.contiguous(q), ltorch.contiguous(k)
        out, lse, seed, offset = cudnn_sdpa_fwd(q, k, v, None, True, None)
        return out, cudnn_sdpa_bwd(grad, q, k, v, out, lse, seed, offset, None, True, None)

    trace = thunder.trace(inline_trace=False)(attention, torch.empty(1, 128, 768, dtype=torch.bfloat16),
                                              torch.empty(1, 4, 128, 64, dtype=torch.bfloat16))
    strides = simulated_strides(trace)
    out, (dq, dk, dv) = trace.output
    contiguous, heads_inside_tokens = (4 * 128 * 64, 128 * 64, 64, 1), (4 * 128 * 64, 64, 4 * 64, 1)
    assert [strides[t.name] for t in (out, dq, dk, dv)] == [contiguous] * 3 + [heads_inside_tokens]


def test_kernels_loaded_while_the_compile_pool_starts_compile_when_awaited_each_source_once(monkeypatch):
    """compile_ahead's modules, loaded before inductor's compile pool is ready, leave their Triton
    kernels to the await, where they go to the pool if it is ready by then (here it is), instead of
    compiling one after another during lowering. (Inductor's Triton compilation is stubbed.)"""
    from torch._inductor.async_compile import AsyncCompile

    from thunder_memopt.executors import fusion

    pool_ready, compiled = False, []

    def triton(self, kernel_name, source_code, device_str="cuda"):
        compiled.append((kernel_name, pool_ready))
        return f"kernel {kernel_name}"

    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: pool_ready))
    monkeypatch.setattr(AsyncCompile, "triton", triton)
    scopes = []
    with fusion._kernels_deferred(scopes):
        module = AsyncCompile()
        scope = {"a": module.triton("a", "source a"), "b": module.triton("b", "source b"),
                 "a_again": module.triton("a", "source a")}
        module.wait(scope)
        assert compiled == [] and scopes == [scope]
    pool_ready = True
    fusion._await_kernels(scopes)
    assert scope == {"a": "kernel a", "b": "kernel b", "a_again": "kernel a"}
    assert compiled == [("a", True), ("b", True)]


def test_kernels_compiled_ahead_are_awaited_at_each_regions_first_run_and_all_before_a_compilation(monkeypatch):
    """compile_ahead returns while the Triton kernels of the regions it lowered still compile: each
    region waits at its first run for its own module's (the forward's do not wait for the
    backward's), and a later compilation waits for them all, since it may load one of these modules
    from inductor's cache. Futures stand in for the compile pool's."""
    from torch._inductor import async_compile

    from thunder_memopt.executors import fusion

    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 2)
    forward_kernel, backward_kernel = Future(), Future()
    forward_module, backward_module = {"k": forward_kernel}, {"k": backward_kernel}
    batch = fusion._PendingKernels([forward_module, backward_module])
    forward_kernel.set_result("forward kernel")
    batch.part([forward_module]).wait()
    assert forward_module == {"k": "forward kernel"} and backward_module["k"] is backward_kernel
    backward_kernel.set_result("backward kernel")
    fusion._PendingKernels.await_all()
    assert backward_module == {"k": "backward kernel"} and not fusion._PendingKernels._outstanding


def test_a_compiled_concatenation_with_empty_tensors_has_eagers_strides():
    """litgpt's rotary embedding concatenates each head's rotated part with an empty rest where the
    rotation covers the whole head (Llama). Eagerly the result is contiguous; inductor's own
    decomposition keeps the rotation's (B, T, H, D) order, where the memory model expects eager's
    strides (and cuDNN returns the gradient in the query's order)."""
    from thunder_memopt.executors import fusion

    def rotate_and_concatenate(x, rest):
        return [torch.cat([(x.float() * 2).to(torch.bfloat16), rest], -1)]

    x = torch.randn(1, 16, 4, 32, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, T, D), (B, T, H, D) in memory
    rest = torch.empty(1, 4, 16, 0, dtype=torch.bfloat16)
    mode = fusion._fake_mode()
    with torch.no_grad():
        compiled = fusion._inductor_compiled(rotate_and_concatenate, [mode.from_tensor(t) for t in (x, rest)])
        (got,), (expected,) = compiled(x, rest), rotate_and_concatenate(x, rest)
    assert got.stride() == expected.stride() == (4 * 16 * 32, 16 * 32, 32, 1)
    assert torch.equal(got, expected)


def test_a_failing_compile_ahead_leaves_the_regions_to_their_first_calls_with_one_warning(monkeypatch):
    """Training goes on: the regions (of a width no other test fuses) compile at their first calls,
    and the step computes what the fusion executor alone computes, bit for bit, as it does when
    they are compiled ahead."""
    def failing(traces):
        raise RuntimeError("no compile workers")

    monkeypatch.setattr(transform_module, "compile_ahead", failing)
    with pytest.warns(UserWarning, match="fusion regions left to compile at their first calls") as caught:
        jitted, grads = _norm_mlp_step(80, executors=_cpu_executors(), transforms=[MemoryOptimization()])
    assert len([w for w in caught if "thunder_memopt" in str(w.message)]) == 1
    functions = _compiled_regions(jitted)
    assert functions and all(fn.layouts_ahead == 0 and fn.layouts_at_call == 1 for fn in functions)
    _, fused_grads = _norm_mlp_step(80, executors=_cpu_executors())
    assert all(torch.equal(a, b) for a, b in zip(grads, fused_grads))


def test_a_region_compiled_ahead_computes_what_it_computes_compiled_at_its_first_call():
    """Bit for bit, for the (contiguous) inputs it was compiled ahead for, and for inputs of another
    layout, which it compiles at the call. Inductor's FX graph cache is off, so that each
    compilation generates its code anew."""
    from thunder.core.trace import from_trace

    from thunder_memopt.executors import fusion

    jitted, _ = _norm_mlp_step(executors=_cpu_executors())
    forward = thunder.last_traces(jitted)[-1]
    region = min(_regions(forward), key=lambda b: len(b.subsymbols))
    (source,) = region._call_ctx.values()
    inputs = list(region.args)
    ahead, at_call = (fusion._CompiledRegion(lambda: source.fn, [fusion.torch_metadata(a) for a in inputs])
                      for _ in range(2))
    with torch._inductor.config.patch(fx_graph_cache=False):
        trace = from_trace(forward)  # the region alone: its inputs come from nowhere, so contiguous
        trace.bound_symbols = [region.from_bsym(_call_ctx={"f": ahead})]
        assert fusion.compile_ahead([trace]) == 1
        torch.manual_seed(1)
        args = [torch.randn(a.shape).to(dtypes.to_torch_dtype(a.dtype)) for a in inputs]
        assert all(torch.equal(x, y) for x, y in zip(ahead(*args), at_call(*args)))
        assert (ahead.layouts_ahead, ahead.layouts_at_call) == (1, 0)
        # The same values, each with its last two dimensions stored the other way round.
        strided = [a.transpose(-1, -2).contiguous().transpose(-1, -2) for a in args]
        assert all(a.ndim >= 2 for a in args) and all(a.stride() != b.stride() for a, b in zip(args, strided))
        assert all(torch.equal(x, y) for x, y in zip(ahead(*strided), at_call(*strided)))
        assert (ahead.layouts_ahead, ahead.layouts_at_call) == (1, 1)
    # Each one's time splits into lowering, the wait for kernels compiled ahead (none at a call), and
    # first runs.
    for fn in (ahead, at_call):
        assert 0 < fn.lowering_seconds and fn.lowering_seconds + fn.kernel_wait_seconds <= fn.seconds
    assert at_call.kernel_wait_seconds == 0 < ahead.kernel_wait_seconds


@pytest.mark.parametrize("memopt", [None, {}], ids=["thunder", "memopt"])
def test_fusion_off_is_bit_identical_to_plain_thunder(memopt):
    plain = shared_train_step(STABLECODE, memopt, **UNFUSED_SHAPE)
    off = shared_train_step(STABLECODE, memopt, **UNFUSED_SHAPE, executors=executors(fusion=False))
    assert_same_numerics(plain, off)
    # On CPU the default list's fusion executor (CUDA's) claims nothing either.
    default = shared_train_step(STABLECODE, memopt, **UNFUSED_SHAPE, executors=executors())
    assert_same_numerics(plain, default)


def test_a_failing_refusion_keeps_thunders_fused_trace_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    fused = shared_train_step(STABLECODE, **FUSED_SHAPE, executors=_cpu_executors())
    monkeypatch.setattr(stages_module, "fuse_forward", broken)
    with pytest.warns(UserWarning, match="thunder_memopt: fusion left this trace as Thunder fused it") as caught:
        step = train_step(STABLECODE, [MemoryOptimization()], **FUSED_SHAPE, executors=_cpu_executors())
    assert sum("thunder_memopt" in str(w.message) for w in caught) == 1
    assert step.saved_bytes == fused.saved_bytes
    assert_same_numerics(fused, step)


def _qkv(shape=(1, 4, 128, 64), *, dtype=dtypes.bfloat16, device="cuda:0", k_shape=None):
    with tracectx(TraceCtx()):
        q = TensorProxy(shape=shape, device=devices.Device(device), dtype=dtype)
        k = TensorProxy(shape=k_shape or shape, device=devices.Device(device), dtype=dtype)
        v = TensorProxy(shape=k_shape or shape, device=devices.Device(device), dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "inputs, options, served",
    [
        (_qkv(), {"is_causal": True}, True),
        (_qkv((2, 8, 256, 80)), {}, True),
        (_qkv((1, 4, 128, 128)), {"scale": 0.1}, True),
        (_qkv(dtype=dtypes.float16), {}, True),
        (_qkv(dtype=dtypes.float32), {}, False),  # cuDNN attention is fp16/bf16 only
        (_qkv((1, 4, 128, 60)), {}, False),  # head size not a multiple of 8
        (_qkv((1, 4, 128, 256)), {}, False),  # head size above 128 (off sm90: see the next test)
        (_qkv(device="cpu"), {}, False),
        (_qkv(k_shape=(1, 2, 128, 64)), {}, False),  # grouped heads: left to the sdpa executor
        (_qkv(), {"dropout_p": 0.1}, False),
        (_qkv(), {"attn_mask": ((1, 1, 128, 128), dtypes.bool8)}, True),  # transformers' boolean mask
        (_qkv(), {"attn_mask": ((1, 4, 128, 128), dtypes.bfloat16)}, True),  # additive, the query's dtype
        (_qkv(), {"attn_mask": ((1, 1, 128, 128), dtypes.float32)}, False),  # additive, another dtype
        (_qkv(), {"attn_mask": ((1, 1, 128, 128), dtypes.bfloat16, "requires_grad")}, False),
        (_qkv(), {"attn_mask": ((1, 1, 1, 128), dtypes.bool8)}, False),  # broadcast over queries
        (_qkv(), {"attn_mask": ((1, 4, 128, 64), dtypes.bfloat16)}, False),  # not the scores' shape
        (_qkv(), {"attn_mask": ((128, 128), dtypes.bool8)}, False),  # 2-d
    ],
)
def test_cudnn_attention_checker_falls_back_where_cudnn_does_not_serve(inputs, options, served, monkeypatch):
    import thunder_memopt.executors.cudnn_attention as cudnn_attention

    monkeypatch.setattr(cudnn_attention, "max_head_size", lambda index: cudnn_attention.MAX_HEAD_SIZE)
    options = dict(options)
    if "attn_mask" in options:
        shape, dtype, *requires_grad = options["attn_mask"]
        with tracectx(TraceCtx()):
            options["attn_mask"] = TensorProxy(shape=shape, device=inputs[0].device, dtype=dtype,
                                               requires_grad=bool(requires_grad))
    assert cudnn_supports(*inputs, **options) is served


@pytest.mark.parametrize("capability, cudnn, served", [((9, 0), 91002, True), ((9, 0), 90800, False),
                                                       ((8, 0), 91002, False), ((10, 0), 91002, False)])
def test_cudnn_attention_takes_head_size_256_where_torch_does(capability, cudnn, served, monkeypatch):
    """As torch 2.11's check_cudnn_tensor_shapes: head sizes up to 256 with cuDNN 9.10 or later on
    sm90 exactly (Gemma-2's 256), up to 128 elsewhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    assert cudnn_supports(*_qkv((1, 4, 128, 256)), is_causal=True) is served
    assert cudnn_supports(*_qkv((1, 4, 128, 264)), is_causal=True) is False


def test_on_cpu_attention_is_not_claimed_by_cudnn():
    step = shared_train_step(STABLECODE, **UNFUSED_SHAPE, executors=executors())
    names = {b.sym.name for b in step.forward_trace.bound_symbols}
    assert not any(name.startswith("memopt_cudnn") for name in names)


def test_executors_leave_fusion_to_nvfuser_where_it_is_a_default(monkeypatch):
    fake_nvfuser = FusionExecutor("nvfuser")
    defaults = list(thunder.get_default_executors())
    assert executors()[:3] == [linear_cross_entropy_ex, cudnn_attention_ex, fusion_ex]
    # One switch: without fusion, neither cuDNN attention nor the loss head (another kernel, another
    # order of sums than plain Thunder's); each can still be asked for.
    assert executors(fusion=False) == defaults
    assert executors(fusion=False, cudnn_attention=True) == [cudnn_attention_ex, *defaults]
    monkeypatch.setattr(thunder, "get_default_executors", lambda: [fake_nvfuser, *defaults])
    # nvFuser fuses what the fusion executor would; the loss head is another matter, and stays.
    chosen = executors()
    assert fusion_ex not in chosen and chosen[:3] == [linear_cross_entropy_ex, cudnn_attention_ex, fake_nvfuser]


@pytest.mark.parametrize("kwargs", [{"fusion": 1}, {"cudnn_attention": "yes"}, {"loss_head": 0}])
def test_executors_reject_options_that_are_not_bools(kwargs):
    (name,) = kwargs
    with pytest.raises(TypeError, match=name):
        executors(**kwargs)


@pytest.mark.parametrize("argument", [0.5, MemoryOptimization])
def test_thunderfx_backend_rejects_what_is_not_a_memory_optimization(argument):
    with pytest.raises(TypeError, match="memory_optimization"):
        thunderfx_backend(argument)


def test_thunderfx_backend_uses_thunder_memopts_executors_unless_given_others():
    assert thunderfx_backend().compiler.thunder_options["executors"][:3] == [
        linear_cross_entropy_ex, cudnn_attention_ex, fusion_ex]
    off = thunderfx_backend(fusion=False).compiler.thunder_options["executors"]
    assert fusion_ex not in off and linear_cross_entropy_ex not in off
    mine = list(thunder.get_default_executors())
    assert thunderfx_backend(executors=mine).compiler.thunder_options["executors"] == mine
