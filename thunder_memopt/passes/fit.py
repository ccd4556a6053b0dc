"""Fit: choose the recompute rung from a memory limit on the whole step's peak, not from a budget.

``MemoryOptimization(memory_limit=...)`` names the memory the step may take. For each compiled
program (under ``thunder.jit`` the whole model; under FSDP2 with ``torch.compile``, one program per
distinct graph, a Block's running once per Block), the recompute ladder's rungs
(``recompute.plan_ladder``) are priced on the real traces (``recompute.price_ladder``), and the rung
with the least modelled recompute time whose predicted whole-step peak stays under the limit is
taken (``choose_by_limit``). Where none does, even with the programs planned before it at their
least saved bytes, ``over_limit`` says what follows (``OVER_LIMIT``): "raise", a ``MemoryLimitError``
of one line at the program's compile, before its first step runs, with the lowest predicted peak
and what to change (``refusal``); "lowest", the lowest predicted peak, with one warning.

The whole step's predicted peak, for one rung of one program (``StepTerms.peak``)::

    static + first_step + (calls - 1) * max(saved + call_gathered, call_gradient) + pair_peak + margin

- ``static``: what is resident before the program runs and stays through the step. On CUDA,
  ``torch.cuda.memory_allocated`` at the program's first compile, which is exact for what exists
  then: parameters, gradients kept from before, optimizer states already made, the batch, and, under
  FSDP2, its sharded parameters and the unsharded and prefetched ones allocated by then, and the
  saved tensors of the programs that ran before it in the step (a head compiled after every Block
  has run counts every Block's). Elsewhere (CPU, meta) the bytes of the forward's inputs, from the
  trace: parameters, buffers and the batch, and the saved tensors of the programs planned before
  it, over their calls (``stages.FitPlanner``). A program
  planned again, or one structurally identical to it compiled apart, keeps the static term of its
  first plan, against which the check's margin was measured (``stages.FitPlanner``).
- ``first_step``: what the step holds at its peak that the first compile does not see allocated
  (``FirstStep``, ``first_step``): the optimizer's states, ``optimizer_states`` per parameter (AdamW's
  two, in the parameters' dtype), made at its first step, over the parameters of the modules jitted
  with the transform or FSDP2's local shards; and, from FSDP2's state (``fsdp2_units``), the
  gathered parameters of the units that hold them at the peak less those gathered by the compile
  (on CPU, where the static term is the program's inputs, the local shards too), the other calls'
  units apart; and the root's gradients, whole until the backward ends. Not counted: FSDP2's
  reduce-scatter buffers (one in flight, after a unit's backward, when its saved tensors are freed)
  and the optimizer step's own temporaries. The check after a step stays as a guard.
- ``saved``: the bytes one call of the program saves for its backward at this rung (storages,
  parameters excluded: ``RecomputePlan.saved_bytes_after``). The other ``calls - 1`` calls of the
  same program in a step hold theirs until their backward runs, with their FSDP2 unit's gathered
  parameters where it keeps them after the forward (zero2: ``call_gathered``), and after it their
  unit's gradient shard (``call_gradient``), its gathered parameters freed (``FirstStep``): at the
  k-th backward of the calls, k gradients and ``calls - 1 - k`` calls' saved tensors and gathered
  parameters, whose largest is at the first or the last.
- ``calls``: how many times the program runs per step. At its first compile, under FSDP2, the
  units alike the one whose forward runs (their parameters' shapes and dtypes: the Blocks); else 1,
  which is exact under ``thunder.jit`` (the model is one program). ``MemoryOptimization.check_fit``
  counts each program's calls from Thunder's compile statistics (``thunder.compile_stats(fn).calls``,
  over the calls of the program called least: the model's under thunder.jit, the loss's under
  ThunderCompiler), and a second plan counts them. Structurally identical programs compiled apart
  (the same saved tensors by name, shape and dtype) count as calls of one.
- ``pair_peak``: the program's own peak over its forward and backward, from the traces as the fusion
  executor fuses them, where it runs (``memory.estimate_step``): its saved tensors with its largest
  transient working set (a Block's backward, the loss head's chunks), its gradients, as they are
  made; with the schedule pass on, each rung's backward in the order that pass runs it
  (``price_rungs``). With offload on, each rung is priced as the offload pass would leave it: its
  plan's copies off the device (``saved`` less what it offloads), and the reloads it cannot hide
  added to the rung's time. So a rung with less recompute can fit where the offload pass moves
  enough of what it keeps to the host. Each rung is also priced without the copies, and the limit
  takes the fastest rung that fits either way, without the copies where the times tie
  (``fastest_fitting``): the pass then copies nothing of a program that fits as fast without. Each
  call's copies take at most the program's share of the process's pinned host limit
  (``host_memory_limit``, whose "auto" is split over the node's ranks by ``LOCAL_WORLD_SIZE``): that
  limit less the other programs' copies, over the program's calls (``stages.FitPlanner``); the
  offload pass keeps the rest on the device, and the rung is priced so.
- Programs planned later: on CUDA a program's static term holds what the programs planned before
  it saved (a loss head compiled after every Block counts every Block's), so a rung of the Block
  also moves the head's peak. A program takes the rung under which its own prediction and those of
  the programs whose static term holds its saved tensors fit (``FitChoice.others_bytes``), and a
  static term follows the saved bytes the earlier programs take when they are planned again, over
  their counted calls (``stages.FitPlanner``).
- ``margin``: 0 at the first plan; after a step measured over the limit, raised by the measured
  peak less the prediction (``check_fit``), and the one second plan takes it.

The recompute time of a rung is its replayed symbols on the roofline of ``core.cost.op_seconds``,
at ``offload_rates`` where given, else on CUDA the device's measured rates, elsewhere
``NOMINAL_RATES``, an H200's datasheet figures, which only rank the rungs.

The limit (``checked_memory_limit``, ``resolve_memory_limit``): an ``int``, or a ``float`` above 1
that is a whole number (``40e9``), is bytes; a ``float`` in (0, 1] a fraction of the CUDA device's
total memory (so ``1.0`` is all of it, ``1`` one byte); infinity, NaN, zero or less, and a float
above 1 with a fractional part are one-line errors; ``"auto"`` the memory the process could
allocate at the first compile (the driver's free memory and what torch's caching allocator holds,
or the process's cap where ``torch.cuda.set_per_process_memory_fraction`` set a lower one) less
``AUTO_MARGIN`` of what it may use, for the allocator's rounding and fragmentation and what other
libraries allocate. A limit above that cap is refused: the allocator would fail first. The last
two need a CUDA device. The prediction is of allocated bytes (``max_memory_allocated``); what the
allocator reserves is held under the limit by capping it there at the first plan (``allocator_cap``).

Pure functions and frozen results, in the style of ``torch/_inductor/memory.py``; the state across
programs (the limit, the margin, the counted calls) is ``stages.FitPlanner``'s.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from thunder.core.trace import TraceCtx

from thunder_memopt.core.cost import DeviceRates, op_seconds
from thunder_memopt.core.memory import StepEstimate, backward_storages, estimate_step
from thunder_memopt.passes import offload, recompute, schedule

if TYPE_CHECKING:
    from thunder_memopt.executors.fusion import InductorFusionExecutor
    from thunder_memopt.passes.recompute import RecomputePlan

__all__ = [
    "AUTO_MARGIN",
    "NOMINAL_RATES",
    "MemoryLimit",
    "OVER_LIMIT",
    "MemoryLimitError",
    "DeviceMemory",
    "RungCost",
    "StepTerms",
    "Fsdp2Unit",
    "FirstStep",
    "FitChoice",
    "FitCheck",
    "FitReport",
    "checked_memory_limit",
    "device_memory",
    "resolve_memory_limit",
    "allocator_cap",
    "recompute_seconds",
    "price_rungs",
    "rung_costs",
    "choose_by_limit",
    "fastest_fitting",
    "checked_over_limit",
    "refusal",
    "check_fit",
    "fsdp2_units",
    "first_step",
]

MemoryLimit = int | float | str

# Of the device's total memory, kept free under memory_limit="auto".
AUTO_MARGIN = 0.05
# An H200's datasheet rates (bf16 dense FLOPs, HBM bandwidth, PCIe 5 copies), to rank rungs where
# no device is measured.
NOMINAL_RATES = DeviceRates(to_host=55e9, to_device=55e9, flops=989e12, memory=4.8e12)

# What a limit that no plan fits does (MemoryOptimization's over_limit): refuse, or take the lowest plan.
OVER_LIMIT = ("raise", "lowest")

_KINDS = ("bytes (an int > 0, or a float > 1 that is a whole number: 40e9), a fraction of the CUDA device's "
          "memory (a float in (0, 1]) or 'auto'")


def checked_memory_limit(value: object) -> MemoryLimit | None:
    """``value`` as a ``memory_limit``: bytes as an ``int`` (a float above 1 that is a whole number,
    ``40e9``, is bytes too), a fraction as a ``float`` in (0, 1], or ``"auto"``. A TypeError or
    ValueError of one line, naming the option, where it is none of these: infinity, NaN, zero or
    less, a float above 1 with a fractional part. A fraction or "auto" without any CUDA device is a
    ValueError here."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real | str):
        raise TypeError(f"memory_limit must be {_KINDS}, got {value!r}")
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"memory_limit must be {_KINDS}, got {value!r}")
    elif isinstance(value, numbers.Integral):
        if value <= 0:
            raise ValueError(f"memory_limit in bytes must be > 0, got {value}")
        return int(value)
    else:
        value = float(value)
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"memory_limit must be a finite number above 0, got {value}")
        if value > 1.0:
            if not value.is_integer():
                raise ValueError(f"memory_limit={value} is neither a fraction of the device's memory (in (0, 1]) "
                                 "nor a whole number of bytes")
            return int(value)
    if not torch.cuda.is_available():
        raise ValueError(f"memory_limit={value!r} is relative to a CUDA device's memory and there is none; "
                         "give the limit in bytes (an int)")
    return value


def checked_over_limit(value: object) -> str:
    """``value`` as ``over_limit``: one of ``OVER_LIMIT``, or a one-line ValueError naming it."""
    if not isinstance(value, str) or value not in OVER_LIMIT:
        raise ValueError(f"over_limit must be one of {list(OVER_LIMIT)}, got {value!r}")
    return value


class MemoryLimitError(RuntimeError):
    """No recompute plan fits ``memory_limit`` (with ``over_limit="raise"``): raised at a program's
    compile, before its first step runs; the message is one line (``refusal``)."""


def refusal(limit_bytes: int, lowest_bytes: int) -> str:
    """The one line that refuses a limit: the lowest predicted peak, and what to change."""
    return (f"thunder_memopt: no recompute plan fits memory_limit={limit_bytes} bytes ({_binary(limit_bytes)}): "
            f"the lowest predicted peak is {lowest_bytes} bytes ({_binary(lowest_bytes)}); shorten the "
            f"sequence (T) or the micro-batch, shard over more ranks (world size, zero3), offload saved tensors "
            f"(offload='budget'), or raise the limit; over_limit='lowest' takes the lowest plan with a warning")


def _binary(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory at one moment, in bytes."""

    total: int
    free: int  # the driver's free memory (``torch.cuda.mem_get_info``)
    reserved: int  # held by torch's caching allocator
    allocated: int  # of that, in tensors
    cap: int | None = None  # the process's cap (set_per_process_memory_fraction), where below total

    @property
    def usable(self) -> int:
        """What the process may allocate on the device at most."""
        return self.total if self.cap is None else self.cap


def device_memory(device: torch.device) -> DeviceMemory | None:
    """The device's memory now; None for a device that is not CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return DeviceMemory(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                        allocated=torch.cuda.memory_allocated(device),
                        cap=round(fraction * total) if fraction < 1 else None)


def resolve_memory_limit(value: MemoryLimit, memory: DeviceMemory | None) -> int:
    """The limit in bytes (see the module docstring); ``memory`` None: the traces are not on CUDA,
    where only bytes can be a limit. A one-line ValueError where it cannot be resolved."""
    if memory is None:
        if isinstance(value, numbers.Integral):
            return int(value)
        raise ValueError(f"memory_limit={value!r} is relative to a CUDA device's memory, and the model is "
                         "not on one; give the limit in bytes (an int)")
    if value == "auto":
        return min(memory.free + memory.reserved, memory.usable) - int(AUTO_MARGIN * memory.usable)
    limit = int(value) if isinstance(value, numbers.Integral) else int(float(value) * memory.total)
    if limit > memory.usable:
        where = (f"the device's {memory.total}" if memory.cap is None else
                 f"this process's cap of {memory.cap} (torch.cuda.set_per_process_memory_fraction)")
        raise ValueError(f"memory_limit={value!r} ({limit} bytes) is more than {where}")
    return limit


def allocator_cap(limit: int, memory: DeviceMemory) -> float | None:
    """The fraction of the device's memory at which to cap the process's caching allocator so that
    what it reserves stays under ``limit`` (``torch.cuda.set_per_process_memory_fraction``); None
    where the process is capped at the limit or below already."""
    if memory.cap is not None and memory.cap <= limit:
        return None
    return limit / memory.total


@dataclass(frozen=True)
class RungCost:
    """One rung of a program's ladder, as the fit prices it."""

    saved_bytes: int  # what one call saves for its backward, on the device
    pair_peak_bytes: int  # the program's own peak over its forward and backward (estimate_step)
    recompute_seconds: float  # its replayed symbols on the roofline, and reloads the offload exposes
    offloaded_bytes: int = 0  # of what it saves, what the offload pass copies to the host
    pinned_bytes: int = 0  # the host memory those copies take (offload.OffloadPlan.pinned_bytes)


@dataclass(frozen=True)
class StepTerms:
    """The terms of the whole step's peak that do not depend on the rung (module docstring)."""

    static_bytes: int
    calls: int = 1
    margin_bytes: int = 0
    # What the step holds at its peak that is not allocated at the first compile (``FirstStep``).
    first_step_bytes: int = 0
    # What each other call's unit holds before its backward beside the saved tensors (its gathered
    # parameters), and after it (its gradient): ``FirstStep``.
    call_gathered_bytes: int = 0
    call_gradient_bytes: int = 0

    def peak(self, rung: RungCost) -> int:
        """The whole step's predicted peak at ``rung``."""
        return (self.static_bytes + self.first_step_bytes
                + (self.calls - 1) * max(rung.saved_bytes + self.call_gathered_bytes, self.call_gradient_bytes)
                + rung.pair_peak_bytes + self.margin_bytes)


@dataclass(frozen=True)
class Fsdp2Unit:
    """One FSDP2 unit (parameter group) of this process, in this rank's bytes."""

    sharded_bytes: int  # its parameters' local shards (padded)
    unsharded_bytes: int  # its parameters all-gathered (padded), in the dtype they are gathered in
    unsharded_now: int  # of those, allocated now
    optimized_bytes: int  # the local shards of its parameters that require grad
    reshard_after_forward: bool
    root: bool
    running: bool  # its forward is running now (the program compiled now is in it)
    signature: tuple  # its parameters' shapes and dtypes: units alike run one compiled program


def fsdp2_units(parameters: Iterable[torch.Tensor] = ()) -> tuple[Fsdp2Unit, ...]:
    """The FSDP2 units (``fully_shard``) of the model the program compiled now runs in, read from
    FSDP2's state: the model whose root's forward runs now (under ``torch.compile`` each unit's graph
    compiles inside it, its parameters graph inputs); else the units that hold any of ``parameters``
    (the modules jitted with the transform); () where there are none. Other FSDP2 models alive in the
    process are not the program's, and are not read."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    states = [s for ref in list(_module_state_mapping.values()) if isinstance(s := ref(), FSDPState)]
    # The roots whose forward runs (FSDP2 sets one at its pre-forward) know their models' units.
    roots = {id(root): root for s in states if (root := s._state_ctx.iter_forward_root) is not None}
    if roots:
        states = [s for root in roots.values() for s in root._state_ctx.all_states if isinstance(s, FSDPState)]
    else:
        own = {id(p) for p in parameters}
        states = [s for s in states if s._fsdp_param_group is not None
                  and any(id(p.sharded_param) in own or id(getattr(p, "_unsharded_param", None)) in own
                          for p in s._fsdp_param_group.fsdp_params)]
    units = []
    for state in states:
        group = state._fsdp_param_group
        if group is None:
            continue
        sharded = unsharded = now = optimized = 0
        for param in group.fsdp_params:
            local = param._sharded_param_data
            dtype = param.param_dtype or param.orig_dtype
            gathered = local.numel() * group.mesh_info.shard_mesh_size * dtype.itemsize
            sharded += local.numel() * local.element_size()
            unsharded += gathered
            now += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
            optimized += local.numel() * local.element_size() if param.sharded_param.requires_grad else 0
        units.append(Fsdp2Unit(
            sharded_bytes=sharded, unsharded_bytes=unsharded, unsharded_now=now, optimized_bytes=optimized,
            reshard_after_forward=group.post_forward_mesh_info is not None, root=bool(state._is_root),
            running=group._training_state == TrainingState.FORWARD,
            signature=tuple((tuple(p.sharded_param.shape), p.orig_dtype) for p in group.fsdp_params)))
    return tuple(units)


@dataclass(frozen=True)
class FirstStep:
    """What the step holds at its peak and the first compile does not see allocated: the optimizer's
    states, made at its first step, and FSDP2's buffers allocated after the compile. The peak is
    taken where the existing terms put it, in the backward of a unit's program, with the other
    calls' saved tensors or their units' gradients alive (``StepTerms.peak``): there, under FSDP2,
    every unit that keeps its parameters after the forward (zero2, and the root) holds them
    unsharded until its backward ends, and of those resharded after the forward (zero3), the unit
    in its backward and the one prefetched. At one rank the gathered parameters are copies of the
    shards too (FSDP2's ``wait_for_unshard`` copies them)."""

    optimizer_state_bytes: int
    fsdp2_bytes: int
    calls: int  # the calls per step of the program compiled now: the FSDP2 units alike the running one
    # The root's gradients, whole until the backward ends.
    gradient_bytes: int = 0
    # Of one other unit alike the running one (each of the other calls: ``StepTerms``): its gathered
    # parameters, kept from its forward to the end of its backward (zero2), and then its gradient,
    # reduce-scattered to its shard.
    call_gathered_bytes: int = 0
    call_gradient_bytes: int = 0

    @property
    def bytes(self) -> int:
        return self.optimizer_state_bytes + self.fsdp2_bytes + self.gradient_bytes


def first_step(units: Sequence[Fsdp2Unit], optimized_bytes: int, optimizer_states: int, *,
               states_made: bool, allocated_seen: bool) -> FirstStep:
    """The ``FirstStep`` terms for a program compiled now. ``optimized_bytes``: the parameters the
    optimizer steps, other than FSDP2's (the model's, under ``thunder.jit``); ``optimizer_states``:
    the states it keeps per parameter (AdamW's two), made at its first step unless ``states_made``.
    ``allocated_seen``: the static term is the allocator's bytes now (CUDA), which hold FSDP2's
    local shards and what it has gathered by now; else (CPU, meta) it is the program's inputs, which
    hold the running unit's gathered parameters only."""
    optimized = optimized_bytes + sum(u.optimized_bytes for u in units)
    states = 0 if states_made else optimizer_states * optimized
    running = [u for u in units if u.running and not u.root] or [u for u in units if u.running]
    own = running[-1].signature if running and not running[-1].root else None
    # The other calls' units that keep their gathered parameters: per call, in StepTerms.
    per_call = {id(u) for u in units if own is not None and u.signature == own and u is not running[-1]
                and not u.reshard_after_forward}
    kept = sum(u.unsharded_bytes for u in units if (u.root or not u.reshard_after_forward) and id(u) not in per_call)
    resharded = sorted((u.unsharded_bytes for u in units if not u.root and u.reshard_after_forward), reverse=True)
    at_peak = kept + sum(resharded[:2])
    if allocated_seen:
        fsdp2 = max(0, at_peak - sum(u.unsharded_now for u in units))
    else:
        fsdp2 = sum(u.sharded_bytes for u in units) + max(0, at_peak - sum(u.unsharded_bytes for u in running[-1:]))
    calls = sum(u.signature == own for u in units) if own is not None else 1
    gradients = 0 if own is None else sum(u.unsharded_bytes for u in units if u.root and u.optimized_bytes)
    return FirstStep(optimizer_state_bytes=states, fsdp2_bytes=fsdp2, calls=calls, gradient_bytes=gradients,
                     call_gathered_bytes=running[-1].unsharded_bytes if per_call else 0,
                     call_gradient_bytes=0 if own is None else running[-1].optimized_bytes)


@dataclass(frozen=True)
class FitChoice:
    """The rung a limit takes for one program, with what it was chosen from."""

    rung: int
    limit_bytes: int
    terms: StepTerms
    rungs: tuple[RungCost, ...]
    # At each rung, the highest predicted peak of the programs that run after this one and hold its
    # saved tensors in their static term (a loss head after the Blocks); () where there are none.
    others_bytes: tuple[int, ...] = ()

    @property
    def predicted_peaks(self) -> tuple[int, ...]:
        """The whole step's predicted peak at each rung: this program's, or a later one's above it."""
        return tuple(max((self.terms.peak(r), *self.others_bytes[k:k + 1])) for k, r in enumerate(self.rungs))

    @property
    def predicted_peak_bytes(self) -> int:
        return self.predicted_peaks[self.rung]

    @property
    def fits(self) -> bool:
        return self.predicted_peak_bytes <= self.limit_bytes


def recompute_seconds(plans: Sequence[RecomputePlan], rates: DeviceRates) -> list[float]:
    """The modelled time of what each plan's backward replays. The rungs of a ladder replay the same
    symbols, each priced once."""
    seconds: dict[int, float] = {}
    for b in {id(b): b for plan in plans for b in plan.replayed}.values():
        seconds[id(b)] = op_seconds(b, rates)
    return [sum(seconds[id(b)] for b in plan.replayed) for plan in plans]


def price_rungs(plans: Sequence[RecomputePlan], forward: TraceCtx, backward: TraceCtx, *, scheduled: bool,
                offloads: Sequence[Callable[[TraceCtx, TraceCtx], offload.OffloadPlan] | None] = (None,),
                fusion: InductorFusionExecutor | None = None,
                ) -> list[list[tuple[StepEstimate, offload.OffloadPlan | None]]]:
    """Each rung's ``memory.estimate_step``, once per entry of ``offloads``: None, the pair as it is;
    else the offload pass's planner, the pair as that pass leaves it, with the plan. With
    ``scheduled``, the backward in the order the schedule pass will run it, on which the offload
    pass plans: on the order before it, whose first reads come earlier, fewer reloads hid, and
    Llama-3-8B's SIMULATED rank was priced a 160 MiB copy a Block short of what the pass made
    (tests/test_fit_first_step.py). The backward Thunder hands over can compute what needs only the
    saved tensors at its start (under ``thunderfx_backend``, a SiLU's derivative terms), holding it
    through the loss's backward until its use: priced in that order, a CPU Llama of width 128, 2
    layers, at T=256 was predicted 44% over its measured peak (tests/test_fit_refusal.py).

    With ``fusion``, each rung's pair as that executor fuses it (``fuse_with_replays``, the backward
    fused again), whose regions hold their intermediates: taken apart, a GELU's backward replaying
    its forward held three fp32 tensors of the MLP's width, 3.75 GiB of a stablecode Block at
    T=32768, that no region outputs. Each rung is fused once for every entry of ``offloads``."""
    if not scheduled and fusion is None and all(planner is None for planner in offloads):
        return [[(estimate, None) for estimate in recompute.price_ladder(plans, forward, backward)]] * len(offloads)
    ways: list[list[tuple[StepEstimate, offload.OffloadPlan | None]]] = [[] for _ in offloads]
    for plan in plans:
        rung_forward = plan.apply_to_forward(forward, deletions=False)
        if fusion is None:
            rung_backward = plan.apply_to_backward(backward, deletions=False)
        else:
            rung_forward, replays = fusion.fuse_with_replays(rung_forward, plan)
            rung_backward = fusion.refuse(replays.apply_to_backward(backward, deletions=False))
        if scheduled:
            rung_backward = schedule.schedule_trace(rung_backward, backward_storages(rung_forward, rung_backward)).trace
        for priced, planner in zip(ways, offloads):
            copies = None if planner is None else planner(rung_forward, rung_backward)
            way_forward, way_backward = (rung_forward, rung_backward) if copies is None else \
                offload.apply_offload(rung_forward, rung_backward, copies)
            priced.append((estimate_step(way_forward, way_backward), copies))
    return ways


def rung_costs(plans: Sequence[RecomputePlan], priced: Sequence[tuple[StepEstimate, offload.OffloadPlan | None]],
               rates: DeviceRates) -> list[RungCost]:
    """Each rung's cost from ``price_rungs``: what it saves less what its offload plan copies to the
    host, and its recompute time with the reloads that plan does not hide."""
    costs = []
    for plan, (estimate, copies), seconds in zip(plans, priced, recompute_seconds(plans, rates)):
        offloaded, pinned = (0, 0) if copies is None else (copies.offloaded_bytes, copies.pinned_bytes)
        exposed = 0.0 if copies is None else copies.exposed_seconds
        costs.append(RungCost(plan.saved_bytes_after - offloaded, estimate.peak_bytes, seconds + exposed, offloaded,
                              pinned))
    return costs


def choose_by_limit(rungs: Sequence[RungCost], terms: StepTerms, limit_bytes: int,
                    others_bytes: Sequence[int] = ()) -> FitChoice:
    """Of the rungs whose predicted whole-step peak is at most ``limit_bytes``, the one with the least
    recompute time (ties: the lower peak, then the earlier rung); where none is, the lowest peak.
    ``others_bytes``: at each rung, the peak of the later programs that this one's saved bytes
    raise (``FitChoice.others_bytes``).

    A lower limit only removes rungs a higher one could take, so the predicted peak of the choice
    never rises as the limit falls."""
    choice = FitChoice(rung=0, limit_bytes=limit_bytes, terms=terms, rungs=tuple(rungs),
                       others_bytes=tuple(others_bytes))
    peaks = choice.predicted_peaks
    fitting = [k for k, peak in enumerate(peaks) if peak <= limit_bytes]
    if fitting:
        k = min(fitting, key=lambda k: (rungs[k].recompute_seconds, peaks[k], k))
    else:
        k = min(range(len(rungs)), key=lambda k: (peaks[k], rungs[k].recompute_seconds, k))
    return dataclasses.replace(choice, rung=k)


def fastest_fitting(choices: Sequence[FitChoice]) -> int:
    """Of one program's choices, each from the same ladder priced another way (without offload, then
    with it), the index of the one to take: of those that fit, the least recompute time (ties: the
    earlier); where none fits, the lowest predicted peak."""
    fitting = [i for i, c in enumerate(choices) if c.fits]
    if fitting:
        return min(fitting, key=lambda i: (choices[i].rungs[choices[i].rung].recompute_seconds, i))
    return min(range(len(choices)), key=lambda i: (choices[i].predicted_peak_bytes, i))


@dataclass(frozen=True)
class FitCheck:
    """A step's measured peak against the prediction, and what follows."""

    limit_bytes: int
    predicted_bytes: int
    measured_bytes: int
    replan: bool  # the programs are planned once more, with ``margin_bytes``
    margin_bytes: int  # the margin of the next plan (the current one where there is none)

    @property
    def error_bytes(self) -> int:
        """Measured less predicted."""
        return self.measured_bytes - self.predicted_bytes

    @property
    def over(self) -> bool:
        return self.measured_bytes > self.limit_bytes


def check_fit(predicted_bytes: int, measured_bytes: int, limit_bytes: int, *, margin_bytes: int,
              replanned: bool) -> FitCheck:
    """``measured_bytes`` against ``predicted_bytes`` (which includes ``margin_bytes``): where the
    measured peak is over the limit and no second plan was made yet, one is, its margin raised by the
    measured error."""
    replan = measured_bytes > limit_bytes and not replanned
    margin = margin_bytes + max(0, measured_bytes - predicted_bytes) if replan else margin_bytes
    return FitCheck(limit_bytes=limit_bytes, predicted_bytes=predicted_bytes, measured_bytes=measured_bytes,
                    replan=replan, margin_bytes=margin)


@dataclass(frozen=True)
class FitReport:
    """What ``MemoryOptimization(memory_limit=...)`` chose, program by program, and its latest check."""

    choices: tuple[FitChoice, ...]  # one per program, in compile order
    check: FitCheck | None
    # The cap set on the process's caching allocator at the first plan (``allocator_cap``), as a
    # fraction of the device's memory; None where none was set.
    allocator_fraction: float | None = None

    @property
    def limit_bytes(self) -> int:
        return self.choices[-1].limit_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """The whole step's predicted peak: the largest of the programs' predictions."""
        return max(c.predicted_peak_bytes for c in self.choices)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.choices)
