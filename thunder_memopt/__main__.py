"""Command line: ``python -m thunder_memopt report|plan [options]`` (also the ``thunder-memopt`` script).

Subcommands are argparse's: an unknown one, like a bad flag, is a one-line usage error (exit 2).
Each subcommand parses its own options, so ``report --help`` lists the report's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import thunder_memopt

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m thunder_memopt",
                                     description=thunder_memopt.__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"thunder_memopt {thunder_memopt.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The report's own parser (thunder_memopt.report.parse_args) documents and checks its options.
    commands.add_parser("report", add_help=False, help="what a litgpt model saves and its step's peak, "
                        "plain Thunder against MemoryOptimization (report --help for its options)")
    commands.add_parser("plan", add_help=False, help="a training step's predicted per-rank peak allocated memory "
                        "and the plan memory_limit takes, before launch, without a GPU (plan --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # This parser reads up to the subcommand; the subcommand's own parser reads the rest.
    end = next((i + 1 for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    command = _parser().parse_args(argv[:end]).command
    if command == "report":
        from thunder_memopt.report import main as report_main

        report_main(argv[end:])
    elif command == "plan":
        from thunder_memopt.plan import main as plan_main

        plan_main(argv[end:])


if __name__ == "__main__":
    main()
