"""``python -m thunder_memopt plan`` (thunder_memopt.plan): the per-rank peak it predicts on meta, for
a narrow Llama (2 Blocks, width 128, T=256, fp32) sharded as the benchmark shards it (FSDP2 units of
each Block, the embedding and the root, zero2, under torch's fake process group at 8 ranks, AdamW),
against the peak of a CPU step; and its bad flags, each argparse's one-line error."""

from __future__ import annotations

import functools

import pytest
import torch

from _fsdp2 import WORLD_SIZE, fake_group, first_step  # noqa: F401 (fake_group: a fixture)
from thunder_memopt import MemoryOptimization, plan
from thunder_memopt.__main__ import main as cli
from thunder_memopt.measure import peak_live_bytes
from thunder_memopt.models import HeadWithLoss, build_model, narrow_config, random_batch

NAME, N_EMBD, T = "Llama-3-8B", 128, 256
CONFIG = narrow_config(NAME, n_layer=2, n_embd=N_EMBD, block_size=T)
# The plan composes the step from one Block's and the head's programs traced on meta, with FSDP2's
# terms computed from the parameters' shapes; the CPU step has the allocator-free details of
# FSDP2's copy-in and copy-out, as tests/test_fit_first_step.py's does.
TOLERANCE = 0.10


@functools.cache
def _measured() -> int:
    """The peak of a second AdamW step of the narrow Llama under FSDP2 and thunderfx_backend at
    budget 1.0: the profiler's live bytes above those alive before it, plus those."""
    gpt = build_model(CONFIG, dtype=torch.float32, seed=0)
    model = HeadWithLoss(gpt)
    step, resident = first_step(model, [*gpt.transformer.h, gpt.transformer.wte, model], MemoryOptimization(),
                                random_batch(CONFIG, batch_size=1, seq_len=T))
    peak = resident + peak_live_bytes(step)
    torch._dynamo.reset()
    return peak


def test_the_plan_predicts_a_cpu_steps_peak(fake_group):
    layout, block, head = plan.trace_programs(NAME, n_embd=N_EMBD, block_size=T, micro_batch_size=1,
                                              dtype=torch.float32, gpu=False)
    predicted = plan.plan_step(layout, block, head, n_layer=CONFIG.n_layer, world_size=WORLD_SIZE, shard_mode="zero2",
                               micro_batch_size=1, block_size=T, dtype=torch.float32, optimizer_states=2,
                               limit_bytes=1 << 40)
    measured = _measured()
    print(f"\npredicted {predicted.settings} measured {measured}")
    assert predicted.settings["thunder+memopt @1"] == pytest.approx(measured, rel=TOLERANCE)
    # Less recompute never predicts less; the limit takes the default's rung where it fits.
    peaks = list(predicted.settings.values())
    assert peaks == sorted(peaks, reverse=True) and predicted.fits and predicted.limit_choice.rung == 0


@pytest.mark.parametrize("argv, names", [
    (["--world-size", "0"], "--world-size"),
    (["--shard-mode", "zero4"], "--shard-mode"),
    (["--device-memory", "0.5"], "--device-memory"),
    (["--device-memory", "lots"], "--device-memory"),
    (["--model-name", "Llama-9"], "--model-name"),
    (["--block-size", "-1"], "--block-size"),
    (["--shard-mode", "none", "--world-size", "8"], "--world-size"),
])
def test_bad_flags_are_one_line_errors(argv, names, capsys):
    with pytest.raises(SystemExit) as exited:
        cli(["plan", *argv])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("python -m thunder_memopt plan: error: ") and names in error, error


def test_traced_as_the_gpus_executors_run_the_heads_chunk_math_is_one_kernel():
    """On meta under the GPU's executors, the fused loss head's op is priced as on CUDA, where its
    chunk math is one compiled kernel: without the temporaries of that math run eagerly, which it
    holds on a CPU (at Phi-3-mini's vocabulary and T=8192, 1.5 GiB of its 2.2 GiB workspace)."""
    import thunder

    from thunder_memopt.core.memory import WORKSPACE_BYTES
    from thunder_memopt.models import LossHead

    with plan._executors_claim_meta(gpu=True) as executors, torch.device("meta"):
        head = LossHead(torch.nn.Linear(N_EMBD, CONFIG.padded_vocab_size, bias=False))
        x = torch.empty(1, T, N_EMBD, requires_grad=True)
        jitted = thunder.jit(head, transforms=[MemoryOptimization()], executors=executors)
        jitted(x, torch.empty(1, T, dtype=torch.long))
        (op,) = [b for b in thunder.last_traces(jitted)[-1].bound_symbols if b.sym.name in WORKSPACE_BYTES]
        as_on_cuda = WORKSPACE_BYTES[op.sym.name](op)
    assert 0 < as_on_cuda < WORKSPACE_BYTES[op.sym.name](op)  # outside: meta is priced as a CPU's
