"""One training step of a narrowed litgpt model, shared by the tests."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import thunder
import torch

from thunder_memopt import MemoryOptimization
from thunder_memopt.measure import measure_saved
from thunder_memopt.models import build_model, narrow_config, random_batch

SEQ_LEN = 256
N_EMBD = 256


@dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    saved_bytes: int
    forward_trace: object
    backward_trace: object


def train_step(
    model_name: str,
    transforms=(),
    *,
    n_layer: int = 2,
    seq_len: int = SEQ_LEN,
    device: str = "cpu",
    executors=None,
    **config,
) -> Step:
    """Forward, loss and backward of ``thunder.jit(model, transforms=..., executors=...)`` in bf16 on
    ``device``; ``config`` overrides fields of the narrowed litgpt config."""
    cfg = narrow_config(model_name, n_layer=n_layer, n_embd=N_EMBD, block_size=seq_len)
    for k, v in config.items():
        setattr(cfg, k, v)
    model = build_model(cfg, device=device)
    x, y = random_batch(cfg, batch_size=1, seq_len=seq_len, device=device)
    jitted = thunder.jit(model, transforms=list(transforms), executors=executors)
    measured = measure_saved(jitted, x, parameters=[*model.parameters(), *model.buffers()])
    loss = torch.nn.functional.cross_entropy(measured.output.flatten(0, 1).float(), y.flatten())
    loss.backward()
    return Step(
        loss=loss.detach(),
        grads={n: p.grad for n, p in model.named_parameters()},
        saved_bytes=measured.activation_bytes,
        forward_trace=thunder.last_traces(jitted)[-1],
        backward_trace=thunder.last_backward_traces(jitted)[-1],
    )


def shared_train_step(model_name: str, memopt: dict | None = None, *, n_layer: int = 2, seq_len: int = SEQ_LEN,
                      executors=None) -> Step:
    """``train_step`` under ``MemoryOptimization(**memopt)`` (None: plain Thunder), run once per process
    for each configuration: the steps are seeded, so the tests that only read a step share it (each
    compilation costs seconds a layer, most of it Thunder interpreting litgpt's Python). pytest-xdist
    runs a file's tests in one process (--dist loadfile), so a file's tests share within it."""
    options = None if memopt is None else tuple(sorted({**_MEMOPT_DEFAULTS, **memopt}.items()))
    return _train_step_once(model_name, options, n_layer, seq_len, None if executors is None else tuple(executors))


# With its defaults filled in, {} and {"activation_budget": 1.0} are one configuration.
_MEMOPT_DEFAULTS = {name: p.default for name, p in inspect.signature(MemoryOptimization).parameters.items()}


@functools.cache
def _train_step_once(model_name: str, options: tuple | None, n_layer: int, seq_len: int, executors: tuple | None) -> Step:
    transforms = [] if options is None else [MemoryOptimization(**dict(options))]
    return train_step(model_name, transforms, n_layer=n_layer, seq_len=seq_len,
                      executors=None if executors is None else list(executors))


def h_bytes_per_layer(model_name: str, memopt: dict | None, *, layers=(2, 4), seq_len: int = SEQ_LEN) -> float:
    """Saved bytes per token per layer per n_embd, from the marginal between two layer counts."""
    small, large = (shared_train_step(model_name, memopt, n_layer=n, seq_len=seq_len).saved_bytes for n in layers)
    return (large - small) / (layers[1] - layers[0]) / (seq_len * N_EMBD)


def assert_same_numerics(a: Step, b: Step) -> None:
    assert torch.equal(a.loss, b.loss), (a.loss, b.loss)
    assert a.grads.keys() == b.grads.keys()
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), name
