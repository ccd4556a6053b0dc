"""The recompute pass under other compilers: Thunder's torch_compile executor (inductor regions in
the trace) and thunderfx_backend (dynamo's subgraphs, and litgpt's MoE, which plain thunder.jit
cannot trace). Each test builds its own models and shares no step with tests/test_recompute.py, so
the two files are work units of their own under pytest-xdist (tests/conftest.py)."""

import warnings

import thunder
import torch
from _train import assert_same_numerics, train_step

from thunder_memopt import MemoryOptimization, thunderfx_backend

STABLECODE = "stablecode-completion-alpha-3b"


def test_with_torch_compile_ex_the_step_is_unchanged_and_saves_no_more():
    """torch_compile_ex puts the forward into opaque inductor regions that hold matmuls, so there is
    nothing cheap to replay. The pass must run without warnings and keep numerics and saved bytes."""
    from thunder.executors.torch_compile import torch_compile_ex

    executors = [torch_compile_ex, *thunder.get_default_executors()]
    # One layer: what is checked holds at any depth.
    plain = train_step(STABLECODE, executors=executors, n_layer=1, seq_len=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = train_step(STABLECODE, [MemoryOptimization()], executors=executors, n_layer=1, seq_len=128)
    assert not [w for w in caught if "thunder_memopt" in str(w.message)]
    assert any(b.sym.name.startswith("TorchCompile") for b in step.forward_trace.bound_symbols)
    assert_same_numerics(plain, step)
    assert step.saved_bytes <= plain.saved_bytes


class _TwoGraphs(torch.nn.Module):
    """Two blocks with a graph break between them: dynamo hands ThunderCompiler two subgraphs."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.b = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64), torch.nn.SiLU(), torch.nn.Linear(64, 64))

    def forward(self, x):
        x = x + self.a(x)
        torch._dynamo.graph_break()
        return x + self.b(x)


def test_thunderfx_backend_shares_one_transform_across_subgraphs_correctly():
    def run(make_backend):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _TwoGraphs()
        x = torch.randn(4, 32, 64)
        backend = make_backend()
        out = torch.compile(model, backend=backend)(x)
        out.square().mean().backward()
        return out.detach(), [p.grad for p in model.parameters()], backend

    from thunder.dynamo import ThunderCompiler

    caller_transforms = [MemoryOptimization()]
    ref_out, ref_grads, _ = run(ThunderCompiler)
    out, grads, backend = run(lambda: thunderfx_backend(caller_transforms[0]))
    assert torch.equal(ref_out, out)
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    assert len(caller_transforms) == 1  # ThunderCompiler appends to the list it is given, never ours
    assert len(backend.compiler.subgraph_infos) == 2


def test_mixture_of_experts_through_thunderfx_backend_is_bit_identical_and_saves_less():
    """litgpt's MoE blocks (Mixtral) cannot be traced by plain thunder.jit (torch.where with a
    condition alone), but train through ThunderCompiler, which hands that op to inductor."""
    from thunder.dynamo import ThunderCompiler

    from thunder_memopt.measure import measure_saved
    from thunder_memopt.models import build_model, narrow_config, random_batch

    # One layer: the saved bytes outside the layers (the embedding's output, the head's input) are
    # alike in both steps, so the ratio is at its highest at one layer (0.378 here, 0.373 at two).
    config = narrow_config("Mixtral-8x7B-v0.1", n_layer=1, n_embd=256, block_size=64)

    def run(backend):
        torch._dynamo.reset()
        model = build_model(config)
        x, y = random_batch(config, batch_size=1, seq_len=64)
        measured = measure_saved(torch.compile(model, backend=backend), x, parameters=list(model.parameters()))
        loss = torch.nn.functional.cross_entropy(measured.output.flatten(0, 1).float(), y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, measured.activation_bytes

    (plain_loss, plain_grads, plain_saved), (loss, grads, saved) = run(ThunderCompiler()), run(thunderfx_backend())
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[n], g) for n, g in plain_grads.items())
    assert saved < plain_saved / 2
