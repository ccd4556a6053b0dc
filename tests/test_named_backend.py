"""``torch.compile(backend="thunder_memopt", options=...)``: the name from the installed
distribution's entry points (pyproject.toml; the Makefile installs the package), the options reach
the backend, and bad ones are refused in one line.

The model is a small MLP with its loss, on CPU: the named backend trains it bit for bit as
``thunderfx_backend`` of the same options does (the same kernels).
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch._dynamo

from thunder_memopt import MemoryOptimization, named_backend, thunderfx_backend


class MLPWithLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))).square().mean()


def _step(backend, options=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward of a fresh MLPWithLoss compiled with ``backend``: the loss and the grads."""
    torch._dynamo.reset()
    model = MLPWithLoss()
    compiled = torch.compile(model, backend=backend, options=options)
    loss = compiled(torch.randn(4, 32, generator=torch.Generator().manual_seed(1)))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _assert_identical(a, b) -> None:
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_the_installed_distribution_registers_the_name():
    (entry,) = [e for e in importlib.metadata.entry_points(group="torch_dynamo_backends") if e.name == "thunder_memopt"]
    assert entry.dist.name == "thunder-memopt" and entry.value == "thunder_memopt.named_backend:thunder_memopt"
    assert entry.load() is named_backend.thunder_memopt
    assert "thunder_memopt" in torch._dynamo.list_backends()


def test_the_name_trains_as_thunderfx_backend_does():
    _assert_identical(_step("thunder_memopt"), _step(thunderfx_backend()))


def test_options_reach_the_backend():
    memopt = MemoryOptimization()
    _step("thunder_memopt", {"memory_optimization": memopt, "fusion": False})
    assert memopt.pass_seconds, "the transform given in options did not run"
    _assert_identical(_step("thunder_memopt", {"activation_budget": 0.0, "fusion": False, "cache": "constant values"}),
                      _step(thunderfx_backend(MemoryOptimization(activation_budget=0.0), fusion=False)))


@pytest.mark.parametrize(("options", "mode", "error", "names"), [
    ({"activation_budgett": 0.5}, None, TypeError, "'activation_budgett'"),
    ({"activation_budget": 2.0}, None, ValueError, "activation_budget"),
    ({"offload": "sometimes"}, None, ValueError, "offload"),
    ({"fusion": "yes"}, None, TypeError, "fusion"),
    ({"memory_optimization": MemoryOptimization(), "activation_budget": 0.5}, None, TypeError, "activation_budget"),
    ({"transforms": "MemoryOptimization"}, None, TypeError, "transforms"),
    (None, "max-autotune", ValueError, "mode='max-autotune'"),
])
def test_bad_options_are_refused_in_one_line(options, mode, error, names):
    torch._dynamo.reset()
    compiled = torch.compile(MLPWithLoss(), backend="thunder_memopt", options=options, mode=mode)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failed:
        compiled(torch.randn(4, 32))
    inner = failed.value.inner_exception
    assert type(inner) is error and "\n" not in str(inner) and names in str(inner), inner
