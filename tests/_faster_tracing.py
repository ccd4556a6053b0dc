"""Process settings that make the tests' compilations cheaper without changing what they compute.

The tests' processes (pytest's workers, and the torchrun workers under tests/dist/ through
_common.py) call ``apply()`` before they compile. Each setting is transparent to the results: the
same traces, the same kernels, the same numbers.
"""

from __future__ import annotations

import _thread
import functools
import gc
import importlib.machinery
import inspect
import os
import subprocess
import sys
import types
from collections.abc import Callable


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


def _python_frames_without_spinning() -> None:
    """When an exception leaves a frame that Thunder's interpreter runs (``getattr`` with a default,
    ``hasattr``, a ``try`` in torch's or litgpt's Python), ``get_or_make_python_frame`` makes a
    Python frame for its traceback: a nested ``get_frame`` raises in a new thread, and the caller
    spins with the GIL held until the thread has appended the frame, so the thread runs only once
    the switch interval (5 ms) takes the GIL from the spinner: 8 ms a frame, 106 frames in one
    2-layer Llama step. The tests' processes run the same ``get_frame`` in the same kind of thread
    and wait on a lock, which gives up the GIL: the same frame in under a millisecond."""
    from thunder.core.interpreter import InterpreterFrame

    original = InterpreterFrame.get_or_make_python_frame
    if getattr(original, "_without_spinning", False):
        return
    code = next(c for c in original.__code__.co_consts if getattr(c, "co_name", None) == "get_frame")
    get_frame = types.FunctionType(code, original.__globals__)

    class Appended(list):
        """A list that releases ``done`` at its first append."""

        def __init__(self) -> None:
            super().__init__()
            self.done = _thread.allocate_lock()
            self.done.acquire()

        def append(self, item) -> None:
            super().append(item)
            self.done.release()

    def get_or_make_python_frame(self: InterpreterFrame):
        assert self.positions is not None
        lineno = self.positions.lineno
        if lineno is None:
            lineno = self.code.co_firstlineno
        result = Appended()
        _thread.start_new_thread(get_frame, (result, lineno - self.code.co_firstlineno + 1, self.code.co_filename,
                                             self.code.co_firstlineno, self.code.co_name, self.qualname))
        with result.done:
            return result[0]

    get_or_make_python_frame._without_spinning = True
    InterpreterFrame.get_or_make_python_frame = get_or_make_python_frame


class _OuterFrames:
    """``inspect.stack()`` from ``frame`` outwards, each frame read (``getframeinfo``) when indexed."""

    def __init__(self, frame: types.FrameType, context: int) -> None:
        self.frame, self.context = frame, context

    def __getitem__(self, index: int):
        frame = self.frame
        for _ in range(index):
            frame = frame and frame.f_back
        if index < 0 or frame is None:
            raise IndexError(index)
        info = inspect.getframeinfo(frame, self.context)
        return inspect.FrameInfo(frame, *info, positions=info.positions)


def _callsite_read_alone() -> None:
    """Each interpretation keeps the frame that called Thunder's interpreter
    (``InterpreterRuntimeCtx.__init__``: ``inspect.stack()[2]``), and ``inspect.stack`` reads the
    source line and module of every outer frame first: 60 to 100 frames under pytest, 1.6% of a full
    run's sampled CPU (py-spy, 2026-12-07). The interpreter's module sees an ``inspect`` whose
    ``stack`` reads only the frames indexed: the same FrameInfo."""
    import thunder.core.interpreter as interpreter

    if getattr(interpreter.inspect, "_frames_read_when_indexed", False):
        return
    one_frame = types.ModuleType("inspect")
    one_frame.__dict__.update(inspect.__dict__)
    one_frame.stack = lambda context=1: _OuterFrames(sys._getframe(1), context)
    one_frame._frames_read_when_indexed = True
    interpreter.inspect = one_frame


def _missing_nvml_remembered() -> None:
    """lightning.fabric, which litgpt imports, sets PYTORCH_NVML_BASED_CUDA_CHECK=1: each
    ``torch.cuda.is_available()`` then counts devices through NVML, torch keeps the count only once
    CUDA is initialized, and FakeTensorMode asks at each op it dispatches. Where NVML is missing
    each ask tries to load it again (0.5% of a full run's sampled CPU, py-spy, 2026-12-07). The tests'
    processes remember that it failed to load and raise the same error at once."""
    import torch.cuda

    original = torch.cuda._raw_device_count_nvml
    if getattr(original, "_missing_remembered", False):
        return
    missing: list[tuple] = []  # the error's arguments, once loading failed

    def raw_device_count_nvml() -> int:
        if missing:
            raise OSError(*missing[0])
        try:
            return original()
        except OSError as error:
            missing.append(error.args)
            raise

    raw_device_count_nvml._missing_remembered = True
    torch.cuda._raw_device_count_nvml = raw_device_count_nvml


class _IsaCheckLoadsInProcess:
    """``subprocess`` as inductor's ISA checks see it, but for ``check_call``: see
    ``_isa_extension_checks_in_process``."""

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    @staticmethod
    def check_call(args: list[str], **kwargs) -> int:
        if args[:2] != [sys.executable, "-c"]:
            return subprocess.check_call(args, **kwargs)
        exec(args[2], {})  # an OSError where the library does not load, as the process would fail
        return 0


def _isa_extension_checks_in_process() -> None:
    """With TORCHINDUCTOR_VEC_ISA_OK (``apply``), inductor still checks the extensions of the ISA it
    picks (AVX-512 BF16 and VNNI, AMX tiles and FP16 here) by loading a test library (built once,
    cached on disk) in a new Python process that imports torch: six processes, 9 s here, in each
    process that compiles or loads a CPU kernel. The tests' processes run the same check's code, the
    import and the load, in themselves, where torch is already imported: the same ISA in 0.1 s."""
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    cpu_vec_isa.subprocess = _IsaCheckLoadsInProcess()


class AfterImport:
    """A finder that finds one module as the path finder does, and calls ``then(module)`` once the
    module has been executed (insert it at the front of ``sys.meta_path``)."""

    def __init__(self, name: str, then: Callable) -> None:
        self.name = name
        self.then = then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def _supported_nodes_checked_once() -> None:
    """ThunderCompiler's splitter checks each node of each dynamo graph for whether Thunder runs it;
    the same nodes come again: each layer's, and each graph that a test compiles twice (plain
    ThunderCompiler and thunderfx_backend). thunderfx_backend keeps the checks that passed during its
    own compiles (thunder_memopt.node_checks); the tests' processes keep them for plain
    ThunderCompiler's too, from thunder.dynamo's import on: a process that never imports it (the
    benchmark's eager trials, the long-run check's eager settings) is spared the import (with
    torch.utils.benchmark and setuptools): the median of six imports of benchmarks.fsdp2.worker
    took 4.06 s of CPU here instead of 4.33."""

    def keep(_module=None) -> None:
        from thunder_memopt.node_checks import keep_checks

        keep_checks()

    if "thunder.dynamo" in sys.modules:
        keep()
    elif not any(isinstance(finder, AfterImport) and finder.name == "thunder.dynamo" for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport("thunder.dynamo", keep))


def _global_names_looked_up_directly() -> None:
    """Thunder's interpreter looks up each global name an instruction loads (``globals_lookup``) by
    interpreting ``lambda d, k: d[k]``, whose subscription interprets a second function that
    fetches ``dict.__getitem__``, binds it and calls it; a builtin (``len``, ``isinstance``) takes
    two such lookups, ``__builtins__`` and the name. All that ends in
    ``MutMappingWrapperMethods.__getitem__`` on the same wrapped dict, which keeps one wrapper per
    key. The tests' processes call it directly where the name is in a plain dict, and interpret the
    rest (a missing name, a module as ``__builtins__``). Each of the 22,220 direct lookups of five
    2-layer litgpt steps returned the very wrapper the interpreted lookup returned; two 2-layer
    Llama steps took 6.6 s before, 4.0 s after. (A third of a step's time was these lookups.)"""
    import thunder.core.interpreter as interpreter
    from thunder.core.interpreter import MutMappingWrapperMethods, WrappedValue, get_interpretercompilectx, wrap_const

    original = interpreter.globals_lookup
    if getattr(original, "_direct", False):
        return

    def item(mapping, key: str):
        """``mapping[key]`` as the interpreted subscription returns it; None where it would not."""
        if (isinstance(mapping, WrappedValue) and type(mapping.value) is dict and mapping.item_wrappers is not None
                and key in mapping.value):
            return MutMappingWrapperMethods.__getitem__(mapping, wrap_const(key))
        return None

    def globals_lookup(globals_dict, name):
        key = name.value if isinstance(name, WrappedValue) else None
        if type(key) is str and get_interpretercompilectx()._with_provenance_tracking:
            found = item(globals_dict, key)
            if found is None and isinstance(globals_dict, WrappedValue) and key not in globals_dict.value:
                builtins = item(globals_dict, "__builtins__")
                found = None if builtins is None else item(builtins, key)
            if found is not None:
                return found
        return original(globals_dict, name)

    globals_lookup._direct = True
    interpreter.globals_lookup = globals_lookup


def _signatures_read_once() -> None:
    """``Symbol.bind`` normalizes each call's arguments against its meta function's signature, which
    ``Symbol.normalize`` reads anew with ``inspect.signature`` at every call: 202,911 reads in
    tests/test_recompute.py's steps. A function's signature does not change once Thunder has made it
    (where Thunder sets a ``__signature__``, it does so before the function's first use), so the
    tests' processes read each meta function's once and bind against it as ``normalize`` does. With
    ``_types_checked_once``: a 2-layer Llama step under MemoryOptimization took 5.86 s of CPU
    instead of 6.32 here (the median of three steps each, alternating in one process, one thread),
    with the same traces and bits."""
    import weakref

    from thunder.core.symbol import Symbol

    original = Symbol.normalize
    if getattr(original, "_signatures_read_once", False):
        return
    signatures: dict[int, tuple[weakref.ref, inspect.Signature]] = {}  # id(meta): (meta, its signature)

    def signature_of(meta) -> inspect.Signature:
        known = signatures.get(id(meta))
        if known is not None and known[0]() is meta:
            return known[1]
        signature = inspect.signature(meta)
        try:
            key = id(meta)
            signatures[key] = (weakref.ref(meta, lambda _, key=key: signatures.pop(key, None)), signature)
        except TypeError:  # a meta that cannot be weakly referenced: read again at each call
            pass
        return signature

    def normalize(self, *args, **kwargs):
        assert self.meta is not None
        bound = signature_of(self.meta).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.args, bound.kwargs

    normalize._signatures_read_once = True
    Symbol.normalize = normalize


def _replaced_in_every_module(name: str, original, replacement) -> None:
    """``replacement`` wherever a loaded module holds ``original`` as ``name`` (``from thunder.core.pytree
    import ...`` binds the function in the importing module)."""
    for module in list(sys.modules.values()):
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)


def _types_checked_once() -> None:
    """``thunder.core.pytree.tree_flatten`` checks that its argument is of a type it flattens before it
    calls optree, building a set of some thirty types (most of them attributes of torch's, read at
    each call) for the check, at every call: 1,663,273 calls in tests/test_recompute.py's steps. The
    check reads the argument's type (the set, ``ProxyInterface``, ``torch.return_types``) and the
    class attributes the namedtuple and dataclass checks read; the tests' processes run it once for
    each type, in Thunder's function, and then call optree as that function does for an argument of
    a type it has passed. An argument
    of a type that has not passed goes to Thunder's function, which raises as it does. Every module
    that imported the function gets this one (``from thunder.core.pytree import tree_flatten``)."""
    import optree
    import thunder.core.pytree as pytree

    original = pytree.tree_flatten
    if getattr(original, "_types_checked_once", False):
        return
    passed: set[type] = set()

    def tree_flatten(args, namespace=pytree.OPTREE_NAMESPACE):
        if type(args) in passed:
            return optree.tree_flatten(args, none_is_leaf=True, namespace=namespace)
        flat = original(args, namespace)
        passed.add(type(args))
        return flat

    tree_flatten._types_checked_once = True
    tree_flatten.types_passed = passed
    _replaced_in_every_module("tree_flatten", original, tree_flatten)


def _dataclasses_looked_for_once_per_class() -> None:
    """``thunder.core.pytree.tree_flatten_with_dataclass`` (a bound symbol's flat arguments and
    outputs: 855,739 calls in tests/test_recompute.py's steps) maps a function over the tree's leaves
    that registers the class of a dataclass instance not registered yet, and flattens the tree it
    rebuilds. The tests' processes flatten, unflatten and flatten again as that map and flatten do,
    registering such a class at its first leaf in the same order, and skip the check for a leaf of a
    type that is not a dataclass (its instances, and classes, are never registered). A 2-layer Llama
    step under MemoryOptimization with the two settings above: 5.71 s of CPU instead of 5.87 (the
    median of three steps each, alternating in one process, one thread), the same traces and bits.

    Where nothing was registered and the tree holds only Python's own containers (no
    ``CustomTreeNode`` in its spec: no dataclass, ``torch.Size`` or slice, whose rebuilding can give
    another structure), rebuilding and flattening again gives the same leaves and an equal spec; for
    such a spec, once the root's type has passed Thunder's check, the first flatten is the result."""
    import dataclasses
    import optree
    import thunder.core.pytree as pytree

    original = pytree.tree_flatten_with_dataclass
    if getattr(original, "_looked_for_once_per_class", False):
        return
    nothing_to_register: set[type] = set()
    plain_specs: dict = {}  # spec -> whether it holds Python's own containers alone
    types_passed = pytree.tree_flatten.types_passed  # the types that passed Thunder's check (_types_checked_once)

    def tree_flatten_with_dataclass(tree):
        leaves, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=pytree.OPTREE_NAMESPACE)
        registered = False
        for leaf in leaves:
            if type(leaf) in nothing_to_register:
                continue
            if pytree._maybe_register_dataclass(leaf):  # as Thunder's map does
                pytree.register_pytree_node_dataclass(leaf.__class__)
                pytree._registered_dataclasses.add(leaf.__class__)
                registered = True
            elif not dataclasses.is_dataclass(type(leaf)):  # nor will any leaf of its type be
                nothing_to_register.add(type(leaf))
        plain = not registered and plain_specs.get(spec)
        if plain is None:
            plain = plain_specs[spec] = "CustomTreeNode(" not in repr(spec)
        if plain and type(tree) in types_passed:
            return leaves, spec
        return pytree.tree_flatten(optree.tree_unflatten(spec, leaves), namespace=pytree.OPTREE_NAMESPACE)

    tree_flatten_with_dataclass._looked_for_once_per_class = True
    _replaced_in_every_module("tree_flatten_with_dataclass", original, tree_flatten_with_dataclass)


# Whether a process shares interpretations between modules (``_interpretations_shared_across_modules``);
# tests/conftest.py turns it off for the rest of a test once it monkeypatches anything a forward may
# call, where a patched function can change what interpreting a module gives without changing it.
share_interpretations = True


def _interpretations_shared_across_modules() -> None:
    """A test builds the same model again and again (plain Thunder and MemoryOptimization at several
    settings), and Thunder interprets each instance's forward anew: 327 s of a full run's CPU went to
    ``thunder_general_jit`` in the tests' own processes, 164 of them to computation traces made
    before in the same process, text for text. The tests' processes keep each interpretation of an
    ``nn.Module`` and give it to another module where Thunder itself would reuse it on a second call:
    the same module classes, parameters, buffers and inputs (shapes, strides, dtypes, devices), the
    same executors, options and grad and autocast modes, and the interpretation's own prologue,
    which checks every value the forward read of the module and its config, passes on the new
    module and inputs. Each taker gets its own copy of the traces' lists and name sets, with the
    prologue bound to its own module, so that what follows (the transforms, the passes) runs as on a
    fresh interpretation; one that gave a temporary executor (the compilation's own, and one an earlier
    compilation passed on) symbols is not kept.

    The files of tests/test_recompute.py's work unit in one process: 223.7 s of CPU before, 175.6
    after. Six steps of Llama and stablecode, plain and under MemoryOptimization, gave the same
    losses, gradients, saved bytes and traces (their text at one PYTHONHASHSEED, but for the
    comments that time each pass) with and without it."""
    import copy

    import thunder
    import torch
    from thunder.core.compile_data import get_compile_data
    from thunder.core.pytree import tree_flatten
    from thunder.core.trace import TraceCtx
    from thunder.extend import TemporaryExecutor

    original = thunder.thunder_general_jit
    if getattr(original, "_shared", False):
        return
    kept: dict[tuple, list] = {}

    def tensor_key(t) -> tuple | None:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return None  # DTensors, fake and other subclasses: not shared
        return t.shape, t.stride(), t.dtype, t.device, t.requires_grad, type(t)

    def unused(executor) -> bool:
        """A temporary executor with no operators and no lookasides: each compilation's own (its ad
        hoc executor), and one that an earlier ``thunder.jit`` put in the list (thunder's ``fsdp``
        compiles a jitted module again with the first compilation's executors)."""
        return isinstance(executor, TemporaryExecutor) and not executor.implmap and not executor._lookasides

    def candidates_key(fn, args, kwargs, sharp_edges) -> tuple | None:
        if not share_interpretations or not isinstance(fn, torch.nn.Module):
            return None
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [*fn.named_parameters(remove_duplicate=False), *fn.named_buffers(remove_duplicate=False),
                   *((i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))]
        tensor_keys = tuple((name, tensor_key(t)) for name, t in tensors)
        if any(key is None for _, key in tensor_keys):
            return None
        if not all(isinstance(leaf, torch.Tensor) or type(leaf) in (int, float, bool, str, type(None))
                   for leaf in leaves):
            return None
        cd = get_compile_data()
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
                 *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))
        return (tuple((name, type(m)) for name, m in fn.named_modules(remove_duplicate=False)), tensor_keys,
                str(spec), tuple(repr(leaf) for leaf in leaves if not isinstance(leaf, torch.Tensor)), modes,
                tuple("unused" if unused(ex) else ex for ex in cd.executors_list),
                repr(cd.compile_options), sharp_edges, cd.cache_option, cd.disable_torch_autograd_support)

    def snapshot(trace: TraceCtx) -> TraceCtx:
        copied = copy.copy(trace)
        copied._bound_symbols = list(trace._bound_symbols)
        copied.scopes = [copied._bound_symbols]
        copied.names = set(trace.names)
        copied._tags = copy.copy(trace._tags)
        copied._object_ctx = dict(trace._object_ctx)
        copied._post_unpack = list(trace._post_unpack)
        copied.kwargs = dict(trace.kwargs) if isinstance(trace.kwargs, dict) else trace.kwargs
        return copied

    def snapshots(results, fn):
        """Copies of ``results``' traces, the prologue's bound to ``fn`` (None: to no module, so that a
        kept interpretation holds no model's weights)."""
        prologue = snapshot(results.prologue_trace)
        prologue.fn = fn
        return type(results)(prologue, snapshot(results.computation_trace), snapshot(results.epilogue_trace),
                             results.interpreter_log)

    def accepts(prologue: TraceCtx, args, kwargs) -> bool:
        """Whether ``prologue``, an interpretation's bound to the new module, passes on ``args`` and
        ``kwargs``."""
        from thunder.common import transform_for_execution

        try:
            runnable = transform_for_execution(prologue, executors_list=(thunder.pythonex,), use_del_last_used=False)
            runnable[-1].python_callable(include_decorators=False)(*args, **kwargs)
        except Exception:
            return False
        return True

    def thunder_general_jit(fn, args, kwargs, /, *, sharp_edges, ad_hoc_executor):
        key = candidates_key(fn, args, kwargs, sharp_edges)
        for results in kept.get(key, ()) if key is not None else ():
            taken = snapshots(results, fn)
            if accepts(taken.prologue_trace, args, kwargs):
                return taken
        results = original(fn, args, kwargs, sharp_edges=sharp_edges, ad_hoc_executor=ad_hoc_executor)
        temporaries = [ex for ex in get_compile_data().executors_list if isinstance(ex, TemporaryExecutor)]
        if key is not None and all(map(unused, temporaries)) and not results.computation_trace._object_ctx:
            kept.setdefault(key, []).append(snapshots(results, None))
        return results

    thunder_general_jit._shared = True
    thunder.thunder_general_jit = thunder_general_jit


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
    _isa_extension_checks_in_process()
    _decode_each_code_object_once()
    _provenance_records_without_checks()
    _python_frames_without_spinning()
    _callsite_read_alone()
    _missing_nvml_remembered()
    _supported_nodes_checked_once()
    _global_names_looked_up_directly()
    _signatures_read_once()
    _types_checked_once()
    _dataclasses_looked_for_once_per_class()
    _interpretations_shared_across_modules()
    _fewer_cyclic_collections()
