"""Fuse replays: run each stretch of replayed elementwise ops in the backward as one compiled kernel.

Without nvFuser, Thunder runs decomposed LayerNorm, GELU and rotary one op at a time: every cast to
fp32 and every multiply reads and writes a whole activation. The recompute pass replays those ops
in the backward, so unfused they cost their forward time a second time; on an H200 that is about
a fifth of a stablecode step. Fused, a stretch reads the saved tensors once and writes only what
the backward reads.

This pass compiles each maximal stretch of consecutive replayed ops with ``torch.compile``
(inductor), as Thunder's ``torch_compile_ex`` does, with inductor's eager-numerics options: no
elision of bf16/fp32 round trips and no fused multiply-add (``emulate_precision_casts``), correctly
rounded division, no flushing of denormals. Reductions (the norms' ``var_mean``) are never fused:
inductor reduces in another order than ATen, so they run as in the forward. Stretches with the same
ops on the same shapes (every layer's) share one compiled function.

Numerics: fused replays are close to, not bit-identical with, the forward's values. On an H200 the
loss is unchanged and gradients differ by at most 3e-5 on narrowed models; even with those options,
inductor's fp32 -> bf16 -> fp32 round trip does not always match ATen's
(benchmarks/results/fuse_numerics_h200.md). ``MemoryOptimization(fuse_replays=False)`` keeps the
replays unfused and the step bit-identical to plain Thunder, at about a fifth more step time.

Ops that already ran in a fusion (nvFuser, ``torch_compile_ex``) are left as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from thunder.core import prims
from thunder.core.codeutils import SigInfo
from thunder.core.proxies import ProxyInterface, TensorProxy
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx, tracectx

from thunder_memopt.memory import replace_bound_symbols, strip_deletions, symbols, tensor_args, tensor_outs
from thunder_memopt.recompute import COPY_LEAVES, ELEMENTWISE_LEAVES, VIEW_LEAVES, leaf_names

__all__ = ["EAGER_NUMERICS", "FuseResult", "fusible", "fuse_replays", "can_fuse_on"]

# Inductor options that bring fused elementwise code closest to ATen's one-op-at-a-time rounding.
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
}

# The replayed ops inductor fuses: not the norms' reductions (inductor reduces in another order than
# ATen), nor the integer, rounding, triangular, padding and flipping ops, whose fused numerics
# benchmarks/results/fuse_numerics_h200.md did not measure.
_UNMEASURED_LEAVES = {
    "floor_divide", "bitwise_and", "bitwise_or", "bitwise_not", "signbit", "fmod", "remainder", "floor",
    "ceil", "round", "trunc", "tril", "triu", "pad", "flip",
}
_FUSIBLE_LEAVES = set((ELEMENTWISE_LEAVES | VIEW_LEAVES | COPY_LEAVES) - _UNMEASURED_LEAVES)


def fusible(bsym: BoundSymbol) -> bool:
    """Whether ``bsym`` is an elementwise op, cast or view that inductor may fuse (no reductions)."""
    if any(getattr(s, "is_fusion", False) for s in symbols(bsym)):
        return False
    if not all(isinstance(a, TensorProxy) for a in bsym.flat_proxy_args):
        return False
    return all(n in _FUSIBLE_LEAVES for n in leaf_names(bsym))


def _moves_data(bsym: BoundSymbol) -> bool:
    return any(n not in VIEW_LEAVES for n in leaf_names(bsym))


def can_fuse_on(replayed: Sequence[TensorProxy]) -> bool:
    """Whether the replayed tensors live on CUDA, where inductor generates Triton kernels."""
    from torch.utils._triton import has_triton

    return bool(replayed) and replayed[0].device.type == "cuda" and torch.cuda.is_available() and has_triton()


@dataclass
class FuseResult:
    trace: TraceCtx
    fused_ops: int  # replayed symbols that now run inside a fusion
    fusions: int  # fusion symbols in the trace
    compiled: int  # distinct compiled functions behind them


# Compiled functions by their stretch's canonical ops and their inputs' metadata, so that every
# layer's identical stretch (and every later compilation of the same model) reuses one.
_compiled_functions: dict[tuple, Callable] = {}


def fuse_replays(trace: TraceCtx, replayed: set[str]) -> FuseResult:
    """The backward ``trace`` with each stretch of fusible symbols producing ``replayed`` tensors
    (the recompute pass's outputs) run as one ``torch.compile`` function."""
    bsyms = strip_deletions(trace).bound_symbols
    readers = _readers_after(bsyms)
    out: list[BoundSymbol] = []
    stretch: list[tuple[int, BoundSymbol]] = []
    fused_ops = fusions = 0
    keys: set[tuple] = set()

    def flush() -> None:
        nonlocal fused_ops, fusions
        if sum(_moves_data(b) for _, b in stretch) >= 2:
            fusion, key = _fusion(stretch, readers, f"MemoptReplay{fusions}")
            out.append(fusion)
            keys.add(key)
            fused_ops += len(stretch)
            fusions += 1
        else:
            out.extend(b for _, b in stretch)
        stretch.clear()

    for i, bsym in enumerate(bsyms):
        outs = tensor_outs(bsym)
        if outs and all(o.name in replayed for o in outs) and fusible(bsym):
            stretch.append((i, bsym))
            continue
        flush()
        out.append(bsym)
    flush()
    new = replace_bound_symbols(trace, out, "thunder_memopt fuse: replayed stretches compiled")
    return FuseResult(new, fused_ops, fusions, len(keys))


def _readers_after(bsyms: Sequence[BoundSymbol]) -> dict[str, int]:
    """Tensor name -> index of its last reader (the return counts as a reader)."""
    last: dict[str, int] = {}
    for i, b in enumerate(bsyms):
        for a in b.flat_proxy_args:
            if hasattr(a, "name"):
                last[a.name] = i
    return last


def _fusion(
    stretch: list[tuple[int, BoundSymbol]], last_reader: dict[str, int], name: str
) -> tuple[BoundSymbol, tuple]:
    end = stretch[-1][0]
    produced = {o.name for _, b in stretch for o in tensor_outs(b)}
    inputs: dict[str, TensorProxy] = {}
    for _, b in stretch:
        for a in tensor_args(b):
            if a.name not in produced:
                inputs.setdefault(a.name, a)
    outputs = [o for _, b in stretch for o in tensor_outs(b) if last_reader.get(o.name, -1) > end]
    region = [b for _, b in stretch]
    fn, key = _compiled(region, list(inputs.values()), outputs)
    sym = Symbol(name, meta=functools.partial(_outputs_like, tuple(outputs)), is_fusion=True)
    bsym = BoundSymbol(sym, tuple(inputs.values()), {}, tuple(outputs), tuple(region), _call_ctx={name: fn})
    return bsym, key


def _outputs_like(outputs: tuple[TensorProxy, ...], *args) -> tuple[TensorProxy, ...]:
    """The fusion's meta, for checks that re-trace a trace (``check_trace``): fixed shapes."""
    return tuple(TensorProxy(like=o) for o in outputs)


def _compiled(region: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy]):
    key = (_canonical(region, inputs, outputs), tuple((tuple(a.shape), str(a.dtype), str(a.device)) for a in inputs))
    fn = _compiled_functions.get(key)
    if fn is None:
        source = _region_trace(region, inputs, outputs).python_callable(include_decorators=False)
        fn = torch.no_grad()(torch.compile(source, fullgraph=True, dynamic=False, options=EAGER_NUMERICS))
        _compiled_functions[key] = fn
    return fn, key


def _region_trace(region: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy]) -> TraceCtx:
    """A trace of the region alone, to compile. Thunder's ``torch_compile.make_compiled`` builds the
    same trace but compiles it itself, without a way to pass inductor options (EAGER_NUMERICS)."""
    trace = TraceCtx(None)
    trace.args = inputs
    trace.kwargs = {}
    trace.names = {a.name for a in inputs}
    with tracectx(trace):
        for a in inputs:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += [b.from_bsym() for b in region]
    trace.bound_symbols.append(prims.python_return.bind(outputs, output=None))
    for b in region:
        for o in b.flat_outs:
            if o is not None and hasattr(o, "name"):
                trace.names.add(o.name)
    trace._siginfo = SigInfo("memopt_replay")
    trace._siginfo.args = [(a.name, None) for a in inputs]
    return trace


def _canonical(region: list[BoundSymbol], inputs: list[TensorProxy], outputs: list[TensorProxy]) -> tuple:
    """The region's ops and arguments, with tensors named by their order of appearance."""
    ids: dict[str, int] = {a.name: i for i, a in enumerate(inputs)}

    def leaf(x):
        if hasattr(x, "name") and isinstance(x, ProxyInterface):
            return ("proxy", ids.setdefault(x.name, len(ids)))
        return repr(x)

    ops = []
    for b in region:
        flat_args, _ = tree_flatten((b.args, b.kwargs))
        flat_outs, _ = tree_flatten(b.output)
        ops.append((b.sym.name, tuple(map(leaf, flat_args)), tuple(map(leaf, flat_outs))))
    return tuple(ops), tuple(ids[o.name] for o in outputs)
