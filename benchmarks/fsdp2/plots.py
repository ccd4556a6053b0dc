"""The benchmark's PNG plots (``make_table.py --plot``, and the driver's at the end of a run): peak
memory and step time per backend, memory against block size, memory per token, and the probes of
``--find-max-block-size``.

matplotlib is imported when a plot is drawn, on its file-only backend (no display on the GPU host or
in CI); nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from benchmarks.fsdp2 import backends
from benchmarks.fsdp2.tables import (CONFIG_FIELDS, GIB, LINE_STYLES, MB, MISSING, NOT_MEASURED, SETTING_NAMES,
                                     TokenSlope, by_config, has_peak, heading, measured_rows, search_results,
                                     summary_order, token_slopes)
from benchmarks.fsdp2.trial import RUN_ROW, field_value


def varying_fields(rows: list[dict]) -> list[str]:
    return [field for field in (*CONFIG_FIELDS, "block_size") if len({field_value(row, field) for row in rows}) > 1]


def setting_label(row: dict, fields: list[str]) -> str:
    return " ".join(f"{SETTING_NAMES[field]}{field_value(row, field)}" for field in fields)


def bar_panel(axis, rows: list[dict], value: Callable[[dict], float | None], ylabel: str) -> None:
    """Bars per backend label, one per setting (what else varies between the rows); OOM rows marked."""
    labels = list(dict.fromkeys(backends.label(row) for row in sorted(rows, key=summary_order)))
    fields = varying_fields(rows)
    settings = list(dict.fromkeys(setting_label(row, fields) for row in rows))
    width = 0.8 / len(settings)
    plotted = False
    for index, setting in enumerate(settings):
        by_label = {backends.label(row): row for row in rows if setting_label(row, fields) == setting}
        legend_entry = setting  # on the setting's first bar only
        for position, label in enumerate(labels):
            row = by_label.get(label)
            x = position - 0.4 + width * (index + 0.5)
            if row is None:
                continue
            if row["status"] != "ok":
                axis.text(x, 0, row["status"], rotation=90, ha="center", va="bottom", fontsize=8)
            elif value(row) is not None:
                axis.bar(x, value(row), width, color=f"C{index}", label=legend_entry)
                legend_entry, plotted = None, True
    axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axis.set_xlim(-0.5, len(labels) - 0.5)
    axis.set_ylabel(ylabel)
    if not plotted:
        axis.text(0.5, 0.5, NOT_MEASURED, transform=axis.transAxes, ha="center")
    elif fields:
        axis.legend(fontsize=8)


def coloured_labels(rows: list[dict]) -> list[str]:
    """The labels of the rows with an allocator peak, in the tables' order: label i is drawn in colour Ci."""
    return list(dict.fromkeys(backends.label(row) for row in sorted(filter(has_peak, rows), key=summary_order)))


def block_size_panel(axis, rows: list[dict]) -> None:
    """Peak allocated memory against block size: a colour per backend label, a line style per setting."""
    fields = [field for field in varying_fields(rows) if field != "block_size"]
    measured = list(filter(has_peak, rows))
    labels = coloured_labels(rows)
    settings = list(dict.fromkeys(setting_label(row, fields) for row in measured))
    for label_index, label in enumerate(labels):
        for setting_index, setting in enumerate(settings):
            points = sorted((row for row in measured
                             if backends.label(row) == label and setting_label(row, fields) == setting),
                            key=lambda row: row["block_size"])
            if points:
                axis.plot([row["block_size"] for row in points], [row["peak_alloc_max"] / GIB for row in points],
                          marker="o", color=f"C{label_index}", linestyle=LINE_STYLES[setting_index % len(LINE_STYLES)],
                          label=f"{label} {setting}".strip())
    axis.set_xlabel("block size T (tokens)")
    axis.set_ylabel("peak allocated, max over ranks (GiB)")
    if measured:
        axis.legend(fontsize=7)
    else:
        axis.text(0.5, 0.5, NOT_MEASURED, transform=axis.transAxes, ha="center")


def per_token_panel(axis, slopes: list[TokenSlope], fields: list[str], labels: list[str]) -> None:
    """A bar of memory per token (MB) per backend label and invocation, in the colour of its line in
    block_size_panel (``labels``: coloured_labels); ``fields``: the configuration fields that vary
    between the slopes, named under the bars."""
    slopes = sorted(slopes, key=lambda slope: summary_order(slope.first))
    names = [f"{slope.label} {setting_label(slope.first, fields)}".strip() for slope in slopes]
    if len(set(names)) < len(names):  # one label from several invocations
        names = [f"{name} {slope.first['date'][5:16]}" for name, slope in zip(names, slopes)]
    values = [slope.bytes_per_token() for slope in slopes]
    for position, (slope, value) in enumerate(zip(slopes, values)):
        if value is not None:
            axis.bar(position, value / MB, 0.6, color=f"C{labels.index(slope.label)}")
        else:
            axis.text(position, 0, "not measured" if slope.not_measured() else MISSING, rotation=90, ha="center",
                      va="bottom", fontsize=8)
    axis.set_xticks(range(len(names)), names, rotation=30, ha="right")
    axis.set_xlim(-0.5, len(names) - 0.5)
    axis.set_ylabel("memory per token, MB (10^6 bytes): slope of the peak")
    if all(value is None for value in values):
        axis.text(0.5, 0.5, NOT_MEASURED, transform=axis.transAxes, ha="center")


def pyplot():
    """matplotlib.pyplot on the file-only backend (no display on the GPU host or in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(rows: list[dict], path: Path) -> None:
    """Peak memory and step time per backend, memory against block size when several were run, and
    memory per token where one invocation ran a backend at several."""
    plt = pyplot()
    runs = measured_rows(rows)
    several_block_sizes = len({row["block_size"] for row in runs}) > 1
    slopes = [slope for group in by_config(rows) for slope in token_slopes(group)]
    panels = 2 + several_block_sizes + bool(slopes)
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 5))
    bar_panel(axes[0], runs, lambda r: None if r.get("peak_alloc_max") is None else r["peak_alloc_max"] / GIB,
              "peak allocated, max over ranks (GiB)")
    bar_panel(axes[1], runs, lambda r: r.get("step_ms"), "median step time (ms)")
    if several_block_sizes:
        block_size_panel(axes[2], runs)
    if slopes:
        per_token_panel(axes[-1], slopes, [field for field in varying_fields(runs) if field != "block_size"],
                        coloured_labels(runs))
    varying = varying_fields(runs)
    common = [field for field in CONFIG_FIELDS if field not in varying]
    figure.suptitle(setting_label(runs[0], common), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_search(rows: list[dict], path: Path) -> None:
    """--find-max-block-size: each backend's probes, peak reserved against T (a cross where it ran out
    of memory), the longest T that fit marked, and the most the allocator could reserve."""
    plt = pyplot()
    probes = [row for row in rows if row.get("row_type") == RUN_ROW and row.get("search")]
    figure, axis = plt.subplots(figsize=(10, 5))
    for index, result in enumerate(search_results(rows)):
        label, colour = backends.label(result), f"C{index}"
        mine = sorted((row for row in probes if backends.label(row) == label), key=lambda row: row["block_size"])
        fitting = [row for row in mine if row["status"] == "ok" and row.get("peak_reserved_max") is not None]
        axis.plot([row["block_size"] for row in fitting], [row["peak_reserved_max"] / GIB for row in fitting],
                  marker="o", color=colour, label=f"{label}: longest T {result['max_block_size']}")
        for row in mine:
            if row["status"] != "ok":
                axis.plot(row["block_size"], fitting[-1]["peak_reserved_max"] / GIB if fitting else 0,
                          marker="x", color=colour, markersize=9)
        if result["max_block_size"] is not None:
            axis.axvline(result["max_block_size"], color=colour, linestyle=":")
    reservable = [row["reservable_bytes"] for row in probes if row.get("reservable_bytes")]
    if reservable:
        axis.axhline(min(reservable) / GIB, color="grey", linestyle="--", label="reservable (free + held)")
    axis.set_xlabel("block size T (tokens); x: out of memory")
    axis.set_ylabel("peak reserved, max over ranks (GiB)")
    axis.legend(fontsize=8)
    first = probes[0] if probes else rows[0]
    figure.suptitle(f"longest T that fits\n{heading(first)}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
