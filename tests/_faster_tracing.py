"""Process settings that make the tests' compilations cheaper without changing what they compute.

The tests' processes (pytest's workers, and the torchrun workers under tests/dist/ through
_common.py) call ``apply()`` before they compile. Each setting is transparent to the results: the
same traces, the same kernels, the same numbers.
"""

from __future__ import annotations

import functools
import gc
import os
import sys


def _decode_each_code_object_once() -> None:
    """Thunder's interpreter decodes a function's bytecode (``dis.get_instructions``) at every call
    it interprets: 235,571 decodings in one step of a 2-layer Llama. A code object's instructions
    never change, so the tests' processes decode each once and keep the tuple Thunder would build:
    7.6 s to 7.1 s for that step on this 2-core machine."""
    import dis

    import thunder.core.interpreter as interpreter

    if isinstance(interpreter.dis, _OnceDis):
        return
    interpreter.dis = _OnceDis(dis)


class _OnceDis:
    def __init__(self, dis) -> None:
        self._dis = dis
        # The module's names are the instance's own: Thunder reads ``dis.opname`` and the like at
        # every instruction it interprets (724,157 reads a 2-layer step), and each read through
        # ``__getattr__`` would be a Python call.
        self.__dict__.update((name, value) for name, value in vars(dis).items() if not name.startswith("__"))
        self.get_instructions = functools.cache(lambda code: tuple(dis.get_instructions(code)))

    def __getattr__(self, name: str):
        return getattr(self._dis, name)


def _provenance_records_without_checks() -> None:
    """Thunder's interpreter makes a ``ProvenanceRecord`` for each value it wraps (414,922 a 2-layer
    step), and its ``__post_init__`` asserts its fields' types, one assert a generator over the
    inputs, before it copies the inputs and ANDs their ``ext_flag``. The tests' processes make the
    same fields without the asserts: with them and the ``dis`` names above, two 2-layer steps took
    12.1 s instead of 13.2 here."""
    from thunder.core.interpreter import ProvenanceRecord

    def post_init(record: ProvenanceRecord) -> None:
        inputs = record.inputs = record.inputs.copy()
        flag = inputs[0].ext_flag if inputs else 0
        for i in inputs[1:]:
            flag &= i.ext_flag
        record.ext_flag = flag

    ProvenanceRecord.__post_init__ = post_init


def _fewer_cyclic_collections() -> None:
    """Thunder's interpreter makes millions of short-lived objects a compilation, which set off
    Python's cyclic collector every 700 allocations and a full collection (a walk over every object
    of the process, torch's and Thunder's modules included) every 70,000. Reference counting frees
    almost all of them. The objects alive after the imports go to the permanent generation
    (``gc.freeze``) and the youngest generation collects every 20,000 allocations: nine 1-layer
    steps of four litgpt models, 134.5 s to 123.6 s here (two such processes side by side,
    2026-12-06). The collector still runs; only less often."""
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def apply() -> None:
    # Inductor checks each vector ISA the CPU reports by building and loading a test library with
    # g++ and a Python subprocess per ISA, once per process (10 builds, 6-12 s here); with this set
    # it takes the ISAs the CPU reports (the same list here). Subprocesses inherit it.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    if (config := sys.modules.get("torch._inductor.config")) is not None and config.cpp.vec_isa_ok is None:
        config.cpp.vec_isa_ok = config.vec_isa_ok_default()  # read at its import, already done
    _decode_each_code_object_once()
    _provenance_records_without_checks()
    _fewer_cyclic_collections()
