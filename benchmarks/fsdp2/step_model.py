"""The step-time model of ``--simulate-world-size N``: FSDP2's collectives at N ranks, laid over the
compute measured on one GPU.

Under the fake process group the collectives move no data and take no time, so a simulated row
measures compute alone: the model, its FSDP2 copy-in and copy-out kernels and the optimizer. The
worker records, per step, the points on the compute stream where FSDP2 waits for an all-gather,
releases one, and issues a reduce-scatter, with each collective's bytes (``Timeline``). This module
adds the time the collectives would take at a bus bandwidth, and where the compute would wait for
them, as FSDP2 2.11 orders them (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``):

- **Forward all-gathers** (implicit prefetch): the all-gather streams wait for the copy-out of the
  all-gather two before, so all-gather ``i`` may start once the compute has released all-gather
  ``i - 2`` (the first two at the step's start).
- **Backward all-gathers** (zero3): each unit's pre-backward prefetches the next unit's after its
  own copy-out, so all-gather ``i`` may start once all-gather ``i - 1`` is released; the first one
  once the backward has begun.
- **Reduce-scatters**: issued at each unit's post-backward; the compute stream first waits for the
  previous reduce-scatter (FSDP2 keeps one in flight), and the optimizer waits for the last.
- **One link**: the collectives share the GPU's links, so they run one after another, each as soon
  as it may start and the link is free. A collective over ``n`` bytes (the all-gather's output, the
  reduce-scatter's input) takes ``n * (N - 1) / N / bus_bandwidth``: NCCL's bus bandwidth.
- **The CPU runs ahead** of the GPU within each pass, as FSDP2's prefetching assumes.

The modelled step is a model, never a measurement: rows keep it in ``sim_`` fields beside the
measured compute (``sim_compute_ms``), and the tables label it so. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# NCCL's bus bandwidth for all-gather and reduce-scatter on H100/H200 NVLink within a node: about
# 350-370 GB/s (nccl-tests issue 212, nccl issue 1281). The default of --bus-bandwidth.
NVLINK_BUS_GBPS = 350.0

ALL_GATHER, REDUCE_SCATTER = "all_gather", "reduce_scatter"
# Points on the compute stream, in the order a step reaches them.
STEP_BEGIN = "step_begin"
ALL_GATHER_WAIT = "all_gather_wait"  # the compute needs all-gather ``collective`` here
FORWARD_BEGIN = "forward_begin"  # a unit's forward starts (its all-gather, if any, released)
FORWARD_END = "forward_end"
BACKWARD_PASS = "backward_pass"  # the backward reaches its first FSDP2 unit: the forward is over
BACKWARD_BEGIN = "backward_begin"  # a unit's backward starts (its all-gather, if any, released)
BACKWARD_END = "backward_end"  # a unit's gradients are done (its reduce-scatter, if any, issued)
OPTIMIZER_BEGIN = "optimizer_begin"  # the backward has returned
STEP_END = "step_end"
POINT_KINDS = (STEP_BEGIN, ALL_GATHER_WAIT, FORWARD_BEGIN, FORWARD_END, BACKWARD_PASS, BACKWARD_BEGIN,
               BACKWARD_END, OPTIMIZER_BEGIN, STEP_END)


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # ALL_GATHER or REDUCE_SCATTER
    unit: str  # the FSDP2 unit's module path ("" for the root)
    nbytes: int  # the all-gather's output, the reduce-scatter's input: the unsharded size


@dataclasses.dataclass(frozen=True)
class Point:
    kind: str  # one of POINT_KINDS
    unit: str  # the FSDP2 unit, "" for the step's own points and the root
    collective: int | None  # index into Timeline.collectives: the all-gather waited for or released, the
    # reduce-scatter issued
    at_ms: float  # measured, on the compute stream, from the step's start


@dataclasses.dataclass(frozen=True)
class Timeline:
    """One measured step under the fake process group: its points in order, and its collectives."""

    points: tuple[Point, ...]
    collectives: tuple[Collective, ...]

    def to_json(self) -> dict[str, list]:
        """Compact lists for a row: points as [kind, unit, collective, ms], collectives as [kind, unit, bytes]."""
        return {"points": [[p.kind, p.unit, p.collective, round(p.at_ms, 4)] for p in self.points],
                "collectives": [[c.kind, c.unit, c.nbytes] for c in self.collectives]}

    @classmethod
    def from_json(cls, data: Mapping[str, Sequence[Sequence[Any]]]) -> Timeline:
        return cls(tuple(Point(*point) for point in data["points"]),
                   tuple(Collective(*collective) for collective in data["collectives"]))

    @property
    def compute_ms(self) -> float:
        """The measured step: the compute stream's time from the step's start to its end."""
        return self.points[-1].at_ms


@dataclasses.dataclass(frozen=True)
class StepModel:
    """The modelled step at one bus bandwidth (all times in ms; modelled, except ``compute_ms``)."""

    bus_gbps: float
    world_size: int
    compute_ms: float  # measured: the step on one GPU, collectives taking no time
    step_ms: float  # modelled: the compute with the waits for collectives
    all_gather_ms: float  # modelled: the all-gathers' time on the link, summed
    reduce_scatter_ms: float
    all_gather_bytes: int  # per step, summed over the all-gathers
    reduce_scatter_bytes: int

    @property
    def exposed_ms(self) -> float:
        """The communication the compute does not hide: modelled step less measured compute."""
        return self.step_ms - self.compute_ms

    def fields(self) -> dict[str, float | int]:
        """The row's ``sim_`` fields."""
        return {"sim_bus_gbps": self.bus_gbps, "sim_compute_ms": self.compute_ms, "sim_step_ms": self.step_ms,
                "sim_exposed_ms": self.exposed_ms, "sim_all_gather_ms": self.all_gather_ms,
                "sim_reduce_scatter_ms": self.reduce_scatter_ms, "sim_all_gather_bytes": self.all_gather_bytes,
                "sim_reduce_scatter_bytes": self.reduce_scatter_bytes}


def collective_ms(nbytes: int, world_size: int, bus_gbps: float) -> float:
    """NCCL's time for an all-gather or reduce-scatter of ``nbytes`` (unsharded) at a bus bandwidth."""
    return nbytes * (world_size - 1) / world_size / (bus_gbps * 1e9) * 1e3


def _all_gather_gates(timeline: Timeline) -> dict[int, tuple[str, int | None]]:
    """For each all-gather, the point that lets it start: (STEP_BEGIN, None), (BACKWARD_PASS, None),
    or ("release", j) once all-gather j is released."""
    forward: list[int] = []
    backward: list[int] = []
    passes = forward
    for point in timeline.points:
        if point.kind == BACKWARD_PASS:
            passes = backward
        elif point.kind == ALL_GATHER_WAIT:
            passes.append(point.collective)
    gates: dict[int, tuple[str, int | None]] = {}
    for i, index in enumerate(forward):
        gates[index] = (STEP_BEGIN, None) if i < 2 else ("release", forward[i - 2])
    for i, index in enumerate(backward):
        gates[index] = (BACKWARD_PASS, None) if i == 0 else ("release", backward[i - 1])
    return gates


def model_step(timeline: Timeline, *, world_size: int, bus_gbps: float = NVLINK_BUS_GBPS) -> StepModel:
    """The step of ``timeline`` with its collectives at ``world_size`` ranks and ``bus_gbps``.

    Walks the measured points in order on a modelled clock that runs ``delay`` ms behind the
    measured one: a point where the compute must wait for a collective that has not ended adds the
    difference to ``delay``. Each collective is put on the link when its gate is reached.
    """
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 to model collectives, got {world_size}")
    if not bus_gbps > 0:
        raise ValueError(f"bus_gbps must be above 0, got {bus_gbps}")
    durations = [collective_ms(c.nbytes, world_size, bus_gbps) for c in timeline.collectives]
    gates = _all_gather_gates(timeline)
    waiting_on: dict[tuple[str, int | None], list[int]] = {}
    for index, gate in gates.items():
        waiting_on.setdefault(gate, []).append(index)
    ends: dict[int, float] = {}
    link_free = delay = 0.0
    previous_reduce_scatter: int | None = None

    def start(indices: Iterable[int], now: float) -> None:
        nonlocal link_free
        for index in indices:
            begin = max(link_free, now)
            ends[index] = link_free = begin + durations[index]

    def wait_for(index: int | None, now: float) -> float:
        nonlocal delay
        if index is not None and ends[index] > now:
            delay += ends[index] - now
            return ends[index]
        return now

    for point in timeline.points:
        now = point.at_ms + delay
        if point.kind in (STEP_BEGIN, BACKWARD_PASS):
            start(waiting_on.get((point.kind, None), ()), now)
        elif point.kind == ALL_GATHER_WAIT:
            wait_for(point.collective, now)
        elif point.kind in (FORWARD_BEGIN, BACKWARD_BEGIN) and point.collective is not None:
            start(waiting_on.get(("release", point.collective), ()), now)
        elif point.kind == BACKWARD_END and point.collective is not None:
            now = wait_for(previous_reduce_scatter, now)  # FSDP2 keeps one reduce-scatter in flight
            start([point.collective], now)
            previous_reduce_scatter = point.collective
        elif point.kind == OPTIMIZER_BEGIN:
            wait_for(previous_reduce_scatter, now)
    by_kind = {kind: [i for i, c in enumerate(timeline.collectives) if c.kind == kind]
               for kind in (ALL_GATHER, REDUCE_SCATTER)}
    return StepModel(
        bus_gbps=bus_gbps, world_size=world_size, compute_ms=timeline.compute_ms,
        step_ms=timeline.compute_ms + delay,
        all_gather_ms=sum(durations[i] for i in by_kind[ALL_GATHER]),
        reduce_scatter_ms=sum(durations[i] for i in by_kind[REDUCE_SCATTER]),
        all_gather_bytes=sum(timeline.collectives[i].nbytes for i in by_kind[ALL_GATHER]),
        reduce_scatter_bytes=sum(timeline.collectives[i].nbytes for i in by_kind[REDUCE_SCATTER]))


def unit_compute_ms(timeline: Timeline) -> dict[str, list[float]]:
    """Each FSDP2 unit's measured forward and backward compute, ms: ``{unit: [forward_ms, backward_ms]}``,
    and the optimizer step under ``"optimizer"``.

    Each stretch between two points goes to the innermost unit open at its start, so a unit's time
    leaves out the units nested in it (the root's forward holds every Block's). FSDP2 ends the
    backward of the root and of units whose inputs need no gradient in one final callback, out of
    nesting order: an end closes its unit wherever it stands among the open ones.
    """
    begins = {FORWARD_BEGIN: 0, BACKWARD_BEGIN: 1}
    ends = {FORWARD_END: 0, BACKWARD_END: 1}
    totals: dict[str, list[float]] = {}
    open_units: list[tuple[str, int]] = []
    previous_ms = 0.0
    for point in timeline.points:
        if open_units:
            unit, phase = open_units[-1]
            totals.setdefault(unit, [0.0, 0.0])[phase] += point.at_ms - previous_ms
        previous_ms = point.at_ms
        if point.kind in begins:
            open_units.append((point.unit, begins[point.kind]))
        elif point.kind in ends and (point.unit, ends[point.kind]) in open_units:
            position = len(open_units) - 1 - open_units[::-1].index((point.unit, ends[point.kind]))
            del open_units[position]
    optimizer = [p.at_ms for p in timeline.points if p.kind in (OPTIMIZER_BEGIN, STEP_END)]
    if len(optimizer) == 2:
        totals["optimizer"] = [optimizer[1] - optimizer[0], 0.0]
    return totals
