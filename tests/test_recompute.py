"""MemoryOptimization's recompute pass: numerics, saved bytes, the budget knob and its guards."""

import warnings

import pytest
import thunder
import torch
from _train import N_EMBD, Step, assert_same_numerics, h_bytes_per_layer, shared_train_step, train_step

from thunder_memopt import MemoryOptimization
from thunder_memopt.core import ops
from thunder_memopt.core.memory import estimate_step, saved_for_backward
from thunder_memopt.core.trace import is_bookkeeping
from thunder_memopt.passes import recompute

STABLECODE, PYTHIA, LLAMA = "stablecode-completion-alpha-3b", "pythia-160m", "Llama-3-8B"
ARCHITECTURES = [
    STABLECODE,  # parallel residual, LayerNorm, GELU, partial rotary
    PYTHIA,  # GPT-NeoX
    LLAMA,  # RMSNorm, SwiGLU, GQA
    "falcon-7b",  # parallel residual with a shared attention norm, multi-query attention
    "gemma-2b",  # GeGLU, embedding scaling, multi-query attention
]


# Bit identity holds at any depth: one layer, but two for the models whose two-layer plain steps
# other tests read anyway (the budget tests below, tests/test_memory.py).
TWO_LAYER_ARCHITECTURES = {STABLECODE, LLAMA}


def _architecture_steps(model_name: str) -> tuple[Step, Step]:
    """Plain Thunder's step and the recompute pass's, shared by the tests that read them."""
    n_layer = 2 if model_name in TWO_LAYER_ARCHITECTURES else 1
    return (shared_train_step(model_name, n_layer=n_layer),
            shared_train_step(model_name, {"passes": ("recompute",)}, n_layer=n_layer))


@pytest.mark.parametrize("model_name", ARCHITECTURES)
def test_loss_and_gradients_bit_identical_to_plain_thunder(model_name):
    plain, optimized = _architecture_steps(model_name)
    assert_same_numerics(plain, optimized)
    assert optimized.saved_bytes < plain.saved_bytes


@pytest.mark.parametrize("model_name", [STABLECODE, LLAMA, "falcon-7b"])
def test_the_taxonomy_names_every_op_of_the_traces(model_name):
    # The steps of the test above: an op the taxonomy does not name fails here rather than being
    # guessed (it would be saved, never replayed, and never fused).
    for step in _architecture_steps(model_name):
        for trace in (step.forward_trace, step.backward_trace):
            assert [n for b in trace.bound_symbols if not is_bookkeeping(b) for n in ops.unclassified_names(b)] == []


# At the default budget every layer saves the same bytes (the marginal from one to two layers, two
# to four and one to four were equal, 26.0 for stablecode and 31.0 for Llama), so one and two layers
# measure it. Below 1.0 the rung taken follows the whole model's peak, so those stay at two to four.
DEFAULT_BUDGET_LAYERS = (1, 2)


def test_stablecode_saves_at_most_26_h_bytes_per_token_per_layer():
    # Plain Thunder saves about 117 here; eager PyTorch 36.
    assert h_bytes_per_layer(STABLECODE, {}, layers=DEFAULT_BUDGET_LAYERS) <= 26.0


def test_llama_saved_h_bytes():
    # Plain Thunder saves about 90 here; eager PyTorch 58. With matmuls never replayed (the default)
    # the floor is 31: x 2, qkv 3, bf16 attention probabilities 8 (4 heads x T=256 x 2 B / 256),
    # attention output 2, mid-block residual 2, fc_1 7, fc_2 7. Replaying the cheapest matmul
    # (probs @ v) as the budget allows takes it to 30 and below.
    assert h_bytes_per_layer(LLAMA, {}, layers=DEFAULT_BUDGET_LAYERS) <= 31.0
    assert h_bytes_per_layer(LLAMA, {"activation_budget": 0.9}) <= 30.0


def test_lower_budget_never_raises_the_estimated_peak_and_keeps_numerics():
    # Two layers: the ladder, the rungs the budgets take (0.75 and 0.5 the same one) and every
    # assertion below come out as at three.
    plain = shared_train_step(LLAMA)
    peaks, saved = [], []
    for budget in (1.0, 0.75, 0.5, 0.25, 0.0):
        step = shared_train_step(LLAMA, {"activation_budget": budget})
        assert_same_numerics(plain, step)
        peaks.append(estimate_step(step.forward_trace, step.backward_trace).peak_bytes)
        saved.append(step.saved_bytes)
    assert peaks == sorted(peaks, reverse=True), peaks
    assert saved == sorted(saved, reverse=True), saved
    assert peaks[-1] < peaks[0] and saved[-1] < saved[0]
    # Below 1.0 the backward hook picks the rung and rewrites the forward already handed back to
    # Thunder, which works only because Thunder compiles the forward after that hook. Then the
    # forward that ran saves what its (rewritten) trace says, which is not the default rung's.
    assert abs(saved_for_backward(step.forward_trace).activation_bytes - saved[-1]) <= 0.01 * saved[-1]
    # budget 0.0 takes the rung with the lowest estimated peak, and of those the one saving least
    ladder = recompute.plan_ladder(plain.forward_trace)
    lowest = min(
        estimate_step(p.apply_to_forward(plain.forward_trace), p.apply_to_backward(plain.backward_trace)).peak_bytes
        for p in ladder
    )
    assert peaks[-1] <= lowest


def test_the_ladder_ends_at_per_block_checkpointing():
    # The bit-identity test's plain two-layer step. The last rung keeps about one block input per
    # layer: n_layer block inputs and the batch's 2 KiB of token ids, at one, two and four layers.
    # The bound allows half a block input more a layer, as (4 + 2) block inputs at four layers did;
    # the rung before the last saves 6 block inputs at two layers.
    n_layer = 2
    step = shared_train_step(STABLECODE, n_layer=n_layer)
    ladder = recompute.plan_ladder(step.forward_trace)
    saved = [plan.saved_bytes_after for plan in ladder]
    assert saved == sorted(saved, reverse=True)
    block_input = 256 * 256 * 2  # T x n_embd in bf16
    assert saved[-1] <= (n_layer + 1) * block_input < saved[0]


def _block_step(memopt: MemoryOptimization):
    """One Llama Block narrowed to the suite's width, jitted on its own as each Block is a program of
    its own under FSDP2; in fp32, since a CPU without bf16 instructions (AVX2 only) runs bf16 matmuls
    hundreds of times slower. At this width the rung of the lowest estimated peak (rung 3 of 9) is
    not the ladder's end (rung 7), so the rule for a program that runs once per layer decides the
    rung; at the real width (n_embd 4096) every rung's estimated peak ties and the lowest peak's
    rule takes the ladder's end too."""
    from litgpt.model import Block

    from thunder_memopt.models import narrow_config

    torch.manual_seed(0)
    config = narrow_config(LLAMA, n_layer=1, n_embd=N_EMBD, block_size=256)
    block = Block(config, block_idx=0)
    jitted = thunder.jit(block, transforms=[memopt])
    x = torch.randn(1, 256, config.n_embd, requires_grad=True)
    cos = torch.randn(1, 256, config.rope_n_elem)
    jitted(x, cos, cos.clone()).float().square().mean().backward()
    return thunder.last_traces(jitted)[-1], x.grad, [p.grad for p in block.parameters()]


def test_budget_zero_takes_the_ladders_end_in_a_program_that_runs_once_per_layer():
    """A Block's saved bytes add up over the Blocks of a step, so at 0.0 it saves what per-block
    checkpointing saves, whatever its own estimated peak; the whole model keeps the lowest peak."""
    assert not recompute.runs_per_layer(shared_train_step(LLAMA).forward_trace)
    plain_forward, *plain_grads = _block_step(MemoryOptimization(passes=()))
    assert recompute.runs_per_layer(plain_forward)
    forward, *grads = _block_step(MemoryOptimization(activation_budget=0.0))
    ladder = recompute.plan_ladder(plain_forward)
    assert saved_for_backward(forward).activation_bytes == min(p.saved_bytes_after for p in ladder)
    assert min(p.saved_bytes_after for p in ladder) < ladder[0].saved_bytes_after
    assert torch.equal(plain_grads[0], grads[0])
    assert all(torch.equal(a, b) for a, b in zip(plain_grads[1], grads[1]))


class _UnknownAndRandomOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = torch.cumsum(self.lin(x), dim=-1)  # not a known cheap op: must be saved, not replayed
        h = torch.nn.functional.dropout(h.float().exp(), p=0.5, training=True)
        return self.lin(h.tanh())


def test_unknown_and_random_ops_are_saved_never_replayed():
    def run(transforms):
        torch.manual_seed(0)
        model = _UnknownAndRandomOps()
        x = torch.randn(8, 64)
        jitted = thunder.jit(model, transforms=transforms)
        torch.manual_seed(1)
        jitted(x).sum().backward()
        return [p.grad for p in model.parameters()], thunder.last_traces(jitted)[-1]

    (plain, _), (optimized, fw) = run([]), run([MemoryOptimization()])
    assert all(torch.equal(a, b) for a, b in zip(plain, optimized))
    plan = recompute.plan_recompute(fw)
    replayed = {n for b in plan.replayed for n in ops.op_names(b)}
    assert not replayed & {"cumsum", "uniform", "uniform_philox", "bernoulli", "dropout"}


def test_a_trace_the_pass_cannot_handle_is_left_unchanged_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise NotImplementedError("synthetic failure")

    plain = shared_train_step(PYTHIA, n_layer=1)  # the bit-identity test's, at any depth the same check
    monkeypatch.setattr(recompute, "plan_ladder", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimized = train_step(PYTHIA, [MemoryOptimization()], n_layer=1)
    ours = [w for w in caught if "thunder_memopt" in str(w.message)]
    assert len(ours) == 1
    assert_same_numerics(plain, optimized)
    assert optimized.saved_bytes == plain.saved_bytes


def test_saved_set_excludes_rotary_q_k_beside_qkv():
    step = shared_train_step(STABLECODE, {})
    sources = [t.source or "" for t in saved_for_backward(step.forward_trace).tensors if not t.is_parameter]
    assert not any("model.py:1172" in s for s in sources)  # litgpt apply_rope's output
