"""``MemoryOptimization``: the thunder.Transform that wires thunder_memopt's passes in order.

Before Thunder's autodiff, the computation trace goes through three passes, in order:

- ``causal_mask``: where ``cudnn_attention_ex`` is in the executor list, each attention whose mask
  the ops that make it prove causal is called with ``is_causal=True`` and no mask, so that a fast
  kernel takes it (thunder_memopt.passes.causal_mask).
- ``masked_rows``: each attention whose mask may hide every key from a query (padding) gives that
  query zeros, as torch's SDPA does, where Thunder's decomposition gives NaN
  (thunder_memopt.passes.masked_rows).
- ``loss_head``: where ``linear_cross_entropy_ex`` is in the executor list, each
  ``linear -> cross_entropy`` becomes the fused loss head, which never holds the logits (where the
  model also returns them, as transformers' models do, never their fp32 copy, log-softmax or
  gradient) (thunder_memopt.passes.loss_head).

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
5. ``donate``: once both traces of a pair are final, each fusion region writes an output
   into the memory of an input that dies there, a saved tensor that only the backward holds among
   them (thunder_memopt.passes.donate); ``donated_outputs`` counts them.
6. ``loss_head`` again, last: the forward marks each output whose gradient the backward reads in the
   fused head alone (a model's returned logits), so that where the caller leaves it unused, that
   gradient is never made (thunder_memopt.executors.unmade_gradients).

Once the backward's passes have run, both traces of the pair are final, and their fusion regions
are compiled together, ahead of their first calls (thunder_memopt.executors.fusion.compile_ahead).

Each of these passes is one or more stages (thunder_memopt.stages: ``Stage``, recompute's two: ``recompute`` plans,
``fusion`` makes the plan the forward) with one interface: a forward (the forward trace in, the
forward and a carry for its backward out), a backward (the backward in, the backward out, and the
forward that replaces the one handed back, if any), and a hook once both traces are final. The
transform runs the stages in the order of ``PASSES``, times each under its name (``pass_seconds``)
and guards each (``_guarded``): a stage that raises leaves the trace as it was (``Stage.fall_back``),
with one warning. The exceptions, where the forward handed back to Thunder already depends on a
stage, are ``may_fall_back``'s. When a budget picks another recompute rung, the later stages'
forwards run again on it, and it replaces the forward handed back (``Pair.replace_forward``).

With ``memory_limit``, the recompute stage's backward takes the rung by the limit on the whole
step's predicted peak instead of by the budget (thunder_memopt.passes.fit, ``stages.FitPlanner``);
``check_fit`` compares a step's measured peak, and the first time it is over the limit, clears the
caches of the modules jitted with the instance (Thunder hands each to ``transform_module``), so
that their next calls compile and plan again with the error as the margin.

The forward decides what the backward must recompute and re-gather, so what a forward leaves for
its backward (the stages' carries, the forward handed back) is one record, keyed by the tensors
Thunder's forward saves, which are the backward's inputs; ThunderCompiler shares one transform
instance across all its subgraphs, and the key keeps their forward/backward pairs apart.
"""

from __future__ import annotations

import contextlib
import gc
import numbers
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import thunder
import torch
from thunder.core.module import ThunderModule
from thunder.core.trace import TraceCtx, TraceTag
from thunder.core.transform_common import Transform

from thunder_memopt.core.cost import DeviceRates
from thunder_memopt.core.trace import saved_proxies
from thunder_memopt.executors.chunked_cross_entropy import linear_cross_entropy_ex
from thunder_memopt.executors.cudnn_attention import cudnn_attention_ex
from thunder_memopt.executors.fusion import InductorFusionExecutor, compile_ahead
from thunder_memopt.executors.offload import HostMemoryLimit, check_host_memory_limit, set_host_memory_limit
from thunder_memopt.passes import causal_mask, collectives, fit, loss_head, masked_rows, schedule
from thunder_memopt.passes import offload as offload_module
from thunder_memopt.stages import (
    CollectivesStage,
    DonationStage,
    FitPlanner,
    FusionStage,
    OffloadStage,
    Pair,
    Phase,
    RecomputeStage,
    ScheduleStage,
    Stage,
    UnmadeGradientStage,
    may_fall_back,
)

__all__ = ["MemoryOptimization", "PASSES", "HEAD_GRADIENTS"]

_T = TypeVar("_T")

PASSES = ("causal_mask", "masked_rows", "loss_head", "recompute", "collectives", "schedule", "donate")
# Where the fused loss head computes its gradients (MemoryOptimization's head_gradients).
HEAD_GRADIENTS = ("forward", "backward")


def _check_fraction(name: str, value: object) -> None:
    """A budget must be a real number in [0, 1]: a TypeError or ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1], got {value!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


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
            that at most ``offload_budget`` of the saved bytes stay on the GPU. With offload the
            fused loss head recomputes its logits in the backward at any budget (memory first).
        offload_budget: in [0, 1], with ``offload="budget"``: the share of the saved bytes that may
            stay on the GPU; None takes ``activation_budget``. Apart from it, recompute and offload
            divide the work: ``activation_budget=1.0, offload_budget=0.5`` recomputes only cheap ops
            and copies to the host what it must for half the saved bytes to leave the GPU.
        offload_rates: the device rates the offload plan is made for; None measures them once on
            the GPU (``core.cost.measure_rates``). Given, offload also runs on a CPU, copying to a
            second CPU buffer (for tests).
        host_memory_limit: the pinned host memory offload may hold in the process: bytes, or "auto",
            ``executors.offload.AUTO_HOST_FRACTION`` of the host's available memory over the ranks
            that share it (``LOCAL_WORLD_SIZE``). A saved tensor whose copy would pass it stays on
            the device (the same values), with one warning per process
            (thunder_memopt.executors.offload).
        head_gradients: where the fused loss head computes its gradients. "forward": in the forward,
            one matmul less, through a tokens x vocabulary buffer at the end of the forward, where
            every layer's saved tensors are alive (2 GiB for Llama-3's vocabulary at T=8192), or
            where the model also returns its logits, from slices of them (no buffer more);
            "backward": it recomputes its logits in the backward, in chunks, and holds nothing of
            that size. None: "forward" at ``activation_budget=1.0`` without offload or a memory limit,
            else "backward".
        memory_limit: the memory the whole step may take, instead of a budget: bytes (an int, or a
            float above 1 that is a whole number: ``40e9``), a fraction of the CUDA device's total
            memory (a float in (0, 1]) or "auto" (what the process could allocate at the first
            compile, less ``fit.AUTO_MARGIN`` of the device's memory); kept as bytes (an int), a
            fraction or "auto".
            Each program takes the rung of the recompute ladder with the least modelled recompute
            time whose predicted whole-step peak is under it (thunder_memopt.passes.fit);
            ``check_fit`` after a step compares the measured peak, and plans once more where it is
            over. It chooses what ``activation_budget`` would, so a budget below 1.0 with it is a
            ValueError; offload, where asked for, runs on the rung it chose.
        optimizer_states: with ``memory_limit``, the tensors the optimizer keeps per parameter,
            each of the parameter's (under FSDP2, its local shard's) size and dtype, made at its
            first step: 2 for Adam and AdamW, 1 for SGD with momentum, 0 for none. Counted in the
            first plan of the programs compiled before any optimizer's first step (on CPU, always).
        over_limit: with ``memory_limit``, what a limit that no recompute plan fits does (even with
            the programs planned before at their least saved bytes): "raise", a
            ``fit.MemoryLimitError`` of one line at the compile, before the first step runs, with the
            lowest predicted peak and what to change; "lowest", the lowest plan, with one warning.
        cap_allocator: with ``memory_limit`` on CUDA, cap the process's caching allocator at the limit
            at the first compile (``torch.cuda.set_per_process_memory_fraction(limit / total)``),
            where no lower cap is set. The allocator then frees the blocks it caches before it
            reserves past the limit, so the memory the card holds for the process stays under it,
            and a step that needs more fails as it would on a card of that size. The cap stays set in
            the process; the next memory limit in it replaces a cap a limit set (with False, lifts
            it). False: the limit bounds the allocated bytes alone, and the allocator may reserve more.

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
        offload_budget: float | None = None,
        offload_rates: DeviceRates | None = None,
        host_memory_limit: HostMemoryLimit = "auto",
        head_gradients: str | None = None,
        memory_limit: fit.MemoryLimit | None = None,
        optimizer_states: int = 2,
        over_limit: str = "raise",
        cap_allocator: bool = True,
    ) -> None:
        _check_fraction("activation_budget", activation_budget)
        memory_limit = fit.checked_memory_limit(memory_limit)
        if isinstance(optimizer_states, bool) or not isinstance(optimizer_states, numbers.Integral) \
                or optimizer_states < 0:
            raise ValueError(f"optimizer_states must be an int >= 0 (AdamW: 2), got {optimizer_states!r}")
        over_limit = fit.checked_over_limit(over_limit)
        if memory_limit is None and over_limit != "raise":
            raise ValueError(f"over_limit={over_limit!r} applies to memory_limit, and none is given")
        if not isinstance(cap_allocator, bool):
            raise TypeError(f"cap_allocator must be True or False, got {cap_allocator!r}")
        if memory_limit is None and not cap_allocator:
            raise ValueError("cap_allocator=False applies to memory_limit, and none is given")
        if memory_limit is not None and activation_budget != 1.0:
            raise ValueError(f"memory_limit and activation_budget={activation_budget} each choose the recompute "
                             "plan; give one of them")
        if isinstance(passes, str) or not isinstance(passes, Iterable):
            raise TypeError(f"passes must be a sequence of pass names from {list(PASSES)}, got {passes!r}")
        passes = tuple(passes)
        prefetch = collectives.checked_prefetch(prefetch)
        if zero3 is not None and not isinstance(zero3, bool):
            raise TypeError(f"zero3 must be None, True or False, got {zero3!r}")
        modes = [m.value for m in offload_module.OffloadMode]
        if offload not in modes:
            raise ValueError(f"offload must be one of {modes}, got {offload!r}")
        if offload_budget is not None:
            _check_fraction("offload_budget", offload_budget)
            if offload != offload_module.OffloadMode.BUDGET.value:
                raise ValueError(f"offload_budget applies to offload='budget', got offload={offload!r}")
        if offload_rates is not None and not isinstance(offload_rates, DeviceRates):
            raise TypeError(f"offload_rates must be a thunder_memopt.core.cost.DeviceRates, got {offload_rates!r}")
        check_host_memory_limit(host_memory_limit)
        if head_gradients is not None and head_gradients not in HEAD_GRADIENTS:
            raise ValueError(f"head_gradients must be None or one of {list(HEAD_GRADIENTS)}, got {head_gradients!r}")
        unknown = [p for p in passes if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown pass names {unknown}; known passes are {list(PASSES)}")
        if memory_limit is not None and "recompute" not in passes:
            raise ValueError("memory_limit chooses the recompute pass's plan; passes must include 'recompute'")
        self.activation_budget = float(activation_budget)
        self.passes = tuple(p for p in PASSES if p in passes)
        self.offload = offload_module.OffloadMode(offload)
        self.offload_budget = self.activation_budget if offload_budget is None else float(offload_budget)
        self.offload_rates = offload_rates
        self.host_memory_limit = host_memory_limit
        offloading = self.offload is not offload_module.OffloadMode.OFF
        if offloading:
            set_host_memory_limit(host_memory_limit)  # the process's pinned memory, as the limit bounds it
        self.head_gradients = head_gradients
        self.memory_limit = memory_limit
        self.optimizer_states = int(optimizer_states)
        self.over_limit = over_limit
        self._offload = OffloadStage(self.offload, self.offload_budget, offload_rates)
        self._fit = None if memory_limit is None else FitPlanner(
            memory_limit, offload_rates, self.optimizer_states,
            lambda: (p for ref in self._modules if (m := ref()) is not None for p in m.parameters()), over_limit,
            scheduled="schedule" in passes, offload=self._offload if offloading else None,
            cap_allocator=cap_allocator)
        self.cap_allocator = cap_allocator
        self._modules: list[weakref.ref[ThunderModule]] = []  # those jitted with this instance
        self._schedule = ScheduleStage()
        self._donation = DonationStage()
        # The stages of each pass on the post-optimization traces, in the order of PASSES.
        stages_of = {
            "recompute": (RecomputeStage(self.activation_budget, self._fit), FusionStage()),
            "collectives": (CollectivesStage(prefetch, zero3),),
            "schedule": (self._schedule,),
        }
        self._stages = [s for p in self.passes for s in stages_of.get(p, ())]
        if offloading:
            self._stages.append(self._offload)
        if "donate" in self.passes:  # it reads the saved set that offload leaves
            self._stages.append(self._donation)
        if "loss_head" in self.passes:  # marks the forward's outputs once nothing changes the backward
            self._stages.append(UnmadeGradientStage())
        self._pairs: dict[tuple[str, ...], Pair] = {}
        # Seconds spent in each pass over every trace this instance has seen (compile-time cost).
        self.pass_seconds: dict[str, float] = {}

    @property
    def schedule_results(self) -> list[schedule.ScheduleResult]:
        """The schedule pass's results for the latest function: its forward's, then its backward's."""
        return self._schedule.results

    @property
    def donated_outputs(self) -> int:
        """Region outputs the donate pass wrote into inputs that die there, over every pair."""
        return self._donation.donated

    @property
    def offload_plans(self) -> list[offload_module.OffloadPlan]:
        """The offload pass's plans, one per pair it offloaded."""
        return self._offload.plans

    @property
    def fit_report(self) -> fit.FitReport | None:
        """With ``memory_limit``: each program's choice (the limit, the predicted whole-step peak of
        every rung, the rung taken) and the latest ``check_fit``; None before the first compile."""
        return None if self._fit is None else self._fit.report()

    def check_fit(self, measured_bytes: int | None = None) -> fit.FitCheck:
        """After a step, its peak against the prediction (also kept in ``fit_report.check``).

        ``measured_bytes``: the step's peak; None reads ``torch.cuda.max_memory_allocated`` on the
        planned device (reset its peak before the step). Each program's calls per step are counted
        from Thunder's compile statistics. The first time the peak is over the limit, every
        module jitted with this instance is planned again at its next call, with the measured
        error as the margin and the calls counted (a function jitted with it, which Thunder does
        not hand over, takes them when jitted anew)."""
        if self._fit is None or self._fit.report() is None:
            raise ValueError("check_fit needs MemoryOptimization(memory_limit=...) and a compiled step")
        if measured_bytes is not None and not (isinstance(measured_bytes, numbers.Integral)
                                               and not isinstance(measured_bytes, bool) and measured_bytes >= 0):
            raise ValueError(f"check_fit's measured_bytes must be None or an int >= 0, got {measured_bytes!r}")
        if measured_bytes is None:
            if self._fit.device.type != "cuda":
                raise ValueError(f"check_fit reads a CUDA device's peak; on {self._fit.device} pass measured_bytes")
            measured_bytes = torch.cuda.max_memory_allocated(self._fit.device)
        modules = [m for ref in self._modules if (m := ref()) is not None]
        check = self._fit.check(measured_bytes, _calls_per_step(modules, self._fit.choices))
        if check.replan and not modules:
            warnings.warn("thunder_memopt: check_fit found no module jitted with this instance to compile "
                          "again (Thunder hands over modules, not functions); jit it anew to plan with the margin")
        if check.replan:
            for module in modules:
                thunder.compile_stats(module).interpreter_cache.clear()
        return check

    def transform_module(self, model: ThunderModule) -> None:
        # Thunder hands over each module jitted with this instance (ThunderCompiler: each subgraph's),
        # whose compile statistics count its calls and whose cache a second plan clears.
        self._modules.append(weakref.ref(model))

    def __repr__(self) -> str:
        return (
            f"MemoryOptimization(activation_budget={self.activation_budget}, passes={self.passes}, "
            f"offload={self.offload.value!r}, offload_budget={self.offload_budget}, "
            f"host_memory_limit={self.host_memory_limit!r}, "
            f"head_gradients={self.head_gradients!r}, memory_limit={self.memory_limit!r}, "
            f"over_limit={self.over_limit!r}, cap_allocator={self.cap_allocator})"
        )

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        executors_list = kwargs.get("executors_list", ())
        if "causal_mask" in self.passes and cudnn_attention_ex in executors_list:
            # With cuDNN attention asked for: another kernel than plain Thunder's, as that executor is.
            causal = self._guarded("causal_mask", "the attention masks as they were",
                                   lambda: causal_mask.causal_attention(computation_trace))
            if causal is not None:
                computation_trace = causal
        if "masked_rows" in self.passes:
            finite = self._guarded("masked_rows", "fully masked rows as Thunder computes them (NaN)",
                                   lambda: masked_rows.zero_fully_masked_rows(computation_trace))
            if finite is not None:
                computation_trace = finite
        if "loss_head" in self.passes and linear_cross_entropy_ex in executors_list:
            # At budget 1.0 (time first) the head computes its gradients in the forward, one matmul
            # less, through a logits' gradient buffer of tokens x vocabulary. Below it, with offload
            # and with a memory limit (memory first), it recomputes its logits in the backward and
            # holds nothing of that size. head_gradients, where given, chooses instead.
            in_forward = (self.activation_budget == 1.0 and self.offload is offload_module.OffloadMode.OFF
                          and self.memory_limit is None
                          if self.head_gradients is None else self.head_gradients == "forward")
            fused = self._guarded("loss_head", "the loss unfused",
                                  lambda: loss_head.fuse_loss_heads(computation_trace, gradients_in_forward=in_forward))
            if fused is not None:
                computation_trace = fused
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace: TraceCtx, **kwargs) -> TraceCtx:
        with _cyclic_gc_paused():
            return self._transform(computation_trace, kwargs.get("executors_list", ()))

    def _transform(self, trace: TraceCtx, executors_list: Sequence) -> TraceCtx:
        if TraceTag.AUGMENTED_FORWARD in trace.tags:
            key = tuple(t.name for t in saved_proxies(trace)[0])
            pair = Pair(fusion=_fusion_executor(executors_list))
            pair.returned = self._forward(trace, pair, self._stages, "forward")
            self._pairs[key] = pair
            return pair.returned
        if TraceTag.BACKWARD in trace.tags:
            pair = self._pairs.pop(tuple(t.name for t in trace.args[0][0]), None) or Pair()
            backward = self._backward(trace, pair)
            if pair.returned is not None:
                backward = self._on_final(pair, backward)
            # Thunder builds both callables after this hook: the pair's regions are final here.
            self._compile_ahead([backward] if pair.returned is None else [pair.returned, backward])
            return backward
        return self._forward(trace, Pair(), [s for s in self._stages if s.on_inference], "forward")

    def _forward(self, trace: TraceCtx, pair: Pair, stages: Sequence[Stage], phase: Phase) -> TraceCtx:
        for stage in stages:
            if stage.runs_forward(pair):
                pair.carries.pop(stage.name, None)  # a re-run's carry replaces the first run's
                done = self._run(stage, pair, phase, lambda: stage.forward(trace, pair))
                if done is None:
                    trace = stage.fall_back(trace, pair)
                else:
                    trace, carry = done
                    if carry is not None:
                        pair.carries[stage.name] = carry
        return trace

    def _backward(self, trace: TraceCtx, pair: Pair) -> TraceCtx:
        for i, stage in enumerate(self._stages):
            if stage.runs_backward(pair):
                done = self._run(stage, pair, "backward", lambda: stage.backward(trace, pair))
                if done is not None:
                    trace, forward = done
                    if forward is not None:
                        # A budget picked another rung: the later stages' forwards run on it, and it
                        # replaces the forward handed back.
                        pair.replace_forward(self._forward(forward, pair, self._stages[i + 1:], "rerun"))
        return trace

    def _on_final(self, pair: Pair, backward: TraceCtx) -> TraceCtx:
        for stage in self._stages:
            if stage.runs_on_final(pair):
                done = self._run(stage, pair, "final", lambda: stage.on_final(pair.returned, backward, pair))
                if done is not None:
                    forward, backward = done
                    pair.replace_forward(forward)
        return backward

    def _run(self, stage: Stage, pair: Pair, phase: Phase, run: Callable[[], _T]) -> _T | None:
        """``run()``, timed as ``stage``; guarded where ``may_fall_back`` says so."""
        if may_fall_back(stage, pair, phase):
            return self._guarded(stage.name, stage.kept, run)
        with self._timed(stage.name):
            return run()

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


def _calls_per_step(modules: Sequence[ThunderModule], programs: Iterable[tuple]) -> dict[tuple, int]:
    """Each program's calls per step, by ``FitPlanner.key``: its modules' calls (Thunder's compile
    statistics) over those of the program called least, which runs once a step (the model's under
    thunder.jit, the loss's under ThunderCompiler)."""
    programs = set(programs)
    calls: dict[tuple, int] = {}
    for module in modules:
        stats = thunder.compile_stats(module)
        forwards = [t for t in stats.last_traces or () if TraceTag.AUGMENTED_FORWARD in t.tags]  # None: never called
        key = next((k for t in forwards if (k := FitPlanner.key(t)) in programs), None)
        if key is not None:
            calls[key] = calls.get(key, 0) + stats.calls
    steps = min(calls.values(), default=1)
    return {key: max(1, round(n / steps)) for key, n in calls.items()}


def _fusion_executor(executors_list: Sequence) -> InductorFusionExecutor | None:
    return next((ex for ex in executors_list if isinstance(ex, InductorFusionExecutor)), None)


