"""Peak memory against step time for one invocation's rows: the Pareto front, and whether
thunder_memopt is the fastest choice at every memory level (``benchmarks/make_pareto.py``).

    python benchmarks/make_pareto.py benchmarks/results/stablecode_8l_zero2_1xH200_T8192_pareto.jsonl \\
        --plot benchmarks/results/stablecode_8l_zero2_1xH200_T8192_pareto.png

Each row that ran ok is a point: its memory is the allocator's peak (``peak_alloc_max``, max over
ranks), its time the median step (``step_ms``), its label the tables' (``backends.label``). The
claim checked is: at every memory level, the fastest of our backends (``OURS``: thunder+memopt
and thunder+memopt-offload) that fits in that memory is at or below the fastest other backend
that fits. The levels are the points' own memories: between two of them, the set of points that
fit does not change, so these levels are all the comparisons there are.

Step times of two invocations differ by the machine's noise, and points of two configurations do
not compete for one memory, so ``analyse`` takes the rows of one invocation (``tables.same_invocation``)
and one configuration (block size included) and rejects a mix with a ValueError.

The analysis is pure (frozen dataclasses, no I/O); ``plot`` imports matplotlib when it draws
(``plots.pyplot``). Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.fsdp2 import backends, plots, tables
from benchmarks.fsdp2.tables import GIB, MISSING, number

OURS = ("thunder+memopt", "thunder+memopt-offload")
OURS_NAME = "thunder+memopt"  # the family's name in the verdict


@dataclasses.dataclass(frozen=True)
class Point:
    """One row that ran ok, on the figure."""

    label: str  # backends.label: backend, @budget and options
    memory: int  # peak allocated bytes, max over ranks
    step_ms: float  # median step
    ours: bool  # a backend of OURS

    @property
    def memory_gib(self) -> float:
        return self.memory / GIB


@dataclasses.dataclass(frozen=True)
class Level:
    """At one memory level, the fastest of ours and the fastest other point that fit in it (memory <= level)."""

    memory: int  # bytes
    ours: Point | None
    other: Point | None

    @property
    def ratio(self) -> float | None:
        """Our step as a multiple of the other's; None where either side has no point that fits."""
        if self.ours is None or self.other is None:
            return None
        return self.ours.step_ms / self.other.step_ms

    @property
    def miss(self) -> bool:
        """Another backend fits and is strictly faster than ours, or fits where none of ours does."""
        if self.other is None:
            return False
        return self.ours is None or self.ours.step_ms > self.other.step_ms


@dataclasses.dataclass(frozen=True)
class Pareto:
    """The analysis of one invocation's rows of one configuration."""

    rows: tuple[dict, ...]  # the measured rows analysed, ok or not
    points: tuple[Point, ...]  # by memory, then step
    front: tuple[Point, ...]  # the points no other dominates, by memory
    levels: tuple[Level, ...]  # one per distinct point memory, rising

    @property
    def misses(self) -> tuple[Level, ...]:
        return tuple(level for level in self.levels if level.miss)

    @property
    def left_out(self) -> tuple[dict, ...]:
        """Rows that are not points: they did not run ok (or ran on CPU, with no allocator peak)."""
        return tuple(row for row in self.rows if not is_point(row))


def is_point(row: dict) -> bool:
    return tables.has_peak(row) and row.get("step_ms") is not None


def describe_config(row: dict) -> str:
    return f"{tables.heading(row)} · T={row['block_size']}"


def check_one_setup(rows: list[dict]) -> None:
    """Raise ValueError unless ``rows`` are of one configuration and one invocation, and have a date
    each (which tells their invocation)."""
    if not rows:
        raise ValueError("no measured rows (row_type 'run', not a --find-max-block-size probe)")
    configs = {tables.config_of(row, with_block_size=True) for row in rows}
    if len(configs) > 1:
        fields = ", ".join(plots.varying_fields(rows))
        raise ValueError(f"rows of {len(configs)} configurations (they differ in {fields}): "
                         "a Pareto figure takes one configuration's rows")
    undated = next((row for row in rows if not row.get("date")), None)
    if undated is not None:
        raise ValueError(f"the row of {backends.label(undated)} has no date, so its invocation cannot be told")
    for index, first in enumerate(rows):
        for second in rows[index + 1:]:
            if not tables.same_invocation(first, second):
                apart = ("other command lines" if tables.invocation_command(first) != tables.invocation_command(second)
                         else f"more than {tables.INVOCATION_SECONDS // 60} minutes apart")
                raise ValueError(
                    f"rows of more than one invocation ({backends.label(first)} at {first['date'][:16]} and "
                    f"{backends.label(second)} at {second['date'][:16]}: {apart}): "
                    "a Pareto figure takes one invocation's rows")


def points_of(rows: Iterable[dict]) -> tuple[Point, ...]:
    """The rows that ran ok with an allocator peak, as points by memory then step; ValueError where
    two have one label (``tables.latest`` keeps the last of a measurement) or none is a point."""
    points = [Point(backends.label(row), row["peak_alloc_max"], row["step_ms"], row["backend"] in OURS)
              for row in rows if is_point(row)]
    labels = [point.label for point in points]
    repeated = next((label for label in labels if labels.count(label) > 1), None)
    if repeated is not None:
        raise ValueError(f"two rows of {repeated}: pass the latest of each measurement (tables.latest)")
    if not points:
        raise ValueError("no row ran ok with an allocator peak (rows from a GPU): nothing to plot")
    return tuple(sorted(points, key=lambda point: (point.memory, point.step_ms, point.label)))


def dominates(a: Point, b: Point) -> bool:
    """``a`` needs no more memory and no more time than ``b``, and strictly less of one."""
    return (a.memory <= b.memory and a.step_ms <= b.step_ms
            and (a.memory < b.memory or a.step_ms < b.step_ms))


def pareto_front(points: Iterable[Point]) -> tuple[Point, ...]:
    """The points that no other dominates, by memory (equal points are both on it)."""
    points = list(points)
    front = [point for point in points if not any(dominates(other, point) for other in points)]
    return tuple(sorted(front, key=lambda point: (point.memory, point.step_ms, point.label)))


def fastest(points: Iterable[Point]) -> Point | None:
    """The fastest point; of equal steps the smaller memory, then the label (for a stable answer)."""
    return min(points, key=lambda point: (point.step_ms, point.memory, point.label), default=None)


def compare_levels(points: Iterable[Point]) -> tuple[Level, ...]:
    """At each distinct memory of the points, rising: the fastest of ours and of the others that fit."""
    points = list(points)
    levels = []
    for memory in sorted({point.memory for point in points}):
        fitting = [point for point in points if point.memory <= memory]
        levels.append(Level(memory, fastest(p for p in fitting if p.ours), fastest(p for p in fitting if not p.ours)))
    return tuple(levels)


def analyse(rows: Iterable[dict]) -> Pareto:
    """The front and the per-level comparison of the measured rows (``tables.measured_rows``) of one
    invocation and configuration; ValueError for a mix, or where no row is a point."""
    runs = tables.measured_rows(list(rows))
    check_one_setup(runs)
    points = points_of(runs)
    return Pareto(tuple(runs), points, pareto_front(points), compare_levels(points))


def point_name(point: Point | None) -> str:
    return MISSING if point is None else point.label


def step_of(point: Point | None) -> str:
    return MISSING if point is None else f"{point.step_ms:.1f}"


def ratio_cell(level: Level) -> str:
    return MISSING if level.ratio is None else f"{level.ratio:.3f}x"


def level_verdict(level: Level) -> str:
    if not level.miss:
        return "at or below"
    return f"MISS: no {OURS_NAME} point fits" if level.ours is None else "MISS: slower"


def describe_miss(level: Level) -> str:
    at = f"at {level.memory / GIB:.2f} GiB"
    if level.ours is None:
        return f"{at} no {OURS_NAME} point fits while {level.other.label} does ({level.other.step_ms:.1f} ms)"
    return (f"{at} {level.ours.label} takes {level.ours.step_ms:.1f} ms against {level.other.label}'s "
            f"{level.other.step_ms:.1f} ms ({level.ratio:.3f}x)")


def verdict(result: Pareto) -> str:
    """One paragraph: whether ours is at or below the fastest other backend at every memory level, or the misses."""
    family = f"{OURS_NAME}'s step (the fastest of {' and '.join(OURS)} that fits)"
    if not any(level.other is not None for level in result.levels):
        return f"**Verdict:** no other backend ran ok, so there is nothing to compare {OURS_NAME} with."
    span = f"{result.levels[0].memory / GIB:.2f} to {result.levels[-1].memory / GIB:.2f} GiB"
    misses = result.misses
    if not misses:
        return (f"**Verdict:** at every memory level ({len(result.levels)} levels, {span}), {family} is at or "
                "below the fastest other backend that fits in that memory.")
    return (f"**Verdict:** not at every memory level: at {len(misses)} of the {len(result.levels)} levels ({span}), "
            f"{family} is not at or below the fastest other backend that fits in that memory: "
            + "; ".join(describe_miss(level) for level in misses) + ".")


POINT_COLUMNS: list[tuple[str, Callable[[tuple[Point, bool]], str]]] = [
    ("backend", lambda pair: pair[0].label),
    ("peak alloc GiB, max", lambda pair: f"{pair[0].memory_gib:.2f}"),
    ("step ms", lambda pair: f"{pair[0].step_ms:.1f}"),
    ("on the front", lambda pair: "yes" if pair[1] else "no"),
]

LEVEL_COLUMNS: list[tuple[str, Callable[[Level], str]]] = [
    ("memory level GiB", lambda level: number(level.memory, ".2f", GIB)),
    (f"fastest {OURS_NAME}", lambda level: point_name(level.ours)),
    ("ours step ms", lambda level: step_of(level.ours)),
    ("fastest other", lambda level: point_name(level.other)),
    ("other step ms", lambda level: step_of(level.other)),
    ("ours / other step", ratio_cell),
    ("verdict", level_verdict),
]


def why_left_out(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    return "no allocator peak" if row.get("peak_alloc_max") is None else "no step time"


def dates(result: Pareto) -> str:
    """The invocation's first and last row times, UTC."""
    stamps = sorted(row["date"] for row in result.rows)
    first, last = stamps[0], stamps[-1]
    return f"{first[:10]} {first[11:16]}" + ("" if last[:16] == first[:16] else f"-{last[11:16]}") + " UTC"


def markdown(result: Pareto) -> str:
    """The heading, every point (on the front or not), the per-level comparison and the verdict."""
    first = result.rows[0]
    front = set(result.front)
    sections = [
        f"#### {describe_config(first)}: peak memory against step time",
        f"One invocation, {dates(result)}. Memory: peak allocated, max over ranks; step: the median. "
        "On the front: no other point needs no more memory and no more time, and less of one.",
        tables.table(POINT_COLUMNS, [(point, point in front) for point in result.points]),
    ]
    if result.left_out:
        sections.append("Not points (did not run ok, or no allocator peak): "
                        + ", ".join(f"{backends.label(row)} ({why_left_out(row)})" for row in result.left_out) + ".")
    sections += [
        f"##### At each memory level: the fastest of {' and '.join(OURS)} that fits, against the fastest "
        "other backend that fits",
        tables.table(LEVEL_COLUMNS, list(result.levels)),
        verdict(result),
    ]
    return "\n\n".join(sections)


def front_steps(result: Pareto) -> tuple[list[float], list[float]]:
    """The front as a staircase, GiB and ms: each front point's step holds until the next needs more
    memory, and the last one holds to the largest point's memory."""
    xs = [point.memory_gib for point in result.front]
    ys = [point.step_ms for point in result.front]
    largest = result.points[-1].memory_gib
    if largest > xs[-1]:
        xs.append(largest)
        ys.append(ys[-1])
    return xs, ys


def plot(result: Pareto, path: Path) -> None:
    """Memory (x, GiB) against step (y, ms): ours in one colour, the others in another, the front as
    a step line, each point labelled. ImportError where matplotlib is missing."""
    plt = plots.pyplot()
    figure, axis = plt.subplots(figsize=(11, 6.5))
    for ours, colour, name in ((False, "C0", "other backends"), (True, "C3", " and ".join(OURS))):
        mine = [point for point in result.points if point.ours == ours]
        if mine:
            axis.scatter([p.memory_gib for p in mine], [p.step_ms for p in mine], color=colour, zorder=3, label=name)
        for point in mine:
            axis.annotate(point.label, (point.memory_gib, point.step_ms), textcoords="offset points", xytext=(5, 4),
                          fontsize=7, color=colour)
    xs, ys = front_steps(result)
    axis.step(xs, ys, where="post", color="grey", linestyle="--", zorder=2, label="Pareto front")
    axis.margins(x=0.08)  # room for the rightmost point's label
    axis.set_xlabel("peak allocated, max over ranks (GiB)")
    axis.set_ylabel("median step time (ms)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    misses = len(result.misses)
    outcome = (f"{OURS_NAME} at or below the fastest other backend at every memory level" if not misses
               else f"{OURS_NAME} not at or below the fastest other backend at {misses} of {len(result.levels)} "
                    "memory levels")
    title = textwrap.fill(describe_config(result.rows[0]), 150)
    figure.suptitle(f"{title}\n{dates(result)}: {outcome}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
