"""Markdown tables and a PNG plot from the JSON lines that benchmark_fsdp2.py writes (the code is
``benchmarks/fsdp2/tables.py``).

    python benchmarks/make_table.py benchmarks/results/*.jsonl > benchmarks/results/table.md
    python benchmarks/make_table.py benchmarks/results/*.jsonl --plot benchmarks/results/plot.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.fsdp2

from benchmarks.fsdp2.tables_cli import main  # noqa: E402

if __name__ == "__main__":
    main()
