"""The passes as ``MemoryOptimization`` runs them on the traces after Thunder's autodiff: stages of
one shape, and the record of a forward/backward pair they share.

Each pass is one or more stages (``Stage``; recompute's two: ``recompute`` plans, ``fusion`` makes
the plan the forward) with one interface: a forward (the forward trace in, the forward and a carry
for its backward out), a backward (the backward in, the backward out, and the forward that replaces
the one handed back, if any), and a hook once both traces are final. A stage adapts its pass module
(thunder_memopt.passes), which holds no state across traces, to the transform: what a pair's forward
leaves for its backward is its carry in the pair's record (``Pair.carries``), and what the transform
reports (schedule results, offload plans) the stage keeps. ``may_fall_back`` says, in one place,
where a stage that raises may leave the trace as it was and where it must not.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from thunder.core.trace import TraceCtx
from torch.optim.optimizer import register_optimizer_step_post_hook

from thunder_memopt.core.cost import DeviceRates, measure_rates
from thunder_memopt.core.memory import backward_storages, simulated_strides
from thunder_memopt.core.trace import saved_proxies
from thunder_memopt.executors import offload as offload_executor
from thunder_memopt.executors.fusion import InductorFusionExecutor
from thunder_memopt.passes import collectives, donate, fit, loss_head, recompute, schedule
from thunder_memopt.passes import offload as offload_module

__all__ = [
    "Pair",
    "Stage",
    "RecomputeStage",
    "FitPlanner",
    "FusionStage",
    "CollectivesStage",
    "ScheduleStage",
    "OffloadStage",
    "DonationStage",
    "UnmadeGradientStage",
    "Phase",
    "may_fall_back",
    "fuse_forward",
]

# Rungs between the default plan and the most recompute, for budgets below 1.0.
_LADDER_STEPS = 8


@dataclass
class Pair:
    """A forward/backward pair. ``MemoryOptimization`` keeps one per forward, keyed by the tensors
    Thunder's forward saves, which are the inputs of the backward Thunder hands over next;
    ThunderCompiler shares one transform instance across all its subgraphs."""

    fusion: InductorFusionExecutor | None = None  # the fusion executor in the forward's executor list
    returned: TraceCtx | None = None  # the forward handed back to Thunder (None: a backward without one)
    carries: dict[str, Any] = field(default_factory=dict)  # what each stage's forward left, by stage name

    def replace_forward(self, trace: TraceCtx) -> None:
        """The forward handed back to Thunder changed in place to ``trace``'s symbols, from the
        backward's hook (a budget's rung, the offloads). Thunder compiles the forward trace only
        after that hook returns: it calls every transform on the forward, then on the backward, then
        builds both callables (tests/test_recompute.py checks that the forward that runs saves what
        the changed trace says)."""
        self.returned.bound_symbols = trace.bound_symbols
        self.returned.scopes = [self.returned.bound_symbols]


class Stage:
    """One stage of a pass on the post-optimization traces: a forward, a backward, and a hook on the
    pair once both traces are final, each taking part for a pair where its ``runs_*`` says so. The
    defaults leave traces unchanged."""

    name: str  # its key in ``pass_seconds``, in its warnings and in ``Pair.carries``
    kept = "this trace unchanged"  # what it leaves when it fails, for the warning
    on_inference = False  # whether it also runs on inference traces

    def runs_forward(self, pair: Pair) -> bool:
        return True

    def forward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, Any]:
        """The forward, and what its backward needs (the carry; None: nothing)."""
        return trace, None

    def fall_back(self, trace: TraceCtx, pair: Pair) -> TraceCtx:
        """The forward kept when ``forward(trace, pair)`` raised."""
        return trace

    def runs_backward(self, pair: Pair) -> bool:
        return True

    def backward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx | None]:
        """The backward, and the forward that replaces the one handed back (None: it stays)."""
        return trace, None

    def runs_on_final(self, pair: Pair) -> bool:
        return False

    def on_final(self, forward: TraceCtx, backward: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx]:
        """Both traces of a pair, once the other stages are done with them."""
        return forward, backward


@dataclass(frozen=True)
class _Ladder:
    """A forward's recompute plans, for its backward to pick one by the budget."""

    given: TraceCtx  # the forward as Thunder handed it
    original: TraceCtx  # the same, its fusion regions taken apart
    plans: list[recompute.RecomputePlan]  # the default first
    rung: int = 0  # the plan the forward takes


# The caps on each CUDA device's caching allocator that a memory limit set in this process, in bytes.
_ALLOCATOR_CAPS: dict[str, int] = {}


class FitPlanner:
    """The state of ``memory_limit`` across a transform's programs: the limit as given, the margin
    and each program's calls per step once a check has measured them, and each program's choice
    (``passes.fit``). Programs are known by the tensors Thunder's forward saves (``key``), which a
    program compiled again saves under the same names; structurally identical programs compiled
    apart share a key, and count as one program called by each."""

    def __init__(self, limit: fit.MemoryLimit, rates: DeviceRates | None, optimizer_states: int = 2,
                 parameters: Callable[[], Iterable[torch.Tensor]] = tuple, over_limit: str = "raise",
                 scheduled: bool = True, offload: OffloadStage | None = None, cap_allocator: bool = True) -> None:
        self.limit, self.rates, self.over_limit = limit, rates, over_limit
        # The limit in bytes, resolved at the first plan and kept ("auto" would move with the cap).
        self.limit_bytes: int | None = None
        self.cap_allocator = cap_allocator
        self.allocator_fraction: float | None = None  # the cap set at the first plan (fit.allocator_cap)
        self.scheduled = scheduled  # the schedule pass orders the backwards (fit.price_rungs)
        self.offload = offload  # the offload pass's stage, where it runs: it prices each rung
        # The optimizer's states per parameter, and the parameters it steps besides FSDP2's (the
        # modules jitted with the transform): the first step's terms (``fit.first_step``).
        self.optimizer_states, self.parameters = optimizer_states, parameters
        self.states_made = False  # an optimizer has stepped since (its states are allocated)
        _watch_optimizer_steps(self)
        self.margin_bytes = 0
        self.replanned = False  # whether a check has asked for the second plan
        self.calls: dict[tuple, int] = {}
        self.choices: dict[tuple, fit.FitChoice] = {}
        self.statics: dict[tuple, int] = {}  # each program's static term, from its first plan
        self.first_steps: dict[tuple, fit.FirstStep] = {}  # and its first step's terms
        self.before: dict[tuple, dict[tuple, int]] = {}  # at each one's first plan, the others' saved per call
        self.device: torch.device | None = None  # the device of the latest program planned
        self.last_check: fit.FitCheck | None = None

    def choose(self, plans: list[recompute.RecomputePlan], forward: TraceCtx, backward: TraceCtx,
               fusion: InductorFusionExecutor | None = None) -> int:
        """The rung of ``plans`` (a ladder of ``forward``, its backward ``backward``, their regions
        taken apart) that the limit takes, recorded in ``choices``; each rung priced as ``fusion``
        fuses it, where it runs."""
        device = torch.device(next(iter(_devices(forward)), "cpu"))
        memory = fit.device_memory(device)
        limit = self._resolve_limit(device, memory)
        rates = self.rates or (measure_rates(device) if memory is not None else fit.NOMINAL_RATES)
        key = self.key(forward)
        first_plan = key not in self.statics
        if first_plan:
            self.first_steps[key] = self._first_step(memory is not None)
            self.calls.setdefault(key, self.first_steps[key].calls)
        # Each rung priced as it is, and, where the offload pass runs with room on the host, as that
        # pass leaves it: the limit takes the fastest that fits, the rung without copies where the
        # times tie.
        share = self._host_bytes_per_call(key) if self._offload_runs(memory is not None) else 0
        offloads = functools.partial(self.offload.plan, rates=rates, host_bytes=share) if share else None
        ways = fit.price_rungs(plans, forward, backward, scheduled=self.scheduled,
                               offloads=(None,) if offloads is None else (None, offloads), fusion=fusion)
        if first_plan:
            # A second plan keeps the first plan's static term: the margin is the measured error of a
            # prediction made with it. Read again at the recompile, it would count twice what was made
            # in between (AdamW's states, after the first optimizer step), which the margin holds.
            plain_default, _ = ways[0][0]
            self.statics[key] = plain_default.forward.input_bytes if memory is None else memory.allocated
            # What each program planned before this one saved per call then: on CUDA in this one's
            # static term, the allocator's bytes; not in the trace's inputs (CPU, meta), where the
            # static term takes them from nothing, over their calls (``_static``).
            earlier = self._saved_per_call()
            self.before[key] = earlier if memory is not None else dict.fromkeys(earlier, 0)
        saved = self._saved_per_call()
        ladders = [fit.rung_costs(plans, priced, rates) for priced in ways]
        choices = [self._choose_rung(key, rungs, limit, saved) for rungs in ladders]
        way = fit.fastest_fitting(choices)
        choice = choices[way]
        if not choice.fits:
            # With the programs planned before this one at their least saved bytes, which a second
            # plan can take (check_fit), a rung may fit: only where none does is the limit refused.
            least = {q: min(r.saved_bytes for r in c.rungs) for q, c in self.choices.items() if q != key}
            lowest = min(min(self._choose_rung(key, rungs, limit, {**saved, **least}).predicted_peaks)
                         for rungs in ladders)
            if lowest > limit and self.over_limit == "raise":
                raise fit.MemoryLimitError(fit.refusal(limit, lowest))
            warnings.warn(f"thunder_memopt: no recompute plan fits memory_limit={limit} bytes; the lowest "
                          f"predicted peak, {choice.predicted_peak_bytes} bytes, is taken")
        if self.offload is not None:
            # The offload pass copies only where the limit took the rung with its copies.
            self.offload.host_bytes = share if way else 0
        self.choices[key] = choice
        self.device = device
        return choice.rung

    def _resolve_limit(self, device: torch.device, memory: fit.DeviceMemory | None) -> int:
        """The limit in bytes, resolved at the first plan; there, on CUDA, with ``cap_allocator``, the
        process's caching allocator is capped at it, so that what it reserves stays under the limit:
        it frees the blocks it caches and retries before it would reserve past the cap. A cap that an
        earlier limit set (another transform's, in the same process) does not bound this limit: this
        one replaces it, or lifts it without ``cap_allocator``."""
        if self.limit_bytes is not None:
            return self.limit_bytes
        key = str(device)
        if memory is not None and memory.cap is not None and memory.cap == _ALLOCATOR_CAPS.get(key):
            memory = dataclasses.replace(memory, cap=None)
            if not self.cap_allocator:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
                del _ALLOCATOR_CAPS[key]
        self.limit_bytes = fit.resolve_memory_limit(self.limit, memory)
        if memory is not None and self.cap_allocator:
            self.allocator_fraction = fit.allocator_cap(self.limit_bytes, memory)
            if self.allocator_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self.allocator_fraction, device)
                _ALLOCATOR_CAPS[key] = round(self.allocator_fraction * memory.total)  # as device_memory reads it
        return self.limit_bytes

    def _choose_rung(self, key: tuple, rungs: list[fit.RungCost], limit: int, saved: dict[tuple, int]
                     ) -> fit.FitChoice:
        """``fit.choose_by_limit`` for program ``key`` where the programs save ``saved`` per call, with
        the peaks of the later programs that hold this one's saved tensors in their static term (a
        loss head after the Blocks) at each of its rungs."""
        later = [p for p in self.choices if p != key and key in self.before[p]]
        others = tuple(max(self._peak(p, {**saved, key: rung.saved_bytes}) for p in later)
                       for rung in rungs) if later else ()
        return fit.choose_by_limit(rungs, self._terms(key, saved), limit, others)

    def _offload_runs(self, on_cuda: bool) -> bool:
        """Whether the offload pass will run on the program planned now: offload on, on CUDA or with
        offload_rates given (``OffloadStage.runs_on_final``)."""
        return self.offload is not None and (on_cuda or self.rates is not None)

    def _first_step(self, allocated_seen: bool) -> fit.FirstStep:
        """The first step's terms for the program compiled now (``fit.first_step``)."""
        units = fit.fsdp2_units(self.parameters())
        # Under FSDP2 the modules' parameters are FSDP2's (or graph inputs, under torch.compile).
        own = {} if units else {id(p): p for p in self.parameters() if p.requires_grad}
        return fit.first_step(units, sum(p.numel() * p.element_size() for p in own.values()),
                              self.optimizer_states, states_made=self.states_made and allocated_seen,
                              allocated_seen=allocated_seen)

    def _terms(self, key: tuple, saved: dict[tuple, int]) -> fit.StepTerms:
        first = self.first_steps[key]
        return fit.StepTerms(self._static(key, saved), self.calls.get(key, 1), self.margin_bytes, first.bytes,
                             first.call_gathered_bytes, first.call_gradient_bytes)

    def _host_bytes_per_call(self, key: tuple) -> int:
        """What one call of program ``key`` may copy to the host: the process's pinned host limit less
        what the other programs' copies take at their rungs, over this one's calls."""
        others = sum(self.calls.get(q, 1) * c.rungs[c.rung].pinned_bytes for q, c in self.choices.items() if q != key)
        return max(0, offload_executor.host_memory_limit() - others) // self.calls.get(key, 1)

    def _saved_per_call(self) -> dict[tuple, int]:
        """What each program planned so far saves per call at its rung."""
        return {key: c.rungs[c.rung].saved_bytes for key, c in self.choices.items()}

    def _static(self, key: tuple, saved: dict[tuple, int]) -> int:
        """Program ``key``'s static term where each program saves ``saved`` per call: its first plan's,
        with the change in what the programs planned before it save, over their calls."""
        return self.statics[key] + sum(self.calls.get(q, 1) * (saved[q] - before)
                                       for q, before in self.before[key].items() if q in saved and q != key)

    def _peak(self, key: tuple, saved: dict[tuple, int]) -> int:
        """Program ``key``'s predicted whole-step peak at its rung, where each program saves ``saved``."""
        choice = self.choices[key]
        return self._terms(key, saved).peak(choice.rungs[choice.rung])

    @staticmethod
    def key(forward: TraceCtx) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """A program's key: the name, shape and dtype of each tensor Thunder's forward saves."""
        return tuple((t.name, tuple(t.shape), str(t.dtype)) for t in saved_proxies(forward)[0])

    def report(self) -> fit.FitReport | None:
        return fit.FitReport(tuple(self.choices.values()), self.last_check,
                             self.allocator_fraction) if self.choices else None

    def check(self, measured_bytes: int, calls: dict[tuple, int]) -> fit.FitCheck:
        """``measured_bytes``, a step's peak, against the prediction with each program's ``calls`` per
        step as counted (``fit.check_fit``); where it asks for the second plan, the margin it takes."""
        self.calls.update(calls)
        saved = self._saved_per_call()
        predicted = max(self._peak(key, saved) for key in self.choices)
        check = fit.check_fit(predicted, measured_bytes, self.report().limit_bytes,
                              margin_bytes=self.margin_bytes, replanned=self.replanned)
        if check.replan:
            self.margin_bytes, self.replanned = check.margin_bytes, True
        self.last_check = check
        return check


def _watch_optimizer_steps(planner: FitPlanner) -> None:
    """``planner.states_made`` set at the first step of any optimizer (a global post-hook of
    torch.optim, removed with the planner: not from inside the hook, while torch iterates them)."""
    ref = weakref.ref(planner)

    def hook(*_: Any) -> None:
        if (planner := ref()) is not None:
            planner.states_made = True

    weakref.finalize(planner, register_optimizer_step_post_hook(hook).remove)


class RecomputeStage(Stage):
    """Plans the recompute ladder on the forward, its regions taken apart, and applies the default
    rung; in the backward, picks the rung by the budget, or by the memory limit (``fit``)."""

    name = "recompute"

    def __init__(self, budget: float, fit_planner: FitPlanner | None = None) -> None:
        self.budget, self.fit = budget, fit_planner

    def forward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, _Ladder]:
        flat = trace if pair.fusion is None else pair.fusion.unfuse(trace)
        # With fusion, saved views are replayed from their bases so that regions stay whole.
        steps = 0 if self.budget == 1.0 and self.fit is None else _LADDER_STEPS
        ladder = recompute.plan_ladder(flat, steps=steps, replay_saved_views=pair.fusion is not None)
        return ladder[0].apply_to_forward(flat), _Ladder(given=trace, original=flat, plans=ladder)

    def runs_backward(self, pair: Pair) -> bool:
        return self.name in pair.carries

    def backward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx | None]:
        ladder = pair.carries[self.name]
        flat = trace if pair.fusion is None else pair.fusion.unfuse(trace)
        if self.fit is not None:
            k = self.fit.choose(ladder.plans, ladder.original, flat, pair.fusion)
        elif len(ladder.plans) > 1:
            k = recompute.choose_by_budget(ladder.plans, ladder.original, flat, self.budget)
        else:
            k = 0
        if not k:
            return flat, None
        pair.carries[self.name] = dataclasses.replace(ladder, rung=k)
        return flat, ladder.plans[k].apply_to_forward(ladder.original)


class FusionStage(Stage):
    """Makes the recompute rung the forward, fused as the fusion executor fuses it with its replays,
    and replays it in the backward (``fuse_forward``); the backward fused again."""

    name = "fusion"
    kept = "this trace as Thunder fused it, without recompute"

    def runs_forward(self, pair: Pair) -> bool:
        return RecomputeStage.name in pair.carries

    def forward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, recompute.RecomputePlan]:
        ladder = pair.carries[RecomputeStage.name]
        return fuse_forward(trace, ladder.plans[ladder.rung], pair.fusion)

    def fall_back(self, trace: TraceCtx, pair: Pair) -> TraceCtx:
        return pair.carries.pop(RecomputeStage.name).given

    def runs_backward(self, pair: Pair) -> bool:
        return self.name in pair.carries

    def backward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, None]:
        backward = pair.carries[self.name].apply_to_backward(trace)
        return (backward if pair.fusion is None else pair.fusion.refuse(backward)), None


class CollectivesStage(Stage):
    """``collectives.CollectivesPass``; the carry is the ZeRO-3 plan that the backward re-gathers."""

    name = "collectives"

    def __init__(self, prefetch: int, zero3: bool | None) -> None:
        self._pass = collectives.CollectivesPass(prefetch=prefetch, zero3=zero3)

    def forward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, collectives.Zero3Plan | None]:
        return self._pass.forward(trace)

    def backward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, None]:
        return self._pass.backward(trace, pair.carries.get(self.name)), None


class ScheduleStage(Stage):
    """``schedule.schedule_trace`` on each trace; ``results`` holds the latest function's. Reordering
    keeps a trace's inputs and outputs, so either trace of a pair may fall back."""

    name = "schedule"
    on_inference = True

    def __init__(self) -> None:
        self.results: list[schedule.ScheduleResult] = []

    def forward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, None]:
        # A forward starts the results anew: one instance serves every dynamo subgraph, and a
        # budget's rung replaces the default rung's forward.
        self.results = []
        return self._kept(schedule.schedule_trace(trace)), None

    def backward(self, trace: TraceCtx, pair: Pair) -> tuple[TraceCtx, None]:
        # The forward handed back (its symbols replaced if a budget chose another rung) tells which
        # saved tensors share a storage.
        known = None if pair.returned is None else backward_storages(pair.returned, trace)
        return self._kept(schedule.schedule_trace(trace, known)), None

    def _kept(self, result: schedule.ScheduleResult) -> TraceCtx:
        self.results.append(result)
        return result.trace


class OffloadStage(Stage):
    """``offload.plan_offload`` and ``apply_offload`` on the final pair; ``plans`` holds every plan."""

    name = "offload"
    kept = "the saved tensors on the device"

    def __init__(self, mode: offload_module.OffloadMode, budget: float, rates: DeviceRates | None) -> None:
        self.mode, self.budget, self.rates = mode, budget, rates
        # What one call of the program compiled now may copy to the host: the fit's share of the
        # pinned host limit where it took a rung with copies, else 0, set where it chooses this
        # program's rung (Thunder transforms a program's forward, backward and final pair in one
        # compile); None without memory_limit.
        self.host_bytes: int | None = None
        self.plans: list[offload_module.OffloadPlan] = []
        self._warned_on_cpu = False

    def runs_forward(self, pair: Pair) -> bool:
        return False

    def runs_backward(self, pair: Pair) -> bool:
        return False

    def runs_on_final(self, pair: Pair) -> bool:
        if self.rates is not None or _cuda_devices(pair.returned):
            return True
        if not self._warned_on_cpu:
            self._warned_on_cpu = True
            warnings.warn("thunder_memopt: offload is off on CPU (no pinned host memory to copy to); "
                          "pass offload_rates to plan and run it with CPU copies")
        return False

    def plan(self, forward: TraceCtx, backward: TraceCtx, rates: DeviceRates,
             host_bytes: int | None = None) -> offload_module.OffloadPlan:
        """What this pass offloads of the pair, at ``rates``, copying at most ``host_bytes`` (the fit
        prices each rung with it, at the program's share of the host)."""
        return offload_module.plan_offload(forward, backward, mode=self.mode, budget=self.budget, rates=rates,
                                           host_bytes=host_bytes)

    def on_final(self, forward: TraceCtx, backward: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx]:
        # Measured once, here, inside the guard: it allocates on the device.
        rates = self.rates or measure_rates(torch.device(_cuda_devices(forward)[0]))
        plan = self.plan(forward, backward, rates, self.host_bytes)
        forward, backward = offload_module.apply_offload(forward, backward, plan)
        self.plans.append(plan)
        return forward, backward


class DonationStage(Stage):
    """``donate.donate_buffers`` on the final pair: the forward's regions, then the backward's, which
    may also take the saved tensors that only the backward holds; ``donated`` counts the outputs."""

    name = "donate"
    kept = "every region output in memory of its own"

    def __init__(self) -> None:
        self.donated = 0

    def runs_forward(self, pair: Pair) -> bool:
        return False

    def runs_backward(self, pair: Pair) -> bool:
        return False

    def runs_on_final(self, pair: Pair) -> bool:
        return pair.fusion is not None

    def on_final(self, forward: TraceCtx, backward: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx]:
        forward, in_forward = donate.donate_buffers(forward, pair.fusion)
        backward, in_backward = donate.donate_buffers(backward, pair.fusion,
                                                      donatable_received=donate.donatable_saved(forward),
                                                      received_strides=simulated_strides(forward))
        self.donated += in_forward + in_backward
        return forward, backward


class UnmadeGradientStage(Stage):
    """The loss-head pass on the final pair: the forward's outputs whose gradient the backward reads
    in the fused head alone marked, so that an unused one's is never made
    (``loss_head.unused_logits_gradients_unmade``)."""

    name = "loss_head"
    kept = "the gradient of unused logits made, as zeros"

    def runs_forward(self, pair: Pair) -> bool:
        return False

    def runs_backward(self, pair: Pair) -> bool:
        return False

    def runs_on_final(self, pair: Pair) -> bool:
        return True

    def on_final(self, forward: TraceCtx, backward: TraceCtx, pair: Pair) -> tuple[TraceCtx, TraceCtx]:
        return loss_head.unused_logits_gradients_unmade(forward, backward), backward


Phase = Literal["forward", "rerun", "backward", "final"]


def may_fall_back(stage: Stage, pair: Pair, phase: Phase) -> bool:
    """Whether ``stage`` falls back with one warning when it raises (``MemoryOptimization._guarded``),
    or raises: the one place for the exceptions. A forward, and the hook on the final pair, always
    fall back.

    In the backward's hook the forward is already handed back to Thunder. A stage whose forward
    left a carry (recompute's plans, fusion's replays, a ZeRO-3 plan) made it save what the carry
    says, so that stage's backward must follow it or fail: a fallback would leave the pair
    inconsistent. When a budget picks another rung, the later stages' forwards run again and fall
    back as a forward's do, but fusion: the backward is already taken apart for that rung, so its
    forward cannot fall back to Thunder's, without recompute."""
    if phase == "rerun":
        return stage.name != FusionStage.name
    return phase != "backward" or stage.name not in pair.carries


def fuse_forward(
    forward: TraceCtx, plan: recompute.RecomputePlan, fusion: InductorFusionExecutor | None
) -> tuple[TraceCtx, recompute.RecomputePlan]:
    """The forward, and the plan as the backward replays it: with the fusion executor, the forward
    fused again with the replayed ops in regions of their own, which the backward replays
    (``InductorFusionExecutor.fuse_with_replays``)."""
    return (forward, plan) if fusion is None else fusion.fuse_with_replays(forward, plan)


def _devices(forward: TraceCtx) -> list[str]:
    """The devices of the tensors ``forward`` saves, sorted (CUDA's before CPU's)."""
    devices = {t.device.device_str() for t in saved_proxies(forward)[0]}
    return sorted(devices, key=lambda d: (not d.startswith("cuda"), d))


def _cuda_devices(forward: TraceCtx) -> list[str]:
    """The CUDA devices of the tensors ``forward`` saves, sorted."""
    return [d for d in _devices(forward) if d.startswith("cuda")]
