"""``MemoryOptimization``: the thunder.Transform that wires thunder_memopt's passes in order.

Before Thunder's autodiff, the computation trace goes through one pass:

0. ``loss_head``: where ``linear_cross_entropy_ex`` is in the executor list, each
   ``linear -> cross_entropy`` becomes the fused loss head, which never holds the logits
   (thunder_memopt.passes.loss_head).

Thunder then hands every transform the forward trace and the backward trace of each compiled
function, after its own optimization and ``del_last_used``. The other passes run there, in order:

1. ``recompute``: choose, by a min-cut over real tensor bytes, what the forward saves for backward,
   and recompute the rest in the backward (thunder_memopt.passes.recompute). Where thunder_memopt's fusion
   executor is in the executor list, the pass takes its regions apart first, so that it cuts
   between ops rather than regions, and fuses again after (thunder_memopt.executors.fusion): the
   replayed ops in regions of their own, which the backward replays whole, so that replayed values
   are the forward's bit for bit.
2. ``collectives``: for thunder fsdp, just-in-time all-gathers, ZeRO-3 re-gathers in backward and
   early reduce-scatters (thunder_memopt.passes.collectives).
3. ``schedule``: reorder each trace (inference traces too) to lower its peak of live bytes
   (thunder_memopt.passes.schedule); the latest function's results are kept in ``schedule_results``. It runs
   after the collectives so that it prices the frees that pass made early, and it keeps the
   collectives where that pass put them.
4. ``offload`` (when the ``offload`` option is not "off"): once both traces of a pair are final,
   copy saved tensors to host memory in the forward and reload them in the backward
   (thunder_memopt.passes.offload); its plans are kept in ``offload_plans``.

Once the backward's passes have run, both traces of the pair are final, and their fusion regions
are compiled together, ahead of their first calls (thunder_memopt.executors.fusion.compile_ahead).

The forward decides what the backward must recompute and re-gather, so what a forward leaves for
its backward (the recompute plans, the ZeRO-3 plan, the forward handed back) is one record, keyed by
the tensors Thunder's forward saves, which are the backward's inputs; ThunderCompiler shares one
transform instance across all its subgraphs, and the key keeps their forward/backward pairs apart.
"""

from __future__ import annotations

import contextlib
import gc
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform

from thunder_memopt.core.cost import DeviceRates, measure_rates
from thunder_memopt.core.memory import backward_storages
from thunder_memopt.core.trace import saved_proxies
from thunder_memopt.executors.chunked_cross_entropy import linear_cross_entropy_ex
from thunder_memopt.executors.fusion import InductorFusionExecutor, compile_ahead
from thunder_memopt.passes import collectives, loss_head, recompute, schedule
from thunder_memopt.passes import offload as offload_module

__all__ = ["MemoryOptimization", "PASSES"]

_T = TypeVar("_T")

# Rungs between the default plan and the most recompute, for budgets below 1.0.
_LADDER_STEPS = 8


@dataclass(frozen=True)
class _Recompute:
    """A forward's recompute plans, for its backward to pick one by the budget."""

    original: TraceCtx  # the forward as Thunder handed it, its fusion regions taken apart
    plans: list[recompute.RecomputePlan]  # the default first
    fused: recompute.RecomputePlan  # plans[0] as the backward replays it: the forward's replay regions
    fusion: InductorFusionExecutor | None  # the fusion executor in the executor list


@dataclass
class _Pair:
    """What a forward leaves for its backward. ``MemoryOptimization`` keeps one per forward, keyed by
    the tensors Thunder's forward saves, which are the inputs of the backward Thunder hands over
    next; ThunderCompiler shares one transform instance across all its subgraphs."""

    returned: TraceCtx  # the forward handed back to Thunder
    recompute: _Recompute | None = None
    zero3: collectives.Zero3Plan | None = None  # the backward re-gathers what the forward saved sharded

    def replace_forward(self, trace: TraceCtx) -> None:
        """The forward handed back to Thunder changed in place to ``trace``'s symbols, from the
        backward's hook (a budget's rung, the offloads). Thunder compiles the forward trace only
        after that hook returns: it calls every transform on the forward, then on the backward, then
        builds both callables (tests/test_recompute.py checks that the forward that runs saves what
        the changed trace says)."""
        self.returned.bound_symbols = trace.bound_symbols
        self.returned.scopes = [self.returned.bound_symbols]


PASSES = ("loss_head", "recompute", "collectives", "schedule")


class MemoryOptimization(Transform):
    """Lower the activation memory of Thunder training steps.

    Args:
        activation_budget: in [0, 1], like torch's ``activation_memory_budget``. 1.0 saves what the
            cheapest-bytes cut over cheap ops (elementwise, casts, views, norms, activations,
            rotary) leaves. Lower values also recompute matmuls and attention, cheapest FLOPs
            first, on a ladder that ends at per-block checkpointing; the budget sets a target
            between the default's estimated peak (1.0) and the lowest on the ladder (0.0), and the
            least recompute that meets it is taken, so the peak never rises as the budget falls.
        passes: which passes run, a subset of ``PASSES``.
        prefetch: all-gathers issued ahead of the one being waited on (thunder fsdp).
        zero3: save shards and re-gather in backward; None detects ``FSDPType.ZERO3``.
        offload: copy saved tensors to pinned host memory in the forward and back in the backward
            (thunder_memopt.passes.offload), on CUDA: "off"; "auto", only the copies that the cost
            model finds hidden behind compute; "budget", also enough of the rest, largest first,
            that at most ``activation_budget`` of the saved bytes stay on the GPU.
        offload_rates: the device rates the offload plan is made for; None measures them once on
            the GPU (``core.cost.measure_rates``). Given, offload also runs on a CPU, copying to a
            second CPU buffer (for tests).

    Fusion is a choice of executors, not of this transform: with ``thunder_memopt.executors()`` the
    replays run in the forward's compiled regions and the loss head is fused; with Thunder's
    executors alone (or ``executors(fusion=False)``) every op runs as in plain Thunder, bit for bit.
    """

    def __init__(
        self,
        *,
        activation_budget: float = 1.0,
        passes: Sequence[str] = PASSES,
        prefetch: int = 2,
        zero3: bool | None = None,
        offload: str = "off",
        offload_rates: DeviceRates | None = None,
    ) -> None:
        if isinstance(activation_budget, bool) or not isinstance(activation_budget, numbers.Real):
            raise TypeError(f"activation_budget must be a number in [0, 1], got {activation_budget!r}")
        if not 0.0 <= float(activation_budget) <= 1.0:
            raise ValueError(f"activation_budget must be in [0, 1], got {activation_budget}")
        if isinstance(passes, str) or not isinstance(passes, Iterable):
            raise TypeError(f"passes must be a sequence of pass names from {list(PASSES)}, got {passes!r}")
        passes = tuple(passes)
        if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0:
            raise TypeError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if zero3 is not None and not isinstance(zero3, bool):
            raise TypeError(f"zero3 must be None, True or False, got {zero3!r}")
        modes = [m.value for m in offload_module.OffloadMode]
        if offload not in modes:
            raise ValueError(f"offload must be one of {modes}, got {offload!r}")
        if offload_rates is not None and not isinstance(offload_rates, DeviceRates):
            raise TypeError(f"offload_rates must be a thunder_memopt.core.cost.DeviceRates, got {offload_rates!r}")
        unknown = [p for p in passes if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown pass names {unknown}; known passes are {list(PASSES)}")
        self.activation_budget = float(activation_budget)
        self.passes = tuple(p for p in PASSES if p in passes)
        self._pairs: dict[tuple[str, ...], _Pair] = {}
        self._collectives = collectives.CollectivesPass(prefetch=prefetch, zero3=zero3)
        self.schedule_results: list[schedule.ScheduleResult] = []
        self.offload = offload_module.OffloadMode(offload)
        self.offload_rates = offload_rates
        self.offload_plans: list[offload_module.OffloadPlan] = []
        self._offload_on_cpu_warned = False
        # Seconds spent in each pass over every trace this instance has seen (compile-time cost).
        self.pass_seconds: dict[str, float] = {}

    def __repr__(self) -> str:
        return (
            f"MemoryOptimization(activation_budget={self.activation_budget}, passes={self.passes}, "
            f"offload={self.offload.value!r})"
        )

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        if "loss_head" in self.passes and linear_cross_entropy_ex in kwargs.get("executors_list", ()):
            # At budget 1.0 (time first) the head computes its gradients in the forward, one matmul
            # less; below it, it recomputes its logits in the backward, the least memory.
            in_forward = self.activation_budget == 1.0
            fused = self._guarded("loss_head", "the loss unfused",
                                  lambda: loss_head.fuse_loss_heads(computation_trace, gradients_in_forward=in_forward))
            if fused is not None:
                computation_trace = fused
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        with _cyclic_gc_paused():
            return self._transform(computation_trace, kwargs.get("executors_list", ()))

    def _transform(self, computation_trace: TraceCtx, executors_list: Sequence) -> TraceCtx:
        if TraceTag.BACKWARD not in computation_trace.tags:
            # Keep only the latest function's results: one instance serves every dynamo subgraph.
            self.schedule_results = []
        if TraceTag.AUGMENTED_FORWARD in computation_trace.tags:
            return self._forward(computation_trace, _fusion_executor(executors_list))
        if TraceTag.BACKWARD in computation_trace.tags:
            pair = self._pairs.pop(tuple(t.name for t in computation_trace.args[0][0]), None)
            backward = self._backward(computation_trace, pair)
            if pair is not None:
                backward = self._offload(pair, backward)
            # Thunder builds both callables after this hook: the pair's regions are final here.
            self._compile_ahead([backward] if pair is None else [pair.returned, backward])
            return backward
        return self._schedule(computation_trace)

    def _forward(self, trace: TraceCtx, fusion: InductorFusionExecutor | None) -> TraceCtx:
        key = tuple(t.name for t in saved_proxies(trace)[0])
        fused = planned = None
        if "recompute" in self.passes:
            flat = trace if fusion is None else fusion.unfuse(trace)

            def plan_and_apply() -> tuple[list[recompute.RecomputePlan], TraceCtx]:
                # With fusion, saved views are replayed from their bases so that regions stay whole.
                ladder = recompute.plan_ladder(flat, steps=0 if self.activation_budget == 1.0 else _LADDER_STEPS,
                                               replay_saved_views=fusion is not None)
                return ladder, ladder[0].apply_to_forward(flat)

            planned = self._guarded("recompute", "this trace unchanged", plan_and_apply)
            if planned is not None:
                fused = self._guarded("fusion", "this trace as Thunder fused it, without recompute",
                                      lambda: _fuse_forward(planned[1], planned[0][0], fusion))
        out, zero3 = self._after_recompute_forward(trace if fused is None else fused[0])
        pending = None if fused is None else _Recompute(original=flat, plans=planned[0], fused=fused[1], fusion=fusion)
        self._pairs[key] = _Pair(returned=out, recompute=pending, zero3=zero3)
        return out

    def _backward(self, trace: TraceCtx, pair: _Pair | None) -> TraceCtx:
        pending = None if pair is None else pair.recompute
        if pending is None:
            return self._after_recompute_backward(trace, pair)
        # The forward was already changed; failing here would leave the pair inconsistent, so any
        # mismatch is an error rather than a silent fallback.
        fusion = pending.fusion
        flat = trace if fusion is None else fusion.unfuse(trace)
        k, plan = 0, pending.fused
        if len(pending.plans) > 1:
            with self._timed("recompute"):
                k, forward = recompute.choose_by_budget(pending.plans, pending.original, flat, self.activation_budget)
        if k:
            # The forward handed back earlier takes the chosen rung; its schedule result replaces
            # the default rung's.
            self.schedule_results = []
            with self._timed("fusion"):
                fused, plan = _fuse_forward(forward, pending.plans[k], fusion)
            chosen, pair.zero3 = self._after_recompute_forward(fused)
            pair.replace_forward(chosen)
        with self._timed("recompute"):
            backward = plan.apply_to_backward(flat)
        if fusion is not None:
            with self._timed("fusion"):
                backward = fusion.refuse(backward)
        return self._after_recompute_backward(backward, pair)

    def _after_recompute_forward(self, trace: TraceCtx) -> tuple[TraceCtx, collectives.Zero3Plan | None]:
        trace, zero3 = self._collectives_forward(trace)
        return self._schedule(trace), zero3

    def _after_recompute_backward(self, trace: TraceCtx, pair: _Pair | None) -> TraceCtx:
        # The forward handed back (its bound symbols replaced if a budget chose another rung)
        # tells which saved tensors share a storage.
        trace = self._collectives_backward(trace, None if pair is None else pair.zero3)
        return self._schedule(trace, None if pair is None else pair.returned)

    def _schedule(self, trace: TraceCtx, forward: TraceCtx | None = None) -> TraceCtx:
        if "schedule" not in self.passes:
            return trace

        def scheduled() -> schedule.ScheduleResult:
            known = None if forward is None else backward_storages(forward, trace)
            return schedule.schedule_trace(trace, known)

        # Reordering keeps a trace's inputs and outputs, so either trace of a pair may fall back.
        result = self._guarded("schedule", "this trace unchanged", scheduled)
        if result is None:
            return trace
        self.schedule_results.append(result)
        return result.trace

    def _collectives_forward(self, trace: TraceCtx) -> tuple[TraceCtx, collectives.Zero3Plan | None]:
        if "collectives" not in self.passes:
            return trace, None
        gathered = self._guarded("collectives", "this trace unchanged", lambda: self._collectives.forward(trace))
        return (trace, None) if gathered is None else gathered

    def _collectives_backward(self, trace: TraceCtx, zero3: collectives.Zero3Plan | None) -> TraceCtx:
        if "collectives" not in self.passes:
            return trace
        if zero3 is not None:
            # Not guarded: the forward already saves shards for this plan, so the backward must
            # re-gather them or fail; a fallback would leave the pair inconsistent.
            with self._timed("collectives"):
                return self._collectives.backward(trace, zero3)
        scheduled = self._guarded("collectives", "this trace unchanged", lambda: self._collectives.backward(trace, None))
        return trace if scheduled is None else scheduled

    def _offload(self, pair: _Pair, backward: TraceCtx) -> TraceCtx:
        """The pair's saved tensors offloaded (passes.offload): its backward returned, its forward
        replaced as for a budget's rung (``_Pair.replace_forward``)."""
        if self.offload is offload_module.OffloadMode.OFF:
            return backward
        cuda = sorted({d for t in saved_proxies(pair.returned)[0] if (d := t.device.device_str()).startswith("cuda")})
        if self.offload_rates is None and not cuda:
            if not self._offload_on_cpu_warned:
                self._offload_on_cpu_warned = True
                warnings.warn("thunder_memopt: offload is off on CPU (no pinned host memory to copy to); "
                              "pass offload_rates to plan and run it with CPU copies")
            return backward

        def offloaded() -> tuple[offload_module.OffloadPlan, TraceCtx, TraceCtx]:
            # Measured once, here, inside the guard: it allocates on the device.
            rates = self.offload_rates or measure_rates(torch.device(cuda[0]))
            plan = offload_module.plan_offload(pair.returned, backward, mode=self.offload,
                                               budget=self.activation_budget, rates=rates)
            return plan, *offload_module.apply_offload(pair.returned, backward, plan)

        done = self._guarded("offload", "the saved tensors on the device", offloaded)
        if done is None:
            return backward
        plan, forward, backward = done
        pair.replace_forward(forward)
        self.offload_plans.append(plan)
        return backward

    def _compile_ahead(self, traces: Sequence[TraceCtx]) -> None:
        """The fusion regions of ``traces`` compiled now, together (``executors.fusion.compile_ahead``).
        Not timed as a pass: the seconds go to ``compile_stats()``, as a first call's would."""
        try:
            compile_ahead(traces)
        except Exception as e:
            warnings.warn(f"thunder_memopt: fusion regions left to compile at their first calls "
                          f"({type(e).__name__}: {e})")

    def _guarded(self, name: str, kept: str, run: Callable[[], _T]) -> _T | None:
        """``run()``, timed as pass ``name``; None and one warning if it raises, so that a pass never
        breaks a user's training and the caller keeps what it had (``kept`` says what, in the warning)."""
        try:
            with self._timed(name):
                return run()
        except Exception as e:
            warnings.warn(f"thunder_memopt: {name} left {kept} ({type(e).__name__}: {e})")
            return None

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.pass_seconds[name] = self.pass_seconds.get(name, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused, as torch.distributed.checkpoint does around its
    state-dict walks. The passes make tens of thousands of graph, trace and proxy objects, enough to
    set off full collections, each of which walks every object of the process (the model's traces:
    about 1.5 s per pass at 32 layers) to free almost nothing: what the passes drop, reference
    counting frees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _fusion_executor(executors_list: Sequence) -> InductorFusionExecutor | None:
    return next((ex for ex in executors_list if isinstance(ex, InductorFusionExecutor)), None)


def _fuse_forward(
    forward: TraceCtx, plan: recompute.RecomputePlan, fusion: InductorFusionExecutor | None
) -> tuple[TraceCtx, recompute.RecomputePlan]:
    """The forward, and the plan as the backward replays it: with the fusion executor, the forward
    fused again with the replayed ops in regions of their own, which the backward replays
    (``InductorFusionExecutor.fuse_with_replays``)."""
    return (forward, plan) if fusion is None else fusion.fuse_with_replays(forward, plan)
