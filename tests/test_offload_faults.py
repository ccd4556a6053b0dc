"""Faults a step with offload meets, on CPU (executors/offload.py; copies to a second CPU buffer
stand in for the host): bad host limits are one-line errors where MemoryOptimization is built;
"auto" takes its stated share of the host; and a step that raises part way (a CUDA out-of-memory
error in a copy of its forward or a reload of its backward) leaves nothing pinned, held or queued
once it is dropped, and the next steps equal a first one bit for bit; while it is kept, they
reload early as a first one does. The GPU's copy events and side stream are stood in for by
fakes, so that the bookkeeping that only CUDA fills (the copies not yet waited for, the reloads
not yet waited for) is filled here too."""

import gc
import sys

import pytest
import thunder
import torch

import thunder_memopt.passes.offload as offload_pass
from thunder_memopt import MemoryOptimization
from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.executors import offload as offload_executor

# Copies this fast hide behind any compute; budget 0.0 offloads every saved tensor anyway.
INSTANT = DeviceRates(to_host=1e18, to_device=1e18, flops=600e12, memory=4e12)
EMPTY = offload_executor.OffloadState(0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(("value", "error", "says"), [
    (0, ValueError, "host_memory_limit in bytes must be > 0, got 0"),
    (-(1 << 30), ValueError, "host_memory_limit in bytes must be > 0"),
    ("lots", ValueError, "host_memory_limit must be bytes (an int > 0) or 'auto', got 'lots'"),
    (0.5, TypeError, "host_memory_limit must be bytes (an int > 0) or 'auto', got 0.5"),
    (True, TypeError, "got True"),
    (None, TypeError, "got None"),
])
def test_a_bad_host_memory_limit_is_a_one_line_error(value, error, says):
    with pytest.raises(error) as raised:
        MemoryOptimization(offload="auto", host_memory_limit=value)
    assert says in str(raised.value) and "\n" not in str(raised.value)


@pytest.fixture
def fresh_host_limit(monkeypatch):
    """The process's host limit, its pinned bytes and its warning as a new process has them."""
    monkeypatch.setattr(offload_executor, "_host", offload_executor._HostLimit())


def test_auto_takes_half_the_hosts_available_memory_over_the_ranks_that_share_it(monkeypatch, fresh_host_limit):
    import numpy as np

    assert 0 < offload_executor._available_host_bytes()
    monkeypatch.setattr(offload_executor, "_available_host_bytes", lambda: 64 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    MemoryOptimization(offload="budget")
    assert offload_executor.host_memory_limit() == offload_executor.AUTO_HOST_FRACTION * (64 << 30) // 4 == 8 << 30
    MemoryOptimization(offload="auto", host_memory_limit=np.int64(3 << 20))  # a numpy integer is bytes too
    assert offload_executor.host_memory_limit() == 3 << 20
    MemoryOptimization(host_memory_limit=1)  # without offload the process's limit is left as it is
    assert offload_executor.host_memory_limit() == 3 << 20


def test_each_copy_counts_as_the_caching_host_allocator_rounds_it(fresh_host_limit):
    """A copy of 600 KiB takes a block of 1 MiB: under a limit of 1 MiB the next tensor, of one
    byte, stays on the device (its own "host copy", over its storage); the count falls as copies die."""
    offload_executor.set_host_memory_limit(1 << 20)
    copy = offload_executor._offload_impl(torch.zeros(600 << 10, dtype=torch.uint8), 0, True)
    assert offload_executor.offload_state().pinned_bytes == 1 << 20
    small = torch.ones(1, dtype=torch.uint8)
    kept = offload_executor._offload_impl(small, 1, False)
    assert kept.data_ptr() == small.data_ptr() and offload_executor.offload_state().kept == 1
    del copy, kept
    assert offload_executor.offload_state() == EMPTY


class _TanhStack(torch.nn.Module):
    """Five linear + tanh layers, whose five tanh outputs are saved for the backward; the first is
    also read last, so that its copy is not waited for before the others are made."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(5))

    def forward(self, x):
        first = x = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            x = torch.tanh(layer(x))
        return x + first


class _FakeCudaCopies:
    """Copies that finish at once but leave an event, as CUDA's do: memopt_offload then holds each
    source until its wait, and memopt_reload each reloaded tensor until its wait. The side stream
    records what is handed to it. ``fail_at``, ("copy", n) or ("reload wait", n), makes the n-th
    copy or wait for a reload (from 1) raise as an out-of-memory error does."""

    def __init__(self, monkeypatch):
        self.done = {"copy": 0, "reload wait": 0}
        self.fail_at, self.to_side_stream = None, []
        moved = offload_executor._moved
        monkeypatch.setattr(offload_executor, "_copied",
                            lambda t, to, device: (self._count("copy") or moved(t, to, None), "event"))
        monkeypatch.setattr(offload_executor, "_wait", lambda stream, copied, kind: kind == "reload"
                            and self._count("reload wait"))
        monkeypatch.setattr(offload_executor.torch.cuda, "current_stream", lambda device=None: None)
        monkeypatch.setattr(offload_executor, "_release_to_side_stream", lambda t: self.to_side_stream.append(t))

    def _count(self, what: str) -> None:
        self.done[what] += 1
        if self.fail_at == (what, self.done[what]):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _step(model, jitted, x):
    for p in model.parameters():
        p.grad = None
    loss = jitted(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_equal(a, b):
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


# Where the step fails, and how many tensors it leaves to the side stream: the forward's second copy
# (the first copy's source, read last, is not waited for yet); the backward's third copy, the
# prefetch at its second reload (the two reloads are not waited for yet: each starts before the wait
# for the one before); its second wait for a reload (the third reload is not waited for yet, and the
# fourth, prefetched, not asked for).
FAULTS = {"forward copy": (("copy", 2), 1), "backward copy": (("copy", 5 + 3), 2),
          "backward wait": (("reload wait", 2), 2)}


def test_a_step_that_runs_out_of_memory_leaves_nothing_behind(monkeypatch, fresh_host_limit):
    """After each fault, once the failed step is dropped, nothing is pinned, kept or pending, and
    what it never waited for went to the side stream; the next step equals the first and plain
    Thunder's, bit for bit, and so does one at a smaller shape."""
    monkeypatch.setattr(offload_pass, "MIN_BYTES", 1)
    torch.manual_seed(0)
    model, x = _TanhStack(), torch.randn(128, 64)
    plain = thunder.jit(model)
    memopt = MemoryOptimization(activation_budget=1.0, offload="budget", offload_budget=0.0, offload_rates=INSTANT)
    jitted = thunder.jit(model, transforms=[memopt])
    fake = _FakeCudaCopies(monkeypatch)
    first = _step(model, jitted, x)
    (plan,) = memopt.offload_plans
    assert len(plan.offloaded) == 5 and fake.done == {"copy": 10, "reload wait": 5}
    assert offload_executor.offload_state() == EMPTY and fake.to_side_stream == []  # every copy waited for
    _assert_equal(_step(model, plain, x), first)

    for fault, (fail_at, left) in FAULTS.items():
        fake.done, fake.fail_at, fake.to_side_stream = dict.fromkeys(fake.done, 0), fail_at, []
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            _step(model, jitted, x)
        gc.collect()
        assert offload_executor.offload_state() == EMPTY, fault
        assert len(fake.to_side_stream) == left, fault
        fake.fail_at = None
        _assert_equal(_step(model, jitted, x), first)
    smaller = x[:32]
    _assert_equal(_step(model, jitted, smaller), _step(model, plain, smaller))
    assert offload_executor.offload_state() == EMPTY


def test_a_cpu_prefetch_whose_copy_dies_goes_without_an_error_in_its_finalizer(monkeypatch, fresh_host_limit):
    """A host copy that dies while its reload, started ahead, is pending: on a CPU that reload was
    copied at once (no event), so its tensor is not handed to a side stream, which a CPU has none
    of. (No fakes: a side stream here would raise in the finalizer, and the error would be printed
    and ignored.)"""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda hook: unraisable.append(repr(hook.exc_value)))
    first = offload_executor._offload_impl(torch.randn(1024), 0, True)
    second = offload_executor._offload_impl(torch.randn(1024), 1, False)
    reloaded = offload_executor._reload_impl(first, "cpu")  # starts second's reload ahead
    assert torch.equal(reloaded, first) and offload_executor.offload_state().prefetched == 1
    del second
    gc.collect()
    assert unraisable == []
    del first, reloaded
    assert offload_executor.offload_state() == EMPTY


def test_the_steps_after_a_failed_one_kept_alive_reload_early_as_clean_steps_do(monkeypatch, fresh_host_limit):
    """With a failed step's exception held (so its graph and the copies it made stay alive), at each
    of ``FAULTS``' places, each of the next two steps starts as many reloads early as a clean step
    does, holds no prefetch of the failed step's copies after it, and equals the first step bit for
    bit; once the exception is dropped nothing is left."""
    monkeypatch.setattr(offload_pass, "MIN_BYTES", 1)
    torch.manual_seed(0)
    model, x = _TanhStack(), torch.randn(128, 64)
    memopt = MemoryOptimization(activation_budget=1.0, offload="budget", offload_budget=0.0, offload_rates=INSTANT)
    jitted = thunder.jit(model, transforms=[memopt])
    fake = _FakeCudaCopies(monkeypatch)

    def counted_step():
        with offload_executor.activity_recorded() as activity:
            result = _step(model, jitted, x)
        return result, (activity.reloads, activity.prefetched)

    first, clean = counted_step()
    assert clean == (5, 4)
    for fault, (fail_at, _) in FAULTS.items():
        fake.done, fake.fail_at = dict.fromkeys(fake.done, 0), fail_at
        with pytest.raises(RuntimeError, match="CUDA out of memory") as failed:
            _step(model, jitted, x)
        fake.fail_at = None
        assert offload_executor.offload_state().host_copies > 0, fault  # held by ``failed``
        for _ in range(2):
            result, counts = counted_step()
            assert counts == clean, fault
            _assert_equal(result, first)
            assert offload_executor.offload_state().prefetched == 0, fault
        del failed
        gc.collect()
        assert offload_executor.offload_state() == EMPTY, fault
