"""Offload (passes/offload.py, executors/offload.py) on CPU, where copies to a second CPU buffer
stand in for the host: the plan against stated device rates, offloaded steps bit-identical to
unoffloaded ones under thunder.jit and ThunderCompiler, and the memory model counting host copies
as no device bytes. The narrowed models' saved tensors are below ``MIN_BYTES``, so the tests that
train lower it."""

import warnings

import pytest
import torch
from _train import assert_same_numerics, shared_train_step, train_step

import thunder_memopt.passes.offload as offload_pass
from thunder_memopt import MemoryOptimization, thunderfx_backend
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.core.memory import HOST_MEMORY, estimate_step, saved_for_backward
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
    # What is offloaded plus what is kept is what the forward saves.
    saved = saved_for_backward(_budget_zero_step().forward_trace).activation_bytes
    assert everything.offloaded_bytes + everything.kept_bytes == saved


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


@pytest.fixture
def every_tensor_offloadable(monkeypatch):
    monkeypatch.setattr(offload_pass, "MIN_BYTES", 1)


def _offloaded_step(**options):
    memopt = MemoryOptimization(activation_budget=0.0, offload="budget", offload_rates=FAST, **options)
    return memopt, train_step(STABLECODE, [memopt])


def test_offloaded_steps_are_bit_identical_and_keep_only_host_copies_of_what_they_offload(every_tensor_offloadable):
    plain = _budget_zero_step()
    memopt, step = _offloaded_step()
    assert_same_numerics(plain, step)
    (plan,) = memopt.offload_plans
    names = lambda trace, op: [b for b in trace.bound_symbols if b.sym.name == op]  # noqa: E731
    copies = names(step.forward_trace, "memopt_offload")
    assert len(copies) == len(plan.offloaded) == len(names(step.forward_trace, "memopt_offload_wait"))
    assert len(names(step.backward_trace, "memopt_reload")) == len(names(step.backward_trace, "memopt_wait_reload"))
    assert all(HOST_MEMORY in b.output.tags for b in copies)
    # The memory model: what stays saved on the device falls by what was offloaded, and the step's
    # estimated peak does not rise.
    before, after = (estimate_step(s.forward_trace, s.backward_trace) for s in (plain, step))
    assert after.saved.activation_bytes == before.saved.activation_bytes - plan.offloaded_bytes
    assert after.peak_bytes <= before.peak_bytes


def test_offload_under_thunderfx_backend_is_bit_identical(every_tensor_offloadable):
    from thunder_memopt.models import build_model, narrow_config, random_batch

    config = narrow_config(STABLECODE, n_layer=2, n_embd=256, block_size=128)

    def run(memopt):
        torch._dynamo.reset()
        model = build_model(config)
        x, y = random_batch(config, batch_size=1, seq_len=128)
        logits = torch.compile(model, backend=thunderfx_backend(memopt))(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    reference = run(MemoryOptimization(activation_budget=0.0))
    memopt = MemoryOptimization(activation_budget=0.0, offload="budget", offload_rates=FAST)
    offloaded = run(memopt)
    assert sum(len(plan.offloaded) for plan in memopt.offload_plans) > 0
    assert torch.equal(reference[0], offloaded[0])
    assert all(torch.equal(a, b) for a, b in zip(reference[1], offloaded[1]))


def test_offload_is_off_on_cpu_without_rates_with_one_warning(every_tensor_offloadable):
    memopt = MemoryOptimization(activation_budget=0.0, offload="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = train_step(STABLECODE, [memopt])
    assert [str(w.message) for w in caught if "offload" in str(w.message)] == [
        "thunder_memopt: offload is off on CPU (no pinned host memory to copy to); "
        "pass offload_rates to plan and run it with CPU copies"]
    assert memopt.offload_plans == []
    assert not any(b.sym.name == "memopt_offload" for b in step.forward_trace.bound_symbols)
