"""torchrun worker: checkpoints of FSDP2 training under thunderfx_backend(MemoryOptimization()) with
``executors(fusion=False)`` (plain Thunder's kernels, so that a resumed run can repeat the bits).

The narrowed stablecode, as the README's FSDP2 way shards it (each Block and the embedding a unit,
the head and the loss in the root's unit, ``HeadWithLoss``), trains SAVED_AFTER steps, saves the
model and the optimizer with torch.distributed.checkpoint (the sharded state dicts of
``get_model_state_dict`` / ``get_optimizer_state_dict``), and goes on to STEPS. Rank 0 also writes
the full state dict of the model at the checkpoint (``full_state_dict=True``), for the test to hold
a plain model's load against. Then a fresh model, sharded and compiled again, loads the checkpoint
and trains the remaining steps on the same batches. ``report(out)`` writes ``dcp/``, the checkpoint,
and ``full.pt`` under the directory ``out`` and gives both runs' losses and whether every rank's
parameter shards and optimizer state ended bit for bit equal (run on its own, rank 0 writes that to
``result.json`` in the directory argv[1]).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from _common import finish
from thunder_memopt import MemoryOptimization, executors, thunderfx_backend
from thunder_memopt.models import HeadWithLoss, build_model, narrow_config, random_batch, training_step

# One Block: saving, loading and resuming are checked the same at any depth.
CONFIG = narrow_config("stablecode-completion-alpha-3b", n_layer=1, n_embd=128, block_size=64)
SEQ_LEN = 64
STEPS, SAVED_AFTER = 4, 2
LR = 1e-3


def build() -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """The sharded module, its compiled form and its optimizer, from the same initial weights."""
    torch._dynamo.reset()
    gpt = build_model(CONFIG, dtype=torch.float32, seed=0)
    model = HeadWithLoss(gpt)
    for block in gpt.transformer.h:
        fully_shard(block)
    fully_shard(gpt.transformer.wte)
    fully_shard(model)
    backend = thunderfx_backend(MemoryOptimization(), executors=executors(fusion=False))
    return model, torch.compile(model, backend=backend), torch.optim.AdamW(model.parameters(), lr=LR)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return random_batch(CONFIG, batch_size=1, seq_len=SEQ_LEN, seed=100 * step + dist.get_rank())


def train(compiled: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    return [training_step(compiled, optimizer, *batch(step)).item() for step in steps]


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's parameter shards and optimizer state tensors, in a fixed order."""
    tensors = [p.detach().to_local() for p in model.parameters()]
    for parameter in model.parameters():
        state = optimizer.state[parameter]
        tensors += [value.to_local() if hasattr(value, "to_local") else value for _, value in sorted(state.items())]
    return tensors


def all_ranks(value: bool) -> bool:
    flag = torch.tensor([int(value)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def report(out: Path) -> dict:
    """Both runs (the process group initialized), the checkpoint and ``full.pt`` written under ``out``."""
    model, compiled, optimizer = build()
    losses = train(compiled, optimizer, range(SAVED_AFTER))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=out / "dcp")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, out / "full.pt")
    losses += train(compiled, optimizer, range(SAVED_AFTER, STEPS))
    uninterrupted = local_state(model, optimizer)

    model, compiled, optimizer = build()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=out / "dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    resumed = train(compiled, optimizer, range(SAVED_AFTER, STEPS))
    same = all(torch.equal(a, b) for a, b in zip(uninterrupted, local_state(model, optimizer), strict=True))
    return {"world_size": dist.get_world_size(), "losses": losses, "resumed": resumed,
            "same_final_state": all_ranks(same)}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    finish(str(out / "result.json"), report(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
