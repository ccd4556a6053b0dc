"""The FSDP2 benchmark's command line: peak memory and speed of one sharded training step per
compiler backend, each row in fresh processes (the code is the package ``benchmarks/fsdp2``).

    torchrun --nproc-per-node 2 benchmarks/benchmark_fsdp2.py --n-layer 8 --block-size 8192 \\
        --shard-mode zero2 --compile eager eager-ac inductor inductor-budget thunder thunder+memopt \\
        --out benchmarks/results/stablecode_8l.jsonl

See benchmarks/README.md for the options, the rows and the committed runs, and
benchmarks/make_table.py for tables and plots.
"""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) != 0:
        sys.exit(0)  # under torchrun, rank 0 drives (the trials start their own ranks): no imports here
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.fsdp2, thunder_memopt
    from benchmarks.fsdp2.cli import main

    sys.exit(main())
