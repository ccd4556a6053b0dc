"""The FSDP2 benchmark: peak memory and speed of one sharded training step of a litgpt model or a
transformers causal LM, per compiler backend, each row in fresh processes.

    backends      the registry: each backend's name, how to build it, its budgets and its own options
    trial         the row schema: a trial's settings in small groups, its measurements, reading rows back
    cli           the command line (``benchmarks/benchmark_fsdp2.py``): flags -> trials
    driver        runs each trial in fresh processes of the worker and appends its row to --out
    worker        one trial on every rank: build, shard, compile, train, measure
    fit_rows      what a thunder+memopt-fit row records of its plan and its checks (the fit_* fields)
    compile_rows  what a row records of how it compiled: ThunderFX's regions, attentions, offload plans
    hf_models     the transformers models (--model-source transformers): their widths, build, FSDP2 units
    profiling     what --profile and --memory-snapshot record
    search        --find-max-block-size: the longest sequence that fits
    tables        markdown tables and plots of the rows (``benchmarks/make_table.py``)
    long_run      the long-run check (``benchmarks/long_run.py``) on the ranks: many steps on real text;
                  long_run_driver runs each setting, long_run_report gives the verdict and the plot

The modules import one another as ``benchmarks.fsdp2.*``, so the repository root must be on the
path: the two scripts put it there, and the driver gives it to the workers.
"""
