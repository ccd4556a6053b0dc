"""torchrun worker: a narrowed transformers Llama (tests/_hf.py) under FSDP2, ``fully_shard`` on each
decoder layer and on the root, as transformers models are sharded, called as
``model(input_ids=x, labels=x)``: three AdamW steps under plain ThunderCompiler and under
thunderfx_backend with fusion off and cuDNN attention asked for (so that the causal-mask pass runs).

``report`` gives (rank 0 writes it to argv[1] when run on its own) each backend's losses, the
largest difference of the sharded parameters after the steps (over every rank), the bytes rank 0
saves for backward in the last step, and how the step compiles: dynamo graphs, Thunder regions, and
attentions whose mask the pass proved causal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import thunder
import torch
import torch._dynamo
import torch.distributed as dist
from thunder.dynamo import ThunderCompiler
from torch.distributed.fsdp import fully_shard

from _common import finish, max_grad_diff
from thunder_memopt import thunderfx_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the models the tests share
from _hf import build, tokens, train_steps  # noqa: E402

STEPS = 3


def train(backend) -> dict:
    torch._dynamo.reset()
    model = build("llama")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    losses, saved = train_steps(model, backend, tokens(model, 2, 32), STEPS,
                                [p.to_local() for p in model.parameters()])
    losses = [loss.item() for loss in losses]
    compiler = getattr(backend, "compiler", backend)
    fns = [fn for info in compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    proven = {id(t) for fn in fns for t in thunder.last_traces(fn) if "causal_mask" in str(t.get_provenance())}
    return {
        "losses": losses,
        "parameters": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
        "saved_bytes": saved,
        "graphs": len(compiler.subgraph_infos),
        "regions": len(fns),
        "proven_traces": len(proven),
    }


def report() -> dict:
    """Both backends' training, compared (the process group initialized)."""
    results = {name: train(backend) for name, backend in (
        ("plain", ThunderCompiler()), ("memopt", thunderfx_backend(fusion=False, cudnn_attention=True)))}
    compared = {name: {k: v for k, v in r.items() if k != "parameters"} for name, r in results.items()}
    compared["max_parameter_diff"] = max_grad_diff(results["plain"]["parameters"], results["memopt"]["parameters"])
    return compared


def main(path: str) -> None:
    dist.init_process_group("gloo")
    finish(path, report())


if __name__ == "__main__":
    main(sys.argv[1])
