"""thunder_memopt's benchmarks: ``fsdp2`` is the FSDP2 training benchmark (run through
``benchmark_fsdp2.py`` and tabulated by ``make_table.py``); ``diagnostics/`` holds the scripts behind
specific claims, run as files."""
