"""Offload (passes/offload.py, executors/offload.py) on CPU, where copies to a second CPU buffer
stand in for the host: the plan against stated device rates, offloaded steps bit-identical to
unoffloaded ones under thunder.jit and ThunderCompiler, past a host memory limit too, and the
memory model counting host copies as no device bytes. The narrowed models' saved tensors are below
``MIN_BYTES``, so the tests that train lower it."""

import functools
import warnings
import weakref

import pytest
import torch
from _train import assert_same_numerics, shared_train_step, train_step

import thunder_memopt.passes.offload as offload_pass
from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.core.memory import HOST_MEMORY, estimate_step, saved_for_backward, simulated_strides
from thunder_memopt.passes.offload import OffloadMode, plan_offload

STABLECODE = "stablecode-completion-alpha-3b"
# An H200's order of magnitude; the copies of the narrowed models hide behind compute at these.
FAST = DeviceRates(to_host=50e9, to_device=50e9, flops=600e12, memory=4e12)
# Copies a million times slower than compute: none hides.
SLOW = DeviceRates(to_host=50e3, to_device=50e3, flops=600e12, memory=4e12)


def _budget_zero_step():
    return shared_train_step(STABLECODE, {"activation_budget": 0.0})


def _plan(mode: OffloadMode, rates: DeviceRates, budget: float = 0.0):
    step = _budget_zero_step()
    return plan_offload(step.forward_trace, step.backward_trace, mode=mode, budget=budget, rates=rates, min_bytes=1)


def test_the_plan_offloads_what_hides_behind_compute_at_the_stated_rates():
    everything = _plan(OffloadMode.BUDGET, SLOW)
    assert everything.offloaded, "budget 0.0 offloads every candidate"
    hidden = _plan(OffloadMode.AUTO, FAST)
    assert hidden.offloaded and hidden.exposed_seconds == 0.0 and hidden.to_host_hidden
    assert _plan(OffloadMode.AUTO, SLOW).offloaded == ()
    assert _plan(OffloadMode.OFF, FAST).offloaded == ()
    assert not everything.to_host_hidden and everything.exposed_seconds > 0.0
    # The plan says what it was made for: the rates, and its copies' end against the forward's compute.
    assert hidden.rates == FAST and 0.0 < hidden.to_host_end_seconds <= hidden.forward_seconds
    assert everything.to_host_end_seconds > everything.forward_seconds
    # What is offloaded plus what is kept is what the forward saves.
    saved = saved_for_backward(_budget_zero_step().forward_trace).activation_bytes
    assert everything.offloaded_bytes + everything.kept_bytes == saved


def test_a_backward_after_another_like_it_finds_its_first_reload_started_there():
    """A Block's backward under FSDP2 follows the next Block's, during which the executor starts its
    first reload (each reload starts the one asked for after it, across programs): a tensor read
    first thing in the backward hides there, while alone it would keep the backward waiting.
    Reloads that take longer than a backward pile up from one backward to the next and show.
    (One byte a second: each copy takes its bytes in seconds.)"""
    rates = DeviceRates(to_host=1.0, to_device=1.0, flops=1.0, memory=1.0)
    # A forward of 10 s that makes the tensor in its first second; a backward of 10 s that reads it at 1 s.
    pair = offload_pass._Pair(forward=(), backward=(), forward_times=(0.0, 1.0, 10.0), backward_times=(0.0, 1.0, 10.0))
    read_first = offload_pass._Candidate("a", nbytes=6, produced=0, last_read=0, first_read=1)
    assert offload_pass._exposed([read_first], pair, rates) == (True, 5.0)
    assert offload_pass._exposed([read_first], pair, rates, chained=True) == (True, 0.0)
    # 12 s of reloads in each 10 s backward.
    large = offload_pass._Candidate("a", nbytes=9, produced=0, last_read=0, first_read=1)
    small = offload_pass._Candidate("b", nbytes=3, produced=0, last_read=0, first_read=1)
    _, waited = offload_pass._exposed([large, small], pair, rates, chained=True)
    assert waited > 0.0


def test_a_pair_is_chained_where_its_backward_follows_another_programs():
    """A Block takes an activation that needs a gradient and gets a tensor's gradient back; a whole
    model with its loss takes token ids and starts its backward from the scalar loss."""
    import thunder
    from litgpt.model import Block

    from thunder_memopt.models import narrow_config

    whole = _budget_zero_step()
    assert not offload_pass._is_chained(whole.forward_trace, whole.backward_trace)
    config = narrow_config(STABLECODE, n_layer=1, n_embd=64, block_size=16)
    block = thunder.jit(Block(config, block_idx=0))
    x = torch.randn(1, 16, config.n_embd, requires_grad=True)
    cos, sin = torch.ones(1, 16, config.rope_n_elem), torch.zeros(1, 16, config.rope_n_elem)
    block(x, cos, sin).sum().backward()
    assert offload_pass._is_chained(thunder.last_traces(block)[-1], thunder.last_backward_traces(block)[-1])


def test_the_budget_keeps_no_more_than_its_share_on_the_device():
    half = _plan(OffloadMode.BUDGET, SLOW, budget=0.5)
    whole = half.offloaded_bytes + half.kept_bytes
    assert half.kept_bytes <= 0.5 * whole < whole
    assert half.offloaded_bytes < _plan(OffloadMode.BUDGET, SLOW).offloaded_bytes
    assert _plan(OffloadMode.BUDGET, SLOW, budget=1.0).offloaded == ()


def test_the_forward_lets_each_source_go_after_its_last_reader():
    step = _budget_zero_step()
    plan = _plan(OffloadMode.BUDGET, FAST)
    computing = [b for b in step.forward_trace.bound_symbols if not offload_pass.is_bookkeeping(b)]
    for name, after in zip(plan.offloaded, plan.released_after):
        readers = [i for i, b in enumerate(computing) if any(getattr(a, "name", None) == name for a in b.flat_proxy_args)]
        assert after >= max(readers, default=-1), name


def test_a_copy_that_would_end_after_the_forward_is_released_to_it_not_waited_for():
    """Copies the budget forces that outlast the forward do not stall it: each tensor is released to
    its copy right after its last forward reader. Copies that hide are waited for where they end."""
    step = _budget_zero_step()
    forced = _plan(OffloadMode.BUDGET, SLOW)
    assert forced.spilled == forced.offloaded
    computing = [b for b in step.forward_trace.bound_symbols if not offload_pass.is_bookkeeping(b)]
    for name, after in zip(forced.offloaded, forced.released_after):
        readers = [i for i, b in enumerate(computing) if any(getattr(a, "name", None) == name for a in b.flat_proxy_args)]
        produced = [i for i, b in enumerate(computing) if name in {o.name for o in offload_pass.tensor_outs(b)}]
        assert after == max(readers + produced, default=-1), name
    assert _plan(OffloadMode.AUTO, FAST).spilled == ()


def test_offload_budget_sets_what_stays_on_the_device_apart_from_recompute(every_tensor_offloadable):
    """activation_budget=1.0 with offload_budget=0.0: recompute as at 1.0 (the same saved set), and
    every candidate copied to the host, where the copies do not hide (a million times slower than
    compute); without offload_budget the budget 1.0 keeps them all. Numerics as at budget 1.0. (One
    layer: at any depth the same check; tests/test_recompute.py's one-layer step at 1.0 is shared.)"""
    plain = shared_train_step(STABLECODE, {"activation_budget": 1.0}, n_layer=1)
    kept_all = MemoryOptimization(activation_budget=1.0, offload="budget", offload_rates=SLOW)
    train_step(STABLECODE, [kept_all], n_layer=1)
    memopt = MemoryOptimization(activation_budget=1.0, offload="budget", offload_budget=0.0, offload_rates=SLOW)
    step = train_step(STABLECODE, [memopt], n_layer=1)
    assert_same_numerics(plain, step)
    assert [plan.offloaded for plan in kept_all.offload_plans] == [()]
    (plan,) = memopt.offload_plans
    assert plan.offloaded and plan.spilled == plan.offloaded
    assert plan.offloaded_bytes + plan.kept_bytes == saved_for_backward(plain.forward_trace).activation_bytes
    assert "offload_budget=0.0" in repr(memopt)


@pytest.fixture
def every_tensor_offloadable(monkeypatch):
    monkeypatch.setattr(offload_pass, "MIN_BYTES", 1)


@functools.cache
def _offloaded_step():
    """Offload at budget 0.0, shared by the tests that only read it (as ``shared_train_step``)."""
    memopt = MemoryOptimization(activation_budget=0.0, offload="budget", offload_rates=FAST)
    return memopt, train_step(STABLECODE, [memopt])


def test_offloaded_steps_are_bit_identical_and_keep_only_host_copies_of_what_they_offload(every_tensor_offloadable):
    plain = _budget_zero_step()
    memopt, step = _offloaded_step()
    assert_same_numerics(plain, step)
    (plan,) = memopt.offload_plans
    names = lambda trace, op: [b for b in trace.bound_symbols if b.sym.name == op]  # noqa: E731
    copies = names(step.forward_trace, "memopt_offload")
    releases = names(step.forward_trace, "memopt_offload_release")
    assert len(copies) == len(plan.offloaded) == len(names(step.forward_trace, "memopt_offload_wait")) + len(releases)
    assert len(releases) == len(plan.spilled)
    assert len(names(step.backward_trace, "memopt_reload")) == len(names(step.backward_trace, "memopt_wait_reload"))
    assert all(HOST_MEMORY in b.output.tags for b in copies)
    # Reloaded tensors are predicted with the strides their sources had in the forward, for which
    # the backward's fusion regions are compiled ahead.
    forward_strides = simulated_strides(step.forward_trace)
    backward_strides = simulated_strides(step.backward_trace, received=forward_strides)
    for wait in names(step.backward_trace, "memopt_wait_reload"):
        assert backward_strides[wait.output.name] == forward_strides[wait.output.name]
    # The memory model: what stays saved on the device falls by what was offloaded, and the step's
    # estimated peak does not rise.
    before, after = (estimate_step(s.forward_trace, s.backward_trace) for s in (plain, step))
    assert after.saved.activation_bytes == before.saved.activation_bytes - plan.offloaded_bytes
    assert after.peak_bytes <= before.peak_bytes


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _deep_mlp() -> torch.nn.Module:
    """At budget 1.0 it saves several tensors (each tanh's output, each linear's input)."""
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 64))


class _TwoBlocks(torch.nn.Module):
    """Two residual blocks with a graph break between them: dynamo hands ThunderCompiler two
    subgraphs, each a forward/backward pair of its own (as FSDP2's Blocks are)."""

    def __init__(self, block=_mlp):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(2))

    def forward(self, x):
        x = x + self.blocks[0](x)
        torch._dynamo.graph_break()
        return x + self.blocks[1](x)


def _two_blocks_step(compile_model, memopt, block=_mlp):
    torch.manual_seed(0)
    model = _TwoBlocks(block)
    x = torch.randn(4, 32, 64)
    out = compile_model(model, memopt)(x)
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


def _under_thunderfx(model, memopt):
    torch._dynamo.reset()
    return torch.compile(model, backend=thunderfx_backend(memopt))


def test_offload_under_thunderfx_backend_is_bit_identical(every_tensor_offloadable):
    reference = _two_blocks_step(_under_thunderfx, MemoryOptimization(activation_budget=0.0))
    memopt = MemoryOptimization(activation_budget=0.0, offload="budget", offload_rates=FAST)
    offloaded = _two_blocks_step(_under_thunderfx, memopt)
    assert len(memopt.offload_plans) == 2 and all(plan.offloaded for plan in memopt.offload_plans)
    assert torch.equal(reference[0], offloaded[0])
    assert all(torch.equal(a, b) for a, b in zip(reference[1], offloaded[1]))


def test_offload_is_off_on_cpu_without_rates_with_one_warning(every_tensor_offloadable):
    import thunder

    memopt = MemoryOptimization(activation_budget=0.0, offload="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _two_blocks_step(_under_thunderfx, memopt)
        _two_blocks_step(lambda model, m: thunder.jit(model, transforms=[m]), memopt)
    assert [str(w.message) for w in caught if "offload" in str(w.message)] == [
        "thunder_memopt: offload is off on CPU (no pinned host memory to copy to); "
        "pass offload_rates to plan and run it with CPU copies"]
    assert memopt.offload_plans == []


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24.0).reshape(2, 3, 4).transpose(0, 2),  # dense, not contiguous
    lambda: torch.arange(6.0).reshape(1, 6).expand(5, 6),  # stride 0: its storage is 6 elements
    lambda: torch.arange(40.0).reshape(8, 5)[3:, 1:4],  # a slice at an offset, not dense
], ids=["transposed", "expanded", "sliced"])
def test_a_moved_tensor_keeps_its_strides_and_moves_only_its_span(make):
    from thunder_memopt.executors.offload import _moved

    t = make()
    moved = _moved(t, "cpu", None)
    assert torch.equal(moved, t) and moved.stride() == t.stride()
    assert moved.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    offset, extent = t.storage_offset(), 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    # Its storage is the span, behind the elements that keep the offset's alignment to 512 bytes.
    assert moved.untyped_storage().nbytes() == (moved.storage_offset() + extent) * t.element_size()
    assert moved.storage_offset() * t.element_size() == offset * t.element_size() % 512


def test_the_prefetch_takes_the_latest_forward_calls_first_reload():
    """Under FSDP2 each Block is a program: the Block whose backward runs next is the latest forward
    call with copies left, and of those it reloads the one of rank 0 first (at budget 0.0, the
    Block's input, though its forward copied it first of all)."""
    from thunder_memopt.executors.offload import _Offloaded, next_to_prefetch

    copies = [torch.zeros(1) for _ in range(5)]
    entry = lambda i, group, rank, device="cuda:0": _Offloaded(weakref.ref(copies[i]), device, group, rank)  # noqa: E731
    offloaded = {0: entry(0, 1, 0), 1: entry(1, 1, 1), 2: entry(2, 2, 1), 3: entry(3, 2, 0), 4: entry(4, 2, 2)}
    assert next_to_prefetch(offloaded, "cuda:0") == 3
    del offloaded[3], offloaded[2], offloaded[4]  # the latest Block's backward reloaded them
    assert next_to_prefetch(offloaded, "cuda:0") == 0
    assert next_to_prefetch(offloaded, "cuda:1") is None
    assert next_to_prefetch({0: _Offloaded(weakref.ref(torch.zeros(1)), "cuda:0", 3, 0)}, "cuda:0") is None  # dead


def test_waits_are_timed_by_kind_and_only_within_the_block(monkeypatch):
    """Each wait of a compute stream for a copy is bracketed by two timing events, whose interval
    ``activity_recorded`` sums by kind when its block ends; outside it a wait records nothing. (CUDA's
    streams and events stood in for by fakes on a clock: each wait takes 2 ms here.)"""
    from thunder_memopt.executors import offload as offload_executor

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    class Stream:
        def wait_event(self, event):
            clock[0] += 2.0

    monkeypatch.setattr(offload_executor.torch.cuda, "Event", Event)
    offload_executor._wait(Stream(), Event(), "reload")  # outside: not timed
    with offload_executor.activity_recorded() as activity:
        for kind in ("to_host", "reload", "reload"):
            offload_executor._wait(Stream(), Event(), kind)
    assert activity.wait_ms == {"to_host": 2.0, "reload": 4.0}
    assert offload_executor._activity is None and not offload_executor._timed_waits


def test_a_spilled_copy_gives_its_source_to_the_side_stream_and_lets_it_go(monkeypatch):
    """``memopt_offload_release``: no wait on the compute stream; the source is recorded on the side
    stream (the allocator reuses its block once the copy has run) and the keepalive drops it. (The
    side stream and the CUDA source stood in for by fakes.)"""
    from thunder_memopt.executors import offload as offload_executor

    recorded = []

    class Source:
        device = "cuda:0"

        def record_stream(self, stream):
            recorded.append(stream)

    monkeypatch.setattr(offload_executor, "_side_stream", lambda device: f"side stream of {device}")
    host = torch.zeros(1)
    offload_executor._copying[id(host)] = ("copied event", Source())
    offload_executor._offload_release_impl(host)
    assert recorded == ["side stream of cuda:0"] and id(host) not in offload_executor._copying
    offload_executor._offload_release_impl(torch.zeros(1))  # a CPU copy: nothing to release


def test_every_reload_but_the_first_backwards_first_finds_its_copy_prefetched(every_tensor_offloadable):
    """The prefetch knows a host copy by its object: the one the forward made must reach the
    backward, though Thunder's autograd function detaches the views it saves. Two programs (as
    FSDP2's Blocks are): within each backward every reload after the first was started by the one
    before it, and the second backward's first by the first backward's last. (On GPU before this
    held, no reload found its copy started, and a step of stablecode's 32 layers at T=16384 stood
    still 195 ms for reloads.)"""
    from thunder_memopt.executors import offload as offload_executor

    # Copies this fast hide behind any compute: each Block offloads what it saves.
    instant = DeviceRates(to_host=1e18, to_device=1e18, flops=FAST.flops, memory=FAST.memory)
    memopt = MemoryOptimization(activation_budget=1.0, offload="auto", offload_rates=instant)
    with offload_executor.activity_recorded() as activity:
        _two_blocks_step(_under_thunderfx, memopt, _deep_mlp)
    offloaded = sum(len(plan.offloaded) for plan in memopt.offload_plans)
    assert offloaded > 2
    assert activity.reloads == offloaded
    assert activity.prefetched == offloaded - 1


def test_a_row_records_what_each_offload_plan_was_made_for():
    """The benchmark's row: bytes summed over the plans, the rates, and each plan's copies on its clock."""
    from benchmarks.fsdp2.compile_rows import offload_fields

    plan = _plan(OffloadMode.AUTO, FAST)
    fields = offload_fields([plan, plan])
    assert fields["offloaded_bytes"] == 2 * plan.offloaded_bytes and fields["offload_to_host_gbps"] == 50.0
    assert fields["offload_plans"][0] == {
        "offloaded_bytes": plan.offloaded_bytes, "forward_ms": 1e3 * plan.forward_seconds,
        "to_host_end_ms": 1e3 * plan.to_host_end_seconds, "exposed_ms": 1e3 * plan.exposed_seconds,
        "spilled": len(plan.spilled)}


def test_past_the_host_limit_saved_tensors_stay_on_the_device_bit_for_bit(every_tensor_offloadable, monkeypatch):
    """With a host limit of 1 MiB, of the four saved tensors budget 0.0 offloads (two of 512 KiB, two
    of 128 KiB, in the order 512, 128, 512, 128 KiB), the second of 512 KiB would take the pinned
    copies past it: it stays on the device, the others are pinned. One warning names the bytes kept and
    the option to raise; the loss and the gradients are those of the unlimited offload and of no
    offload, bit for bit, and nothing is left pinned or kept after the step. (The process's limit
    and its warning start as a new process has them.)"""
    from thunder_memopt.executors import offload as offload_executor

    monkeypatch.setattr(offload_executor, "_host", offload_executor._HostLimit())
    plain = _budget_zero_step()
    unlimited_memopt, unlimited = _offloaded_step()
    memopt = MemoryOptimization(activation_budget=0.0, offload="budget", offload_rates=FAST, host_memory_limit=1 << 20)
    with warnings.catch_warnings(record=True) as caught, offload_executor.activity_recorded() as activity:
        warnings.simplefilter("always")
        limited = train_step(STABLECODE, [memopt])
    assert_same_numerics(plain, limited)
    assert_same_numerics(unlimited, limited)
    (plan,) = memopt.offload_plans
    assert plan.offloaded == unlimited_memopt.offload_plans[0].offloaded and len(plan.offloaded) == 4
    assert 0 < activity.kept_bytes < plan.offloaded_bytes and activity.reloads > 0
    assert offload_executor.host_memory_limit() == 1 << 20
    kept = [str(w.message) for w in caught if "host_memory_limit" in str(w.message)]
    assert kept == [f"thunder_memopt: offload kept {activity.kept_bytes / 2**20:.1f} MiB of saved tensors on the "
                    "device: their copies would have taken its pinned host memory past host_memory_limit (1.0 MiB); "
                    "raise MemoryOptimization(host_memory_limit=...) to offload them (warned once)"]
    assert offload_executor.offload_state() == offload_executor.OffloadState(0, 0, 0, 0, 0, 0)
