"""MemoryOptimization(memory_limit=...): the planner against stated sizes, its monotonicity, bad
limits, and a thunder.jit step whose plan fits a limit the default's does not, checked and planned
again."""

import argparse
import functools
import warnings

import pytest
import thunder
import torch

from thunder_memopt import MemoryOptimization, arguments
from thunder_memopt.measure import measure_saved, peak_live_bytes
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, random_batch
from thunder_memopt.passes import fit
from thunder_memopt.passes.fit import DeviceMemory, RungCost, StepTerms

STABLECODE = "stablecode-completion-alpha-3b"

# Four rungs of a program that runs 4 times a step over 100 bytes of static state: (saved, the
# program's own peak, recompute seconds). Whole-step peaks: 100 + 3 x saved + own peak.
RUNGS = (
    RungCost(40, 60, 0.0),  # 280
    RungCost(25, 50, 1.0),  # 225
    RungCost(10, 45, 3.0),  # 175
    RungCost(12, 39, 2.5),  # 175, and less recompute than the rung before
)
TERMS = StepTerms(static_bytes=100, calls=4)


@pytest.mark.parametrize("limit, rung, fits", [
    (300, 0, True),  # everything fits: no recompute
    (250, 1, True),
    (225, 1, True),  # the limit is inclusive
    (200, 3, True),  # rungs 2 and 3 fit at 175: the one with less recompute
    (100, 3, False),  # nothing fits: the lowest peak (2 and 3 tie), the less recompute
])
def test_the_choice_against_stated_sizes(limit, rung, fits):
    choice = fit.choose_by_limit(RUNGS, TERMS, limit)
    assert (choice.rung, choice.fits) == (rung, fits)
    assert choice.predicted_peaks == (280, 225, 175, 175)
    assert choice.predicted_peak_bytes == choice.predicted_peaks[rung]


def test_a_margin_and_the_calls_count_in_the_peak():
    # 30 bytes of margin put rung 1 at 255, over 250; one call a step counts no other call's saves.
    assert fit.choose_by_limit(RUNGS, StepTerms(100, 4, margin_bytes=30), 250).rung == 3
    assert fit.choose_by_limit(RUNGS, StepTerms(100, 1), 160).predicted_peaks == (160, 150, 145, 139)
    assert fit.choose_by_limit(RUNGS, StepTerms(100, 1), 160).rung == 0


# The same ladder as the offload pass leaves it: half of each rung's saves copied to the host, the
# reloads of rung 1 exposed for 2 s. Whole-step peaks: 100 + 3 x (saved - copied) + own peak - copied.
OFFLOADED = tuple(RungCost(r.saved_bytes - r.saved_bytes // 2, r.pair_peak_bytes - r.saved_bytes // 2,
                           r.recompute_seconds + exposed, r.saved_bytes // 2)
                  for r, exposed in zip(RUNGS, (0.0, 2.0, 0.0, 0.0)))


@pytest.mark.parametrize("limit, way, rung", [
    (300, 0, 0),  # the default rung fits either way in 0 s: without copies
    (200, 1, 0),  # without copies rung 3 (2.5 s); with them the default (0 s)
    (180, 0, 3),  # with copies rung 1 (177) costs 3 s with its reloads, rung 3 2.5 s as without: without
    (160, 1, 3),  # only with copies does a rung fit: rung 3 (151, 2.5 s), not rung 2 (155, 3 s)
    (100, 1, 3),  # nothing fits: the lowest peak, with copies
])
def test_the_fastest_rung_that_fits_with_or_without_copies(limit, way, rung):
    choices = [fit.choose_by_limit(rungs, TERMS, limit) for rungs in (RUNGS, OFFLOADED)]
    assert choices[1].predicted_peaks == (200, 177, 155, 151)
    assert fit.fastest_fitting(choices) == way and choices[way].rung == rung


def test_a_lower_limit_never_gives_a_higher_predicted_peak():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        values = torch.randint(1, 100, (6, 3), generator=generator).tolist()
        rungs = [RungCost(saved, peak, float(seconds)) for saved, peak, seconds in values]
        chosen = [fit.choose_by_limit(rungs, TERMS, limit).predicted_peak_bytes for limit in range(600, 0, -7)]
        assert chosen == sorted(chosen, reverse=True), chosen


def test_the_check_plans_again_once_with_the_measured_error_as_margin():
    check = fit.check_fit(100, 120, 110, margin_bytes=5, replanned=False)
    assert (check.over, check.replan, check.error_bytes, check.margin_bytes) == (True, True, 20, 25)
    assert not fit.check_fit(100, 120, 110, margin_bytes=25, replanned=True).replan  # once
    under = fit.check_fit(100, 105, 110, margin_bytes=0, replanned=False)
    assert (under.over, under.replan, under.margin_bytes) == (False, False, 0)


def test_a_limit_resolves_against_the_device():
    memory = DeviceMemory(total=1000, free=500, reserved=200, allocated=150)
    assert fit.resolve_memory_limit(600, memory) == 600
    assert fit.resolve_memory_limit(0.5, memory) == 500
    assert fit.resolve_memory_limit("auto", memory) == 500 + 200 - int(fit.AUTO_MARGIN * 1000)
    assert fit.resolve_memory_limit(600, None) == 600


def test_a_limit_resolves_against_the_process_cap():
    # torch.cuda.set_per_process_memory_fraction(0.4): "auto" takes what the cap leaves, a limit
    # above the cap is refused in one line (the allocator would fail first).
    memory = DeviceMemory(total=1000, free=500, reserved=200, allocated=150, cap=400)
    assert fit.resolve_memory_limit("auto", memory) == 400 - int(fit.AUTO_MARGIN * 400)
    assert fit.resolve_memory_limit(0.3, memory) == 300
    for over in (401, 0.5):
        assert "cap of 400" in _one_line_error(ValueError, lambda: fit.resolve_memory_limit(over, memory))


def test_the_allocator_is_capped_at_the_limit_unless_the_process_is_capped_lower():
    memory = DeviceMemory(total=1000, free=500, reserved=200, allocated=150)
    assert fit.allocator_cap(600, memory) == 0.6
    assert fit.allocator_cap(600, DeviceMemory(1000, 500, 200, 150, cap=800)) == 0.6
    assert fit.allocator_cap(600, DeviceMemory(1000, 500, 200, 150, cap=600)) is None
    assert fit.allocator_cap(600, DeviceMemory(1000, 500, 200, 150, cap=400)) is None


def _one_line_error(kind, run):
    with pytest.raises(kind) as error:
        run()
    assert "\n" not in str(error.value), str(error.value)
    return str(error.value)


@pytest.mark.parametrize("limit, kind", [
    (-1, ValueError), (0, ValueError), (0.0, ValueError), (1.5, ValueError), ("lots", ValueError),
    (True, TypeError), ([1 << 30], TypeError), (b"1", TypeError),
])
def test_bad_limits_are_one_line_errors(limit, kind):
    assert "memory_limit" in _one_line_error(kind, lambda: MemoryOptimization(memory_limit=limit))


def test_limits_that_need_a_cuda_device_are_one_line_errors(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for limit in (0.5, "auto"):
        assert "bytes" in _one_line_error(ValueError, lambda: MemoryOptimization(memory_limit=limit))
    memory = DeviceMemory(total=1000, free=500, reserved=200, allocated=150)
    assert "more than" in _one_line_error(ValueError, lambda: fit.resolve_memory_limit(1001, memory))
    assert "not on one" in _one_line_error(ValueError, lambda: fit.resolve_memory_limit(0.5, None))


@pytest.mark.parametrize("text, value", [("123", 123), ("40GiB", 40 << 30), ("1.5MiB", 3 << 19), ("2KiB", 2048)])
def test_the_command_line_reads_bytes_and_binary_units(text, value):
    assert arguments.memory_limit(text) == value


@pytest.mark.parametrize("text", ["-1", "0", "-2GiB", "lots", "GiB", "1.5"])
def test_bad_limits_on_the_command_line_are_argparse_errors(text):
    _one_line_error(argparse.ArgumentTypeError, lambda: arguments.memory_limit(text))


def test_contradicting_options_are_one_line_errors():
    _one_line_error(ValueError, lambda: MemoryOptimization(memory_limit=1 << 30, activation_budget=0.5))
    _one_line_error(ValueError, lambda: MemoryOptimization(memory_limit=1 << 30, passes=("schedule",)))
    with pytest.raises(ValueError, match="memory_limit"):
        MemoryOptimization().check_fit(1 << 30)
    assert "memory_limit" in _one_line_error(ValueError, lambda: MemoryOptimization(cap_allocator=False))
    assert "cap_allocator" in _one_line_error(TypeError, lambda: MemoryOptimization(memory_limit=1, cap_allocator=1))


class _Training:
    """Stablecode with one layer (n_embd 256, T=256, bf16) with the loss, under ``thunder.jit`` with
    ``memopt`` on CPU, with no optimizer (``optimizer_states=0``)."""

    def __init__(self, memopt: MemoryOptimization) -> None:
        config = narrow_config(STABLECODE, n_layer=1, n_embd=256, block_size=256)
        self.model = build_model(config)
        self.batch = random_batch(config, batch_size=1, seq_len=256)
        self.memopt = memopt
        self.jitted = thunder.jit(GPTWithLoss(self.model), transforms=[memopt])

    def step(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """The loss, the gradients and the saved bytes of a forward and backward."""
        self.model.zero_grad(set_to_none=True)
        measured = measure_saved(self.jitted, *self.batch, parameters=self.model.parameters())
        measured.output.backward()
        grads = {name: p.grad for name, p in self.model.named_parameters()}
        return measured.output.detach(), grads, measured.activation_bytes


def test_each_rung_is_priced_as_the_fusion_executor_fuses_it():
    """On meta with the GPU's executors, a stablecode Block's default rung is priced at the peak of
    the traces the transform runs. Priced with its regions taken apart, the GELU's backward, which
    replays the GELU, held fp32 tensors of the MLP's width that no region outputs."""
    from litgpt.model import Block

    from thunder_memopt import plan
    from thunder_memopt.core.memory import estimate_step

    config = narrow_config(STABLECODE, n_layer=1, n_embd=256, block_size=1024)
    memopt = MemoryOptimization(memory_limit=1 << 40)
    with plan._executors_claim_meta(gpu=True) as executors, torch.device("meta"):
        block = Block(config, block_idx=0).to(torch.bfloat16)
        x = torch.empty(1, 1024, config.n_embd, dtype=torch.bfloat16, requires_grad=True)
        cos = torch.empty(1, 1024, config.rope_n_elem, dtype=torch.bfloat16)
        jitted = thunder.jit(block, transforms=[memopt], executors=executors)
        jitted(x, cos, cos.clone())
    (choice,) = memopt.fit_report.choices
    ran = estimate_step(thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1])
    assert choice.rung == 0 and choice.rungs[0].pair_peak_bytes == ran.peak_bytes


@functools.cache
def _probe() -> fit.FitChoice:
    """A limit of one byte, which nothing fits: the predicted whole-step peak of every rung (the
    lowest is taken, with one warning)."""
    training = _Training(MemoryOptimization(memory_limit=1, optimizer_states=0, over_limit="lowest"))
    with pytest.warns(UserWarning, match="no recompute plan fits"):
        training.step()
    (choice,) = training.memopt.fit_report.choices
    assert not choice.fits and choice.predicted_peak_bytes == min(choice.predicted_peaks)
    return choice


def test_on_a_real_ladder_a_lower_limit_never_saves_more_nor_predicts_more():
    probe = _probe()
    saved, peaks = [], []
    for limit in sorted(set(probe.predicted_peaks), reverse=True):
        choice = fit.choose_by_limit(probe.rungs, probe.terms, limit)
        saved.append(choice.rungs[choice.rung].saved_bytes)
        peaks.append(choice.predicted_peak_bytes)
    assert saved == sorted(saved, reverse=True) and peaks == sorted(peaks, reverse=True)
    assert saved[-1] < saved[0]


def test_the_limit_takes_a_plan_that_fits_where_the_default_does_not_with_the_budgets_numerics():
    probe = _probe()
    limit = probe.predicted_peaks[0] - 1  # the default plan is over by a byte
    training = _Training(MemoryOptimization(memory_limit=limit, optimizer_states=0))
    fitted = training.step()
    (choice,) = training.memopt.fit_report.choices
    assert choice.rung > 0 and choice.fits and choice.predicted_peaks[0] > limit >= choice.predicted_peak_bytes
    # The budget that takes the same rung: a target between its own peak and the higher peaks of
    # the rungs before it.
    own = [p - choice.terms.static_bytes for p in choice.predicted_peaks]
    target = (own[choice.rung] + min(own[:choice.rung])) / 2
    budget = (target - min(own)) / (own[0] - min(own))
    budgeted = _Training(MemoryOptimization(activation_budget=budget)).step()
    assert torch.equal(fitted[0], budgeted[0])
    assert fitted[1].keys() == budgeted[1].keys()
    assert all(torch.equal(fitted[1][name], budgeted[1][name]) for name in fitted[1])
    assert fitted[2] == budgeted[2]


def test_with_offload_the_limit_takes_the_fastest_rung_with_or_without_copies_within_the_host_limit(monkeypatch):
    """With offload on, each rung is priced as it is and as the offload pass leaves it: what it saves
    on the device less the copies, and its recompute with the reloads the pass cannot hide. At the
    limit under which, without copies, only a rung with recompute fits, a host link fast enough to
    hide the copies lets the default rung fit with them; over a slower link, whose reloads cost
    more than the recompute saves, a rung with recompute is taken. Where the default rung fits
    without copies, nothing is copied. The offload pass copies what the fit priced.

    Each call's copies take at most the program's share of the pinned host limit, each as the
    allocator rounds it: the pass keeps the rest on the device, and the fit prices each rung so. A
    host limit below every tensor holds no copy, so every rung is priced as without offload; with
    half the default rung's copies the limit takes a rung no slower than without copies."""
    from thunder_memopt.core.cost import DeviceRates
    from thunder_memopt.passes import offload

    monkeypatch.setattr(offload, "MIN_BYTES", 1)  # the narrow model's tensors are small
    probe = _probe()
    tight, roomy = probe.predicted_peaks[0] - 1, probe.predicted_peaks[0]
    fast, slow = (DeviceRates(to_host=b, to_device=b, flops=600e12, memory=4e12) for b in (5e15, 50e9))
    taken, copied = {}, {}
    for case, link, host, limit in (("fast", fast, None, tight), ("slow", slow, None, tight),
                                    ("no host", fast, 1, tight), ("half host", fast, "half", tight),
                                    ("roomy", fast, None, roomy)):
        if host == "half":
            host = taken["fast"].rungs[0].pinned_bytes // 2
        memopt = MemoryOptimization(memory_limit=limit, optimizer_states=0, offload="budget", offload_budget=0.0,
                                    offload_rates=link, **({} if host is None else {"host_memory_limit": host}))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no copy reaches the executor's host limit
            _Training(memopt).step()
        (choice,) = memopt.fit_report.choices
        assert choice.fits, case
        assert [r.saved_bytes + r.offloaded_bytes for r in choice.rungs] == [r.saved_bytes for r in probe.rungs]
        assert all(r.offloaded_bytes <= r.pinned_bytes <= (host or r.pinned_bytes) for r in choice.rungs)
        (plan,) = memopt.offload_plans
        assert plan.offloaded_bytes == choice.rungs[choice.rung].offloaded_bytes
        taken[case], copied[case] = choice, plan.offloaded_bytes
    assert taken["fast"].rung == 0 and copied["fast"] > 0
    assert taken["slow"].rung > 0
    assert taken["roomy"].rung == 0 and copied["roomy"] == 0
    nothing = taken["no host"]
    assert [r.offloaded_bytes for r in nothing.rungs] == [0] * len(nothing.rungs)
    assert nothing.predicted_peaks == probe.predicted_peaks
    assert nothing.rung == fit.choose_by_limit(probe.rungs, probe.terms, tight).rung > 0
    half = taken["half host"]
    assert half.rungs[half.rung].recompute_seconds <= nothing.rungs[nothing.rung].recompute_seconds


def test_a_step_over_the_limit_is_planned_again_once():
    probe = _probe()
    limit = probe.predicted_peaks[0]  # the default plan fits, just
    training = _Training(MemoryOptimization(memory_limit=limit, optimizer_states=0))
    memopt, jitted = training.memopt, training.jitted
    first, _, _ = training.step()
    assert memopt.fit_report.choices[0].rung == 0
    # On CPU the step's peak is the profiler's live tensor bytes above what was alive before, and
    # the static term is those inputs: the prediction matches it as the memory model's estimate does.
    training.model.zero_grad(set_to_none=True)
    measured = memopt.fit_report.choices[0].terms.static_bytes + peak_live_bytes(
        lambda: jitted(*training.batch).backward())
    check = memopt.check_fit(measured)
    assert check.measured_bytes == pytest.approx(check.predicted_bytes, rel=0.01), check
    assert not check.replan and thunder.cache_misses(jitted) == 1
    # A step measured over the limit by half of what the ladder can take off (as optimizer states
    # made at the first step would be): every function jitted with the transform is planned again at
    # its next call, with the error as the margin, and the new plan's prediction, margin included,
    # fits.
    check = memopt.check_fit(limit + (limit - min(probe.predicted_peaks)) // 2)
    assert check.replan and check.margin_bytes == check.error_bytes > 0
    second, _, saved = training.step()
    assert thunder.cache_misses(jitted) == 2
    (choice,) = memopt.fit_report.choices
    assert choice.terms.margin_bytes == check.margin_bytes and choice.rung > 0 and choice.fits
    assert saved < choice.rungs[0].saved_bytes
    assert torch.equal(first, second)
    for bad in (-1, 1.5, "1"):
        _one_line_error(ValueError, lambda: memopt.check_fit(bad))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not memopt.check_fit(2 * limit).replan  # once


def test_a_second_plan_keeps_the_static_term_the_margin_was_measured_against(monkeypatch):
    """On CUDA the static term is the allocator's bytes at the first compile. Between that and the
    second plan's compile the first optimizer step makes AdamW's states, which the measured error
    (the margin) holds already: read again, they would count twice, and nothing would fit."""
    probe = _probe()
    allocated = [1 << 30]
    monkeypatch.setattr(fit, "device_memory", lambda device: DeviceMemory(
        total=1 << 40, free=1 << 39, reserved=allocated[0], allocated=allocated[0]))
    _record_caps(monkeypatch)
    pair_peaks = [rung.pair_peak_bytes for rung in probe.rungs]
    limit = allocated[0] + pair_peaks[0]  # the default plan fits, just
    training = _Training(MemoryOptimization(memory_limit=limit, offload_rates=fit.NOMINAL_RATES,
                                             optimizer_states=0))
    memopt = training.memopt
    training.step()
    assert memopt.fit_report.choices[0].rung == 0
    assert memopt.fit_report.choices[0].terms.static_bytes == 1 << 30
    allocated[0] = 2 << 30  # the optimizer's states, made at the first step
    check = memopt.check_fit(limit + (pair_peaks[0] - min(pair_peaks)) // 2)
    assert check.replan
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "thunder_memopt: no recompute plan fits")
        training.step()
    (choice,) = memopt.fit_report.choices
    assert choice.terms.static_bytes == 1 << 30 and choice.terms.margin_bytes == check.margin_bytes
    assert choice.rung > 0 and choice.fits


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.out(x), y)


def test_under_thunder_compiler_a_program_run_once_per_block_is_counted_so():
    # Three Blocks compiled one by one, as FSDP2's units are under torch.compile: one program,
    # called three times a step; the head's, once.
    memopt = MemoryOptimization(memory_limit=1 << 20)
    step = _blocks_then_head(memopt)
    step()
    assert [c.terms.calls for c in memopt.fit_report.choices] == [1, 1]
    block, loss = memopt.fit_report.choices
    # The check prices the Block's program with the other two calls' saved tensors.
    check = memopt.check_fit((1 << 20) + 1)
    three = StepTerms(block.terms.static_bytes, 3, 0).peak(block.rungs[block.rung])
    assert check.predicted_bytes == max(three, loss.predicted_peak_bytes) and check.replan
    step()  # planned again, with the calls counted
    assert [c.terms.calls for c in memopt.fit_report.choices] == [3, 1]
    assert all(c.fits for c in memopt.fit_report.choices)


def _blocks_then_head(memopt: MemoryOptimization):
    """Three Blocks and a head, each compiled under ThunderCompiler with ``memopt`` as FSDP2's units
    are under torch.compile. Returns a training step."""
    from thunder.dynamo import ThunderCompiler

    torch.manual_seed(0)
    blocks, head = [_Block() for _ in range(3)], _Head()
    backend = ThunderCompiler(transforms=[memopt])
    for module in (*blocks, head):
        module.compile(backend=backend)
    x, y = torch.randn(32, 64, requires_grad=True), torch.randint(0, 10, (32,))

    def step() -> None:
        h = x
        for module in blocks:
            h = module(h)
        head(h, y).backward()

    return step


def _fake_allocator(memopt: MemoryOptimization, monkeypatch, resident: int, other: int) -> None:
    """The allocator faked for ``_blocks_then_head``: ``resident`` bytes at the Blocks' compile; at
    the head's, compiled after the three Blocks saved theirs, those too and ``other`` bytes besides."""
    def memory(device: torch.device) -> DeviceMemory:
        report = memopt.fit_report
        block = None if report is None else report.choices[0]
        allocated = resident if block is None else resident + 3 * block.rungs[block.rung].saved_bytes + other
        return DeviceMemory(total=1 << 41, free=1 << 40, reserved=allocated, allocated=allocated)

    monkeypatch.setattr(fit, "device_memory", memory)
    _record_caps(monkeypatch)


def _record_caps(monkeypatch) -> list[float]:
    """The fractions the fit caps the (faked) CUDA allocator at, in order."""
    from thunder_memopt import stages

    caps = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: caps.append(fraction))
    monkeypatch.setattr(stages, "_ALLOCATOR_CAPS", {})
    return caps


def test_on_cuda_the_allocator_is_capped_once_at_the_limit_resolved_at_the_first_plan(monkeypatch):
    """The allocator is capped at the first plan, so that what it reserves stays under the limit.
    "auto" is resolved there, once: against the cap, the later programs' would be 5% lower each."""
    total, free, reserved = 1 << 41, 1 << 40, 1 << 30
    caps = _record_caps(monkeypatch)
    monkeypatch.setattr(fit, "device_memory", lambda device: DeviceMemory(
        total=total, free=free, reserved=reserved, allocated=reserved,
        cap=round(caps[-1] * total) if caps else None))
    auto = free + reserved - int(fit.AUTO_MARGIN * total)
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)  # "auto" is checked for a device at once
        memopt, uncapped = (MemoryOptimization(memory_limit="auto", offload_rates=fit.NOMINAL_RATES,
                                               cap_allocator=cap) for cap in (True, False))
    _blocks_then_head(memopt)()
    assert caps == [auto / total] and memopt.fit_report.allocator_fraction == auto / total
    assert [choice.limit_bytes for choice in memopt.fit_report.choices] == [auto, auto]
    caps.clear()
    _blocks_then_head(uncapped)()
    assert caps == [] and uncapped.fit_report.allocator_fraction is None
    # A later limit above the cap an earlier one set replaces it; without cap_allocator, lifts it.
    wider = MemoryOptimization(memory_limit=total * 3 // 4, offload_rates=fit.NOMINAL_RATES)
    _blocks_then_head(wider)()
    assert caps == [0.75] and wider.fit_report.allocator_fraction == 0.75
    lifted = MemoryOptimization(memory_limit=total // 8, offload_rates=fit.NOMINAL_RATES, cap_allocator=False)
    _blocks_then_head(lifted)()
    assert caps == [0.75, 1.0] and lifted.fit_report.allocator_fraction is None
    caps.append(0.125)  # the process capped at the limit already, not by a limit: left as it is
    capped = MemoryOptimization(memory_limit=total // 8, offload_rates=fit.NOMINAL_RATES)
    _blocks_then_head(capped)()
    assert caps == [0.75, 1.0, 0.125] and capped.fit_report.allocator_fraction is None


def test_a_block_planned_again_lowers_the_peak_of_the_head_that_holds_its_saved_tensors(monkeypatch):
    """Under FSDP2 the step's peak is in the loss head, compiled after every Block has run: on CUDA
    its static term, the allocator's bytes, holds every Block's saved tensors. Planned again, the
    Block takes the rung under which the head fits, though its own prediction fits at the default;
    then the head's static term follows the Block's new saved bytes."""
    resident, other = 1 << 30, 1 << 20
    probe = MemoryOptimization(memory_limit=1 << 40, offload_rates=fit.NOMINAL_RATES)
    _fake_allocator(probe, monkeypatch, resident, other)
    _blocks_then_head(probe)()
    block, loss = probe.fit_report.choices
    assert block.rung == 0 and loss.terms.static_bytes == resident + 3 * block.rungs[0].saved_bytes + other
    least = min(rung.saved_bytes for rung in block.rungs)
    assert least < block.rungs[0].saved_bytes
    # The limit: the head's peak with every Block at the ladder's least saved bytes.
    limit = loss.predicted_peak_bytes - 3 * (block.rungs[0].saved_bytes - least)
    # At the head's first plan the Blocks' calls are not counted yet (one each, until check_fit):
    # the head takes its lowest plan, and the check plans again.
    memopt = MemoryOptimization(memory_limit=limit, offload_rates=fit.NOMINAL_RATES, over_limit="lowest")
    _fake_allocator(memopt, monkeypatch, resident, other)
    step = _blocks_then_head(memopt)
    with pytest.warns(UserWarning, match="no recompute plan fits"):  # the head's, planned after the Blocks
        step()
    check = memopt.check_fit(loss.predicted_peak_bytes)  # the head's peak, as predicted
    assert check.replan and check.margin_bytes == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "thunder_memopt: no recompute plan fits")
        step()
    block, loss = memopt.fit_report.choices
    assert block.rung > 0 and block.rungs[block.rung].saved_bytes == least and block.fits
    assert loss.terms.static_bytes == resident + 3 * least + other and loss.fits
    assert memopt.check_fit(limit).predicted_bytes == limit


def test_a_jitted_function_is_not_compiled_again_and_says_so():
    torch.manual_seed(0)
    block = _Block()
    memopt = MemoryOptimization(memory_limit=1 << 20)
    jitted = thunder.jit(lambda x: block(x).sum(), transforms=[memopt])
    x = torch.randn(32, 64, requires_grad=True)
    jitted(x).backward()
    with pytest.warns(UserWarning, match="no module jitted with this instance"):
        assert memopt.check_fit(2 << 20).replan
    jitted(x).backward()
    assert thunder.cache_misses(jitted) == 1 and memopt.fit_report.check.margin_bytes > 0
