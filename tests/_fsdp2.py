"""FSDP2 on CPU under torch's fake process group, shared by the tests of its memory terms: the group
(``fake_group``, 8 ranks, this process rank 0), and the first AdamW step of a sharded model
(``first_step``) whose second step a test measures."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from thunder_memopt import MemoryOptimization, thunderfx_backend

WORLD_SIZE = 8


@pytest.fixture(scope="module")
def fake_group() -> Iterator[None]:
    dist.init_process_group(backend="fake", store=dist.HashStore(), rank=0, world_size=WORLD_SIZE)
    yield
    dist.destroy_process_group()


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """This rank's bytes of ``tensors``: a DTensor's local shard, another tensor whole."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def first_step(model: torch.nn.Module, units: Sequence[torch.nn.Module], memopt: MemoryOptimization,
               batch: Sequence[torch.Tensor]) -> tuple[Callable[[], None], int]:
    """``units`` sharded (zero2: ``reshard_after_forward=False``), ``model`` compiled under
    ``thunderfx_backend(memopt, fusion=False)``, and one AdamW step of it on ``batch`` (with dynamo
    reset first). Returns the step, to run again, and the bytes alive after the first: this rank's
    shards, AdamW's states (made at the first step), the buffers and the batch; a test's measured
    peak is those plus ``peak_live_bytes(step)``."""
    torch._dynamo.reset()
    for unit in units:
        fully_shard(unit, reshard_after_forward=False)
    compiled = torch.compile(model, backend=thunderfx_backend(memopt, fusion=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        compiled(*batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
    states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    resident = (local_bytes(model.parameters()) + local_bytes(states) + local_bytes(model.buffers())
                + sum(t.nbytes for t in batch))
    return step, resident
