"""``--find-max-block-size``: the longest sequence that trains, per backend and budget.

Each probe is one trial at one block size in fresh processes (``"search": true``: no saved-bytes
measurement, shared compile caches); only ``OOM`` means "does not fit", and any other failure stops
that backend's search, since a longer sequence would tell no more. The search doubles, then narrows
to the granularity; on a GPU it aims with the probes' peaks (``find_max_block_size``). Each search
ends in one ``"row_type": "max_block_size"`` row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Protocol

from benchmarks.fsdp2 import backends
from benchmarks.fsdp2.trial import FINAL_STATUSES, SEARCH_ROW, Trial


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    start: int  # the first block size probed, a multiple of granularity
    granularity: int  # the search narrows to this many tokens
    limit: int  # the largest block size probed


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """One backend's search, as its summary row holds it."""

    max_block_size: int | None  # the longest that fit; None if none did
    first_failing_block_size: int | None  # the shortest probed that did not; None if all did
    failure_status: str | None  # that probe's status
    probes: int


class Runs(Protocol):
    """What a search needs of the driver (tests stand in for it)."""

    def run(self, trial: Trial) -> dict: ...

    def context(self) -> dict: ...

    def record(self, key: dict, row: dict) -> None: ...


class SearchAborted(Exception):
    """A probe failed for a reason other than memory; a larger block size would not tell more."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.block_size = block_size


@dataclasses.dataclass
class ProbeMemory:
    """What the probes of one search have reported: each fitting block size's peak reserved bytes,
    and the most the allocator could hold (``reservable_bytes``), once a probe has told it."""

    peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    capacity: int | None = None


def find_max_block_size(fits: Callable[[int], bool], start: int, granularity: int, limit: int,
                        memory: ProbeMemory | None = None) -> tuple[int | None, int | None]:
    """The largest multiple of ``granularity`` that fits, and the smallest probed one that does not.

    Doubles from ``start`` while it fits (up to ``limit``), halves while it does not, then narrows
    the gap between the two to ``granularity``; each probe is one call of ``fits``. ``start`` must
    be a multiple of ``granularity``. Given ``memory``, which ``fits`` fills as it probes, the search
    aims at where the line through the two largest fitting probes' peaks reaches the capacity, since
    peak memory grows about linearly with T: the doubling jumps to 1, 2, 4... granules past that
    point, and the narrowing probes the point itself. If the device runs out before the line says
    (fragmentation, compile-time buffers), it steps down from there by 1, 2, 4... granules.
    """
    fitting, failing, past = None, None, granularity
    size = start
    while fitting is None or failing is None:
        if fits(size):
            fitting = size
            if failing is not None or size * 2 > limit:
                break
            reach = _where_peak_reaches(memory, fitting, granularity) if memory else None
            if reach is not None and size < reach + past < 2 * size:
                # Past where the line says memory ends; further past each time it fits (a line that
                # falls short), so that a pessimistic line cannot make the search crawl.
                size, past = reach + past, 2 * past
            else:
                size *= 2
        else:
            failing = size
            if fitting is not None or size == granularity:
                break
            size = max(granularity, size // 2 // granularity * granularity)
    aim, back_off = True, 0
    while fitting is not None and failing is not None and failing - fitting > granularity:
        middle = fitting + (failing - fitting) // 2 // granularity * granularity
        reach = _where_peak_reaches(memory, fitting, granularity) if aim and memory else None
        if back_off:
            probe = max(failing - back_off, middle)
        elif reach is not None:
            probe = min(max(reach, fitting + granularity), failing - granularity)
        else:
            probe = middle
        if fits(probe):
            fitting = probe
            # Past one aimed guess or a step down, bisect: a line that fell short would only crawl.
            aim, back_off = False, 0
        else:
            failing = probe
            if back_off:
                back_off *= 2
            elif reach is not None:  # the line is optimistic: step down from here
                aim, back_off = False, granularity
    return fitting, failing


def _where_peak_reaches(memory: ProbeMemory, fitting: int, granularity: int) -> int | None:
    """The block size (a multiple of ``granularity``) where the line through the two largest fitting
    probes' peaks, up to ``fitting``, reaches the capacity; None without it or two such probes."""
    capacity = memory.capacity
    known = sorted((t, p) for t, p in memory.peaks.items() if t <= fitting)
    if capacity is None or len(known) < 2:
        return None
    (t0, p0), (t1, p1) = known[-2:]
    if p1 <= p0:
        return None
    return int(t1 + (capacity - p1) * (t1 - t0) / (p1 - p0)) // granularity * granularity


def search_one(driver: Runs, settings: SearchSettings, probe: Trial) -> SearchResult:
    """The longest block size that ``probe`` (a search trial) trains at, from probes that ``driver`` runs."""
    statuses: dict[int, str] = {}
    memory = ProbeMemory()

    def fits(block_size: int) -> bool:
        row = driver.run(probe.replace(block_size=block_size))
        status = statuses[block_size] = row["status"]
        if status == "ok" and row.get("peak_reserved_max") is not None:
            memory.peaks[block_size] = row["peak_reserved_max"]
        if row.get("reservable_bytes") and memory.capacity is None:
            memory.capacity = row["reservable_bytes"]
        if status not in FINAL_STATUSES:
            raise SearchAborted(block_size)
        return status == "ok"

    try:
        largest, smallest_failing = find_max_block_size(fits, settings.start, settings.granularity, settings.limit,
                                                        memory)
    except SearchAborted as aborted:
        fitting = [size for size, status in statuses.items() if status == "ok"]
        largest, smallest_failing = max(fitting, default=None), aborted.block_size
    return SearchResult(largest, smallest_failing, statuses.get(smallest_failing), len(statuses))


def search(driver: Runs, settings: SearchSettings, trials: Iterable[Trial]) -> None:
    """A search for each trial (a backend and budget): its probes' rows, and a summary row each."""
    for trial in trials:
        probe = trial.replace(search=True, profile=False)
        result = search_one(driver, settings, probe)
        key = {"row_type": SEARCH_ROW, **probe.key(), "granularity": settings.granularity,
               "search_limit": settings.limit}
        del key["block_size"]
        summary = {**key, **driver.context(), **dataclasses.asdict(result)}
        failed = ("none failed" if result.first_failing_block_size is None
                  else f"{result.first_failing_block_size} failed ({result.failure_status})")
        print(f"longest T that fits, {backends.label(summary)}: {result.max_block_size}; {failed}", flush=True)
        driver.record(key, summary)
