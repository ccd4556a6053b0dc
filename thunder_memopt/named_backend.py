"""The ``torch.compile`` backend named ``thunder_memopt``: ``thunderfx_backend`` for the clients
that take a backend by name.

pyproject.toml registers ``thunder_memopt`` in the ``torch_dynamo_backends`` entry-point group, from
which torch's backend registry loads it. ``torch.compile(model, backend="thunder_memopt",
options={...})`` hands ``options`` to each call; they are thunder_memopt.options' names, checked at
the first graph (dynamo reports an error there as ``BackendCompilerFailed``, the one-line error
under it). Each options dict builds one ``thunderfx_backend``, shared by every graph of the
``torch.compile`` it was given to (as one ``MemoryOptimization`` sees all of them with
``memory_limit``); ``torch._dynamo.reset()`` forgets them.

accelerate, through which transformers' Trainer compiles, takes only the backend names of its own
enum (``DynamoBackend``); ``add_name_to_accelerate`` adds this one, at ``import thunder_memopt``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import torch

from thunder_memopt.backend import thunderfx_backend
from thunder_memopt.options import PluginOptions

__all__ = ["NAME", "thunder_memopt", "add_name_to_accelerate"]

NAME = "thunder_memopt"
_WHO = f"backend {NAME!r}"
# id(options) -> (options, its backend); the dict is held so that its id is not reused.
_backends: dict[int, tuple[Mapping[str, Any] | None, Callable]] = {}


def thunder_memopt(gm: torch.fx.GraphModule, example_inputs: list, *, options: Mapping[str, Any] | None = None,
                   mode: str | None = None) -> Callable:
    """``torch.compile(backend="thunder_memopt", options=...)``: the graph compiled by the
    ``thunderfx_backend`` that ``options`` build (MemoryOptimization's, ``executors()``' and
    Thunder's options, one flat dict; none: the defaults)."""
    held = _backends.get(id(options))
    if held is None or held[0] is not options:
        if mode not in (None, "default"):
            raise ValueError(f"{_WHO}: mode={mode!r} is inductor's; this backend takes options=")
        plugin = PluginOptions.of(options, _WHO)
        backend = thunderfx_backend(plugin.memory_optimization(_WHO), **plugin.executors, **plugin.thunder)
        held = _backends[id(options)] = (options, backend)
    return held[1](gm, example_inputs)


def _reset() -> None:
    _backends.clear()


thunder_memopt.reset = _reset  # torch._dynamo.reset() calls its backends' reset


def add_name_to_accelerate() -> None:
    """Where accelerate is installed: its ``DynamoBackend`` takes ``thunder_memopt``, so that
    ``TrainingArguments(torch_compile_backend="thunder_memopt")`` reaches ``torch.compile``.
    accelerate keeps the names it knows in a closed enum; this adds one member to its value map."""
    if importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.utils import DynamoBackend

    value = NAME.upper()  # accelerate looks names up upper-case and hands torch.compile .value.lower()
    if value in DynamoBackend._value2member_map_:
        return
    member = str.__new__(DynamoBackend, value)
    member._name_, member._value_ = value, value
    DynamoBackend._value2member_map_[value] = member
