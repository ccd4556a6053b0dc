"""Where the loss is computed, and in which dtype, against the peak of live tensor bytes (CPU).

    python benchmarks/diagnostics/loss_placement_cpu.py

The issue's reference peaks for stablecode, 8 layers, T=8192 (eager 15.14 GiB, inductor 15.14,
thunder 26.71) sit 3.00 GiB (eager, eager-ac) and 3.76 GiB (inductor, inductor with budget,
thunder) above the benchmark's (12.14, 11.39, 22.95). 0.75 GiB is one bf16 tensor of the logits'
size (T x vocab x 2 bytes), so the gaps are 4 and 5 such units. This script measures, for one
narrowed stablecode layer with the real vocabulary (49152), the peak of live tensor bytes over a
forward and backward, in eager, under thunder.jit and under torch.compile with ThunderCompiler (the
benchmark's FSDP2 path), for each way of computing the loss, in those units. Thunder runs twice: as
on CPU, and with the cross-entropy compiled by its torchcompile_xentropy executor as on a GPU
(thunder_memopt.measure.cross_entropy_compiled_as_on_gpu).

* in-graph: the benchmark's GPTWithLoss (cross-entropy on bf16 logits inside the module);
* in-graph fp32: GPTWithLoss(upcast_logits=True);
* outside bf16 / fp32: ``logits = model(x)`` held by the training loop, then cross-entropy on them
  (``.float()`` first for fp32), as a litgpt-style loop does;
* outside litgpt chunked: litgpt's ``chunked_cross_entropy`` (chunks of 128 tokens) on held logits.

Live bytes come from torch.profiler's memory timeline (thunder_memopt.measure.peak_live_bytes,
above what is alive before the step), so they leave out allocator rounding and caching; only the
differences between the variants are read.
"""

import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from thunder_memopt.measure import cross_entropy_compiled_as_on_gpu, peak_live_bytes  # noqa: E402
from thunder_memopt.models import GPTWithLoss, build_model, narrow_config, next_token_loss, random_batch  # noqa: E402

MODEL, VOCAB, SEQ_LEN, N_EMBD = "stablecode-completion-alpha-3b", 49152, 2048, 256
MIB = 2**20
BACKENDS = ("eager", "thunder", "ThunderCompiler")  # inductor on CPU fails to compile this bf16 graph (a C++ codegen error)


def compiled(module: torch.nn.Module, backend: str):
    if backend == "eager":
        return module
    if backend == "ThunderCompiler":
        from thunder.dynamo import ThunderCompiler

        return torch.compile(module, backend=ThunderCompiler())
    import thunder

    return thunder.jit(module)


def main() -> None:
    config = narrow_config(MODEL, n_layer=1, n_embd=N_EMBD, vocab_size=VOCAB)
    gpt = build_model(config)
    x, y = random_batch(config, batch_size=1, seq_len=SEQ_LEN)
    unit = SEQ_LEN * VOCAB * 2
    print(f"{MODEL}, 1 layer, n_embd {N_EMBD}, vocab {VOCAB}, T={SEQ_LEN}, bf16, on CPU; "
          f"unit = T x vocab x 2 bytes = {unit / MIB:.0f} MiB\n")
    print("| backend | loss | peak live MiB above the step's start | above in-graph bf16, in units |\n|---|---|---|---|")
    runs = [(backend, False) for backend in BACKENDS] + [(backend, True) for backend in BACKENDS if backend != "eager"]
    for backend, as_on_gpu in runs:
        with cross_entropy_compiled_as_on_gpu() if as_on_gpu else contextlib.nullcontext():
            label = backend + (", cross-entropy compiled as on a GPU" if as_on_gpu else "")
            measure_loss_variants(gpt, backend, label, x, y, unit)


def measure_loss_variants(gpt: torch.nn.Module, backend: str, label: str, x: torch.Tensor, y: torch.Tensor,
                          unit: int) -> None:
    """One table row per way of computing the loss, in units above the benchmark's in-graph loss."""
    from litgpt.utils import chunked_cross_entropy

    model = compiled(gpt, backend)

    def outside(loss_of):
        def step():
            logits = model(x)  # held, as a training loop's variable is, until the step ends
            loss_of(logits).backward()
        return step

    in_graph, in_graph_fp32 = compiled(GPTWithLoss(gpt), backend), compiled(GPTWithLoss(gpt, upcast_logits=True), backend)
    variants = {
        "in-graph bf16 (the benchmark)": lambda: in_graph(x, y).backward(),
        "in-graph fp32": lambda: in_graph_fp32(x, y).backward(),
        "outside bf16": outside(lambda logits: next_token_loss(logits, y)),
        "outside fp32": outside(lambda logits: next_token_loss(logits, y, upcast_logits=True)),
        "outside litgpt chunked": outside(lambda logits: chunked_cross_entropy(logits, y)),
    }
    reference = None
    for name, step in variants.items():
        gpt.zero_grad(set_to_none=True)
        step()  # compiles; the parameters' .grad then exist before the measured step, as in training
        peak = peak_live_bytes(step)
        reference = peak if reference is None else reference
        print(f"| {label} | {name} | {peak / MIB:.0f} | {(peak - reference) / unit:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
