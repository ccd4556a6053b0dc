"""What a transformers causal LM saves for backward, tensor by tensor, at its real width on the meta
device: thunder+memopt (``thunderfx_backend``) against plain ``ThunderCompiler`` with the same
executors, and litgpt's Block of the same model under MemoryOptimization for reference.

The memory report (``python -m thunder_memopt report``) lists saved tensors for litgpt models under
``thunder.jit``; transformers models train through ``torch.compile``, whose Thunder regions this
lists. The model is built on meta and the GPU's executors are made to claim meta tensors
(``_meta_block``: cuDNN attention, the fusion regions, never compiled), so the traces are those of
a GPU run without one, at any width and length; the figures are the memory model's
(``core.memory.saved_for_backward``), storages once, parameters apart.

Saved tensors are grouped by producing op (inside a fusion region, the op of the region that makes
the tensor), shape and dtype, and counted at one and at two decoder layers: the difference is what
each layer saves, the rest is saved once per model (embedding, final norm, rotary tables, loss
head). The benchmark's "saved MiB/layer" is the whole model's over its layers, once-per-model
tensors included:

    python benchmarks/diagnostics/saved_tensors_hf_cpu.py --model-name Llama-3-8B --block-size 8192 --n-layer 4
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import thunder
import torch
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx
from thunder.dynamo import ThunderCompiler

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import thunder_memopt.transform as transform_module  # noqa: E402
from _meta_block import META_FUSION, run_block_on_meta  # noqa: E402
from benchmarks.fsdp2 import hf_models  # noqa: E402
from thunder_memopt import MemoryOptimization, thunderfx_backend  # noqa: E402
from thunder_memopt.arguments import positive_int  # noqa: E402
from thunder_memopt.core.memory import saved_for_backward, storage_roots  # noqa: E402
from thunder_memopt.core.trace import tensor_outs  # noqa: E402
from thunder_memopt.executors import cudnn_attention_ex, linear_cross_entropy_ex  # noqa: E402

MIB = 2**20
# (producing op, the op that made its storage, shape, dtype): one group of saved tensors. The two ops
# differ for a view (its base's op) and for a region output written into a dead input (the donate
# pass: the input's op).
Group = tuple[str, str, tuple[int, ...], str]


def _producing_op(bsym: BoundSymbol, name: str) -> str:
    """The innermost op of ``bsym`` that outputs ``name``: a fusion region's own op, not its name."""
    for sub in bsym.subsymbols:
        if name in {t.name for t in tensor_outs(sub)}:
            return _producing_op(sub, name)
    return bsym.sym.name


def saved_groups(forward: TraceCtx) -> Counter[tuple[Group, int]]:
    """Each saved storage of an augmented forward trace, as (group, bytes) with its count."""
    infos = storage_roots(forward)
    producers = {t.name: b for b in forward.bound_symbols for t in tensor_outs(b)}
    counts: Counter[tuple[Group, int]] = Counter()
    seen: set[str] = set()
    for t in saved_for_backward(forward, infos=infos).tensors:
        if t.is_parameter or t.storage in seen or t.storage_nbytes == 0:
            continue
        seen.add(t.storage)
        op, storage_op = (_producing_op(producers[n], n) if n in producers else "input" for n in (t.name, t.storage))
        counts[(op, storage_op, tuple(t.shape), str(t.dtype).rsplit(".", 1)[-1]), t.storage_nbytes] += 1
    return counts


def _meta_executors() -> list:
    """The GPU's executors, claiming meta tensors, their regions never compiled (as ``_meta_block``)."""
    transform_module.compile_ahead = lambda traces: 0
    cudnn_attention_ex.implmap[thunder.torch.scaled_dot_product_attention.id].checker = lambda *a, **k: True
    return [linear_cross_entropy_ex, cudnn_attention_ex, META_FUSION, *thunder.get_default_executors()]


def hf_saved(model_name: str, block_size: int, n_layer: int, make_backend: Callable) -> Counter:
    """The saved groups of every Thunder region of one forward of the transformers model on meta."""
    torch._dynamo.reset()
    config = hf_models.config(model_name, n_layer=n_layer, n_embd=None, block_size=block_size)
    model = hf_models.build(model_name, config, dtype=torch.bfloat16, device="meta", seed=0)
    tokens = torch.zeros(1, block_size, dtype=torch.long, device="meta")
    backend = make_backend()
    torch.compile(model, backend=backend)(input_ids=tokens, labels=tokens)
    compiler = getattr(backend, "compiler", backend)
    counts: Counter = Counter()
    for info in compiler.subgraph_infos:
        for fn in info.thunder_compiled_fns:
            forward = thunder.last_traces(fn)[-1]
            if thunder.last_backward_traces(fn):
                counts += saved_groups(forward)
    return counts


def _table(per_layer: Counter, once: Counter, n_layer: int, top: int) -> list[str]:
    rows = [("layer", g, nbytes, c) for (g, nbytes), c in per_layer.items()]
    rows += [("model", g, nbytes, c) for (g, nbytes), c in once.items()]
    rows.sort(key=lambda r: -r[2] * r[3])
    lines = ["| saved | count | storage MiB each | MiB | producing op | storage made by | shape | dtype |",
             "|---|---|---|---|---|---|---|---|"]
    for where, (op, storage_op, shape, dtype), nbytes, count in rows[:top]:
        lines.append(f"| per {where} | {count} | {nbytes / MIB:.1f} | {nbytes * count / MIB:.1f} | {op} "
                     f"| {storage_op} | {shape} | {dtype} |")
    layer = sum(nbytes * c for (_, nbytes), c in per_layer.items())
    model = sum(nbytes * c for (_, nbytes), c in once.items())
    lines += ["", f"per decoder layer {layer / MIB:.1f} MiB; once per model {model / MIB:.1f} MiB; "
              f"at {n_layer} layers {(model + n_layer * layer) / MIB:.1f} MiB, "
              f"{(model / n_layer + layer) / MIB:.1f} MiB per layer as the benchmark counts it"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", type=hf_models.model_name, default="Llama-3-8B")
    parser.add_argument("--block-size", type=positive_int, default=8192, help="sequence length T")
    parser.add_argument("--n-layer", type=positive_int, default=4, help="layers of the model the totals are for")
    parser.add_argument("--top", type=positive_int, default=16, help="rows of each table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    executors = _meta_executors()
    setups = {
        "thunder+memopt (thunderfx_backend)": lambda: thunderfx_backend(executors=executors),
        "plain ThunderCompiler, the same executors": lambda: ThunderCompiler(executors=executors),
    }
    print(f"# transformers {args.model_name}, real width, T={args.block_size}, bf16, on meta: saved for backward\n")
    for name, make_backend in setups.items():
        one, two = (hf_saved(args.model_name, args.block_size, n, make_backend) for n in (1, 2))
        per_layer, once = two - one, one - (two - one)
        print(f"## {name}\n")
        print("\n".join(_table(per_layer, once, args.n_layer, args.top)), end="\n\n")
    block = run_block_on_meta(args.model_name, args.block_size, MemoryOptimization())
    litgpt = saved_for_backward(thunder.last_traces(block)[-1]).activation_bytes
    print(f"## litgpt Block of {args.model_name}, MemoryOptimization(), cos and sin given\n")
    print(f"per layer {litgpt / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
