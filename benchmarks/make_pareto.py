"""Peak memory against step time for one invocation of benchmark_fsdp2.py: a markdown table of
every point and its Pareto front, whether thunder+memopt is the fastest backend at every memory
level, and optionally the scatter plot (the code is ``benchmarks/fsdp2/pareto.py``).

    python benchmarks/make_pareto.py benchmarks/results/stablecode_8l_zero2_1xH200_T8192_pareto.jsonl \\
        --plot benchmarks/results/stablecode_8l_zero2_1xH200_T8192_pareto.png

Bad input (a missing or unreadable file, rows of several invocations, no row that ran ok) is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.fsdp2

from benchmarks.fsdp2 import pareto, tables  # noqa: E402
from benchmarks.fsdp2.trial import load_rows  # noqa: E402

EXIT_BAD_INPUT = 2


def fail(message: str) -> int:
    print(f"make_pareto.py: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_pareto.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a JSON lines file of one invocation of benchmark_fsdp2.py")
    parser.add_argument("--plot", type=Path, help="also write this PNG: memory against step time")
    args = parser.parse_args(argv)
    try:
        rows = tables.latest(load_rows([args.results]))
        result = pareto.analyse(rows)
    except OSError as error:
        return fail(f"cannot read {args.results}: {error.strerror or error}")
    except ValueError as error:  # json's decode errors among them
        return fail(f"{args.results}: {error}")
    except (KeyError, TypeError, AttributeError) as error:
        # A row without a field the tables need, or of the wrong type: not the benchmark's output.
        return fail(f"{args.results}: a row that is not benchmark_fsdp2.py's ({type(error).__name__}: {error})")
    print(pareto.markdown(result))
    if args.plot is not None:
        try:
            pareto.plot(result, args.plot)
        except ImportError:
            print("WARNING: matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
