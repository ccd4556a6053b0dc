"""The plugin's options as one flat mapping of names, for the clients that enable it by name:
``torch.compile(backend="thunder_memopt", options={...})`` (thunder_memopt.named_backend) and the
launcher's flags and environment (thunder_memopt.launch).

A name is MemoryOptimization's keyword, ``executors()``' or a thunder.jit / Thunder compile option
that ``thunderfx_backend`` takes (``backend.THUNDER_OPTIONS``); ``memory_optimization`` takes a
ready ``MemoryOptimization`` instead of its keywords. ``PluginOptions.of`` sorts a mapping into
those parts and refuses an unknown name in one line; each part is checked where it is used (by
``MemoryOptimization``, ``executors()`` and ``thunderfx_backend``), with their one-line errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from thunder_memopt.backend import THUNDER_OPTIONS
from thunder_memopt.executors import executors
from thunder_memopt.transform import MemoryOptimization

__all__ = ["MEMORY_OPTIONS", "EXECUTOR_OPTIONS", "PluginOptions"]


def _keyword_only(fn) -> tuple[str, ...]:
    return tuple(name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY)


MEMORY_OPTIONS = _keyword_only(MemoryOptimization.__init__)
EXECUTOR_OPTIONS = _keyword_only(executors)
_INSTANCE = "memory_optimization"


@dataclass(frozen=True)
class PluginOptions:
    """A flat mapping of the plugin's options, sorted: MemoryOptimization's keywords (or its
    instance), ``executors()``' and Thunder's."""

    memory: dict[str, Any] = field(default_factory=dict)
    executors: dict[str, Any] = field(default_factory=dict)
    thunder: dict[str, Any] = field(default_factory=dict)
    instance: MemoryOptimization | None = None

    @classmethod
    def of(cls, options: Mapping[str, Any] | None, who: str) -> PluginOptions:
        """``options`` sorted; a one-line TypeError, ``who`` first, for a name none of them takes."""
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise TypeError(f"{who}: options must be a dict of option names, got {options!r}")
        unknown = sorted(set(options) - {*MEMORY_OPTIONS, *EXECUTOR_OPTIONS, *THUNDER_OPTIONS, _INSTANCE})
        if unknown:
            raise TypeError(f"{who}: unknown option {unknown[0]!r} (neither MemoryOptimization's, executors()', "
                            f"{_INSTANCE!r}, nor a thunder.jit or Thunder compile option)")
        memory = {k: v for k, v in options.items() if k in MEMORY_OPTIONS}
        instance = options.get(_INSTANCE)
        if instance is not None and not isinstance(instance, MemoryOptimization):
            raise TypeError(f"{who}: {_INSTANCE} must be a MemoryOptimization instance, got {instance!r}")
        if instance is not None and memory:
            raise TypeError(f"{who}: give {_INSTANCE} or MemoryOptimization's options ({sorted(memory)[0]!r}), "
                            "not both")
        return cls(memory, {k: v for k, v in options.items() if k in EXECUTOR_OPTIONS},
                   {k: v for k, v in options.items() if k in THUNDER_OPTIONS}, instance)

    def memory_optimization(self, who: str) -> MemoryOptimization:
        """The instance given, or a new ``MemoryOptimization`` of the keywords; its one-line errors
        with ``who`` first."""
        if self.instance is not None:
            return self.instance
        try:
            return MemoryOptimization(**self.memory)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{who}: {e}") from None
