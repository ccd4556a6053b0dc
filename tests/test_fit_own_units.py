"""A program is planned with its own model's FSDP2 units only (``fit.fsdp2_units``): a plain
``thunder.jit`` model compiled under ``memory_limit`` in a process that also holds an unrelated
FSDP2 model (sharded under torch's fake process group, run once) is planned as in a process
without it: AdamW's states of its own parameters, one call per step, no FSDP2 terms."""

from __future__ import annotations

import thunder
import torch
from torch.distributed.fsdp import fully_shard

from _fsdp2 import fake_group  # noqa: F401 (a fixture)
from test_fit_refusal import _Block, _inputs
from thunder_memopt import MemoryOptimization
from thunder_memopt.passes import fit


def _plan() -> fit.FitChoice:
    """The Block's plan under a limit it fits, from its first step."""
    block, x = _inputs()
    memopt = MemoryOptimization(memory_limit=1 << 40)
    thunder.jit(block, transforms=[memopt])(x).backward()
    (choice,) = memopt.fit_report.choices
    return choice


def test_an_unrelated_fsdp2_model_is_not_in_a_plain_jit_programs_plan(fake_group):
    alone = _plan()
    parameter_bytes = sum(p.nbytes for p in _Block().parameters())
    assert (alone.terms.first_step_bytes, alone.terms.calls) == (2 * parameter_bytes, 1)

    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Linear(512, 64))
    for unit in (other[0], other[1], other):
        fully_shard(unit, reshard_after_forward=False)
    other(torch.randn(8, 64)).sum().backward()  # its root lazily initialized, its gathered parameters kept
    beside = _plan()
    assert beside.terms == alone.terms and beside.predicted_peaks == alone.predicted_peaks
    # Its two units (the root holds no parameter of its own) are there to read, for its parameters.
    units = fit.fsdp2_units(other.parameters())
    assert len(units) == 2 and sum(u.optimized_bytes for u in units) == sum(p.to_local().nbytes
                                                                             for p in other.parameters())
    assert fit.fsdp2_units() == ()  # no root's forward runs, and none of its parameters is named
