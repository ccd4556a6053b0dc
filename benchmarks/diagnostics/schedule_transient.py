"""How much of each trace's transient memory the schedule pass removes, and where the peak sits.

    python benchmarks/diagnostics/schedule_transient.py

On CPU, narrowed models (n_embd 256, T=512, 4 layers, bf16, thunder.jit with MemoryOptimization()):
for the forward and the backward trace, the estimated peak above the trace's inputs (the saved
activations and cotangents, for the backward) before and after the pass, and the op at the peak.
The loss is computed outside the jitted model, as in tests/_train.py.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _train import train_step  # noqa: E402
from thunder_memopt import MemoryOptimization  # noqa: E402
from thunder_memopt.core.memory import estimate_memory  # noqa: E402

MIB = 2**20

for model, vocab in [("stablecode-completion-alpha-3b", 512), ("stablecode-completion-alpha-3b", 49152),
                     ("Llama-3-8B", 512)]:
    mo = MemoryOptimization()
    train_step(model, [mo], n_layer=4, seq_len=512, vocab_size=vocab, padded_vocab_size=vocab)
    for result, phase in zip(mo.schedule_results, ("forward", "backward")):
        inputs = estimate_memory(result.trace).input_bytes
        before, after = result.peak_before - inputs, result.peak_after - inputs
        print(f"{model} vocab {vocab} {phase}: inputs {inputs / MIB:.2f} MiB, transient {before / MIB:.2f} -> "
              f"{after / MIB:.2f} MiB ({100 * (before - after) / before:.1f}% removed); peak at {result.peak_op} "
              f"({result.peak_source})")
