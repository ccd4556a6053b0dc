"""Command line: ``python -m thunder_memopt report [options]`` (also the ``thunder-memopt`` script)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: python -m thunder_memopt report [options]   (report --help for the options)")
        return
    command, rest = argv[0], argv[1:]
    if command != "report":
        sys.exit(f"unknown command {command!r}; the command is 'report'")
    from thunder_memopt.report import main as report_main

    report_main(rest)


if __name__ == "__main__":
    main()
