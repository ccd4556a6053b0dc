"""``benchmarks/make_table.py``'s command line: tables (``tables.py``) and a plot (``plots.py``) of
the benchmark's JSON lines."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.fsdp2 import backends, plots, tables, validation
from benchmarks.fsdp2.trial import RUN_ROW, SEARCH_ROW, load_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=tables.__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="JSON lines files from benchmark_fsdp2.py")
    parser.add_argument("--plot", type=Path, help="also write this PNG")
    parser.add_argument("--summary", action="store_true",
                        help="one row per backend, a column per block size: peak GiB / step ms")
    parser.add_argument("--latest-code", action="store_true",
                        help="leave out thunder+memopt rows written before thunder_memopt's executors")
    parser.add_argument("--against", choices=list(backends.BACKENDS), metavar="BACKEND",
                        help="each backend's peak and step as a multiple of this one's, between rows of one invocation")
    parser.add_argument("--simulation-error", action="store_true",
                        help="each simulated row's peaks and step against the real row of the same setup "
                             "(give both files)")
    args = parser.parse_args(argv)
    # The long run's files (benchmarks/long_run.py) may be among the globbed ones: their rows are not tables'.
    rows = tables.latest([row for row in load_rows(args.results) if row.get("row_type") in (RUN_ROW, SEARCH_ROW)])
    if args.latest_code:
        rows = [row for row in rows if tables.written_by_current_code(row)]
    if args.simulation_error:
        print(validation.markdown(rows))
    elif args.against:
        print(tables.ratios(rows, args.against))
    else:
        print(tables.summary(rows) if args.summary else tables.markdown(rows))
    if args.plot is not None and tables.measured_rows(rows):
        plots.plot(rows, args.plot)
    elif args.plot is not None and tables.search_results(rows):
        plots.plot_search(rows, args.plot)


