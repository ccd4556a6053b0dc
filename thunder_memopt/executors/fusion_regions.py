"""A fusion region on the trace's side: which claimed symbols make one and in what order, the
outputs it returns, and the region as a trace of its own and as a key of the compiled functions'
cache. Nothing here compiles: ``executors/fusion.py`` builds the regions' bound symbols from these
pieces and compiles each region's trace (``executors/inductor_compile.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from thunder.core import prims, utils
from thunder.core.codeutils import SigInfo
from thunder.core.proxies import Proxy, ProxyInterface, TensorProxy, unvariableify, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx
from thunder.executors.torchex import ex as pytorch_ex
from thunder.executors.utils import Region

from thunder_memopt.core.ops import moves_data

__all__: list[str] = []  # helpers of executors/fusion.py alone


def _kernels(group: Sequence[BoundSymbol]) -> int:
    """How many kernels the torch executor would run for ``group``: one per op that moves data
    (an op of the torch level is one ATen call, whatever prims it decomposes into)."""
    return sum(1 for b in group if moves_data(b))


def _grouped_apart(bsyms: Sequence[BoundSymbol], claimed: Sequence[bool],
                   apart: Callable[[BoundSymbol], bool] | None) -> list[BoundSymbol]:
    """``bsyms`` with each maximal run of claimed symbols reordered, dependencies kept, so that the
    symbols ``apart`` picks and the others stand in as few alternating groups as possible."""
    if apart is None:
        return list(bsyms)
    out: list[BoundSymbol] = []
    run: list[BoundSymbol] = []
    for b, c in zip(bsyms, claimed):
        if c:
            run.append(b)
            continue
        out.extend(_fewest_groups(run, [apart(r) for r in run]))
        run.clear()
        out.append(b)
    out.extend(_fewest_groups(run, [apart(r) for r in run]))
    return out


def _fewest_groups(run: Sequence[BoundSymbol], flags: Sequence[bool]) -> list[BoundSymbol]:
    """``run`` (in dependency order) ordered into groups of alternating flags: group k holds the
    symbols that k flag changes must precede. Each symbol goes to the latest group its readers in
    the run allow: a value made in an early group for a reader two groups on would be written out
    and read back, where in its reader's group it stays in registers. Both flags are tried first."""
    if not run:
        return []
    produced = {o.name: i for i, b in enumerate(run) for o in b.flat_proxy_outs if hasattr(o, "name")}
    preds = [{produced[a.name] for a in b.flat_proxy_args if getattr(a, "name", None) in produced} - {i}
             for i, b in enumerate(run)]
    readers: list[list[int]] = [[] for _ in run]
    for i, ps in enumerate(preds):
        for j in ps:
            readers[j].append(i)
    best: tuple[int, list[int]] | None = None
    for first in (flags[0], not flags[0]):
        def fits(k: int, i: int) -> bool:  # group k holds symbols of flag ``first`` when k is even
            return (k % 2 == 0) == (flags[i] == first)

        level = [0] * len(run)
        for i in range(len(run)):  # the earliest group after its inputs'
            k = max((level[j] for j in preds[i]), default=0)
            level[i] = k if fits(k, i) else k + 1
        last = max(level)
        for i in reversed(range(len(run))):  # then the latest before its readers'
            k = min((level[r] for r in readers[i]), default=last)
            level[i] = k if fits(k, i) else k - 1
        used = sorted(set(level))
        groups = 1 + sum(1 for a, b in zip(used, used[1:]) if (a - b) % 2)
        if best is None or groups < best[0]:
            best = (groups, level)
    level = best[1]
    return [run[i] for i in sorted(range(len(run)), key=lambda i: (level[i], i))]


def _add_outputs(region: Region, extra: Sequence[Proxy]) -> None:
    produced = {o.name for b in region.bound_symbols for o in b.flat_proxy_outs if hasattr(o, "name")}
    order = {o.name: i for i, b in enumerate(region.bound_symbols) for o in b.flat_proxy_outs if hasattr(o, "name")}
    outputs = {unvariableify(v).name: v for v in region.outputs}
    for p in extra:
        if p.name in produced:
            outputs.setdefault(p.name, variableify(p))
    region.outputs = utils.OrderedSet(sorted(outputs.values(), key=lambda v: order[unvariableify(v).name]))


def _outputs_like(outputs: tuple[TensorProxy, ...], *args) -> tuple[TensorProxy, ...]:
    """The fusion's meta, for checks that re-trace a trace (``check_trace``): fixed shapes."""
    return tuple(TensorProxy(like=o) if isinstance(o, TensorProxy) else o for o in outputs)


def _metadata(p: Proxy) -> tuple:
    if isinstance(p, TensorProxy):
        return (tuple(p.shape), str(p.dtype), str(p.device))
    return (type(p).__name__,)


def _region_trace(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> TraceCtx:
    """A trace of the region alone, lowered to the torch executor, to compile. Thunder's
    ``torch_compile.make_compiled`` builds the same but compiles it itself, without a way to pass
    inductor options (EAGER_NUMERICS, NO_AUTOTUNING)."""
    from thunder.executors.passes import transform_for_execution

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
        for o in (*b.flat_outs, *(o for s in b.subsymbols for o in s.flat_outs)):
            if o is not None and hasattr(o, "name"):
                trace.names.add(o.name)
    trace._siginfo = SigInfo("memopt_region")
    trace._siginfo.args = [(a.name, None) for a in inputs]
    return transform_for_execution(trace, executors_list=(pytorch_ex,))


def _canonical(region: list[BoundSymbol], inputs: list[Proxy], outputs: list[Proxy]) -> tuple:
    """The region's ops and arguments, with proxies named by their order of appearance."""
    ids: dict[str, int] = {a.name: i for i, a in enumerate(inputs)}

    def leaf(x):
        if isinstance(x, ProxyInterface) and hasattr(x, "name"):
            return ("proxy", ids.setdefault(x.name, len(ids)))
        return repr(x)

    ops = []
    for b in region:
        flat_args, _ = tree_flatten((b.args, b.kwargs))
        flat_outs, _ = tree_flatten(b.output)
        ops.append((str(b.sym.id), tuple(map(leaf, flat_args)), tuple(map(leaf, flat_outs))))
    return tuple(ops), tuple(ids[o.name] for o in outputs)
