"""A ``torch.compile`` backend: Thunder's ThunderCompiler with MemoryOptimization enabled and
thunder_memopt's executors (``thunder_memopt.executors()``) in front of Thunder's.

ThunderCompiler appends its own transform to the list it is given and shares the transform
instances across every dynamo subgraph. This helper gives it a fresh list, so the caller's list is
never mutated.

With ``torch._dynamo.config.skip_fsdp_hooks=False`` FSDP2's functional collectives reach the
backend, and Thunder maps ``wait_tensor`` to identity: the results are wrong. The backend hides
those nodes from Thunder (``keep_collectives_out_of_thunder``), so its splitter hands them to
inductor, which implements them.

Its options are checked when it is built, not at the first call inside dynamo: ``transforms`` and
``executors`` by type, and any other keyword by name, against what Thunder 0.2.6 reads
(``THUNDER_OPTIONS``), since ThunderCompiler passes every keyword on to ``thunder.jit``, which
takes any name and ignores those it does not know.

torch 2.11 traces a custom ``torch.autograd.Function`` (BLOOM's GELU in training) to
``autograd_function_apply`` with ``saved_for_backward_idx``, where Thunder 0.2.6's lookaside reads
``args_tensor_mask`` and fails to trace the graph (KeyError). The backend hands such nodes to
inductor (``keep_autograd_functions_out_of_thunder``), which runs them as torch does.

GPT-2's Conv1D (and other models') ``torch.addmm(bias, x, w)``, which Thunder runs only through its
torch fallback, would split the graph at every projection; the backend writes it as
``F.linear(x, w.t(), bias)`` (``keep_addmm_in_thunder``), which Thunder has and which torch runs as
that same ``addmm``.

transformers' mask preparation calls two ops that Thunder runs only through its torch fallback,
``torch.diff`` (of the position ids, for packed sequences) and ``Tensor.new_ones``; ThunderCompiler's
splitter hands such nodes to inductor, so that the graph splits there, between the ops that make
the causal mask and the attention that reads it. The backend rewrites them into ops Thunder has
(``keep_mask_preparation_in_thunder``), with the same values, so that the mask is made in the
attention's Thunder region, where the ``causal_mask`` pass can see how it was made. Where the mask
is made in one dynamo graph and read in another (FSDP2 breaks the graph at each unit), the proof
crosses with the tensor (thunder_memopt.causal_inputs).

DeepSeek's multi-head latent attention (and the models made from it: MiniCPM3, GLM-4-MoE-Lite,
LongCat-Flash, Youtu, ...) fills an empty tensor by ``copy_`` into slices of its last axis; Thunder
0.2.6 fails on that in-place form where the region's inputs view one storage at different sizes
(its ``insert_alias_updates`` reshapes one into the other), as that attention's split of keys and
values does. The backend writes it as the ``torch.cat`` of the sources (``fill_of_slices_as_cat``).
A product of complex tensors (DeepSeek-V2's and Llama-4's rotary embeddings) gets one warning:
Thunder differentiates it wrong (``warn_on_complex_products``). ``torch.eye`` (Qwen3.5's and
OLMo-Hybrid's linear attention), which Thunder does not have, becomes a comparison of aranges.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import thunder
import torch
import torch.fx
from thunder.core.transform_common import Transform
from thunder.extend import Executor, get_executor

from thunder_memopt.causal_inputs import call_with_example_value, compile_with_causal_inputs
from thunder_memopt.executors import cudnn_attention_ex, executors
from thunder_memopt.transform import MemoryOptimization

__all__ = [
    "THUNDER_OPTIONS", "rewrite_for_thunder", "keep_autograd_functions_out_of_thunder",
    "keep_collectives_out_of_thunder", "keep_addmm_in_thunder", "keep_mask_preparation_in_thunder",
    "fill_of_slices_as_cat", "warn_on_complex_products", "thunderfx_backend",
]

# thunder.jit's keyword parameters, and the compile options that Thunder 0.2.6 (the pinned
# version) and its ThunderCompiler read: ``get_compile_option``'s names and ``compile_options``'s keys.
THUNDER_OPTIONS = frozenset(
    {name for name, p in inspect.signature(thunder.jit).parameters.items() if p.kind is p.KEYWORD_ONLY}
    | {
        "auto_recompute_intermediates", "cudnn_sdpa_bwd_may_cat_grad_qkv", "disable_inplace_copy_check",
        "disable_replace_uniform", "fp8_shard_intermediate_activation", "fusion_type", "nv_disable_options",
        "nv_enable_embedding", "nv_enable_linear", "nv_enable_matmul", "nv_enable_options", "nv_enable_scatter",
        "nv_enable_sdpa", "nv_enable_shape_only_fusion", "nv_save_fake_inputs", "nv_skip_cache",
        "nv_store_fusion_inputs", "sdpa_debug", "skip_inplace_alias_updates", "te_fp8_recipe",
        "thunderfx_disable_split_autograd", "torch_compile_fullgraph", "use_apex_cross_entropy",
    }
)


def _check_list(name: str, value: object, is_item, what: str) -> None:
    """``value`` must be a list or tuple of items that ``is_item`` accepts: a TypeError naming
    ``name`` (and the first bad item) otherwise."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"thunderfx_backend: {name} must be a list of {what}, got {value!r}")
    bad = next((item for item in value if not is_item(item)), None)
    if bad is not None:
        raise TypeError(f"thunderfx_backend: {name} must be a list of {what}, got the item {bad!r}")


def _check_thunder_options(options: dict[str, Any]) -> None:
    unknown = sorted(set(options) - THUNDER_OPTIONS)
    if unknown:
        raise TypeError(f"thunderfx_backend: unknown option {unknown[0]!r} (neither thunderfx_backend's, "
                        f"nor a thunder.jit or Thunder compile option)")
    if "transforms" in options:
        _check_list("transforms", options["transforms"], lambda t: isinstance(t, Transform), "thunder Transforms")
    if "executors" in options:
        _check_list("executors", options["executors"],
                    lambda e: isinstance(e, Executor) or (isinstance(e, str) and get_executor(e) is not None),
                    "thunder Executors or names of registered executors")


def thunderfx_backend(
    memory_optimization: MemoryOptimization | None = None,
    *,
    fusion: bool = True,
    cudnn_attention: bool | None = None,
    loss_head: bool | None = None,
    **thunder_options: Any,
):
    """A ThunderCompiler with ``memory_optimization`` (default ``MemoryOptimization()``) first.

    ``fusion``, ``cudnn_attention`` and ``loss_head`` choose thunder_memopt's executors (``executors()``), unless
    ``executors=`` is given among the ThunderCompiler options; ``fusion=False`` keeps every op as
    plain ThunderCompiler runs the graph that ``rewrite_for_thunder`` gives it, bit for bit.
    ``thunder_options``: thunder.jit's options and Thunder's
    compile options (``THUNDER_OPTIONS``), passed on; ``transforms`` run after ``memory_optimization``.
    """
    from thunder.dynamo import ThunderCompiler

    if memory_optimization is not None and not isinstance(memory_optimization, MemoryOptimization):
        raise TypeError(
            "thunderfx_backend: memory_optimization must be a MemoryOptimization instance or None, "
            f"got {memory_optimization!r}"
        )
    _check_thunder_options(thunder_options)
    chosen = executors(fusion=fusion, cudnn_attention=cudnn_attention, loss_head=loss_head)
    thunder_options.setdefault("executors", chosen)
    transform = memory_optimization if memory_optimization is not None else MemoryOptimization()
    transforms = [transform, *thunder_options.pop("transforms", [])]
    compiler = ThunderCompiler(transforms=transforms, **thunder_options)
    # The causal_mask pass runs where cuDNN attention is asked for; so do its proofs across graphs.
    causal_inputs = "causal_mask" in transform.passes and any(
        e is cudnn_attention_ex or e == cudnn_attention_ex.name for e in thunder_options["executors"])

    def backend(gm, example_inputs):
        rewrite_for_thunder(gm)
        if causal_inputs:
            return compile_with_causal_inputs(gm, example_inputs, compiler)
        return compiler(gm, example_inputs)

    backend.compiler = compiler  # subgraph_infos and traces stay reachable
    return backend


def rewrite_for_thunder(gm: torch.fx.GraphModule) -> None:
    """The backend's rewrites of a dynamo graph, in place, before ThunderCompiler splits it.

    Where they join what plain ThunderCompiler splits, the gradient of a tensor used in several
    places sums its uses' contributions in another order: Thunder's backward adds them in the order
    one trace meets them, autograd adds what each region returns. On GPT-2 the mask's rewrite joins
    the embeddings to the first block, and the addmm's joins each projection to its neighbours:
    the embeddings' gradients (three terms: the residual and two of LayerNorm's) and some biases'
    differ from plain ThunderCompiler's in the last bit. Splitting as it splits would undo what the
    rewrites are for (tests/test_transformers.py)."""
    keep_collectives_out_of_thunder(gm)
    keep_autograd_functions_out_of_thunder(gm)
    warn_on_complex_products(gm)
    keep_addmm_in_thunder(gm)
    keep_mask_preparation_in_thunder(gm)
    fill_of_slices_as_cat(gm)


# Namespaces of FSDP2's traced communication: functional collectives and its copy-in/out ops.
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "fsdp"}


def _is_collective_target(target) -> bool:
    namespace = getattr(target, "namespace", None)  # OpOverload and OpOverloadPacket
    if namespace is None:
        namespace = str(getattr(target, "_qualified_op_name", "")).split("::")[0] or None
    if namespace in _COLLECTIVE_NAMESPACES:
        return True
    return getattr(target, "__module__", "") == "torch.distributed._functional_collectives"


def _run_outside_thunder(target):
    """A callable Thunder has no mapping for, so its splitter sends the node to inductor."""

    def collective(*args, **kwargs):
        return target(*args, **kwargs)

    name = f"thunder_memopt_outside_thunder_{getattr(target, '__name__', 'op')}"
    collective.__name__ = collective.__qualname__ = name  # what ThunderCompiler's split reasons show
    return collective


def _send_outside_thunder(gm: torch.fx.GraphModule, matches: Callable[[torch.fx.Node], bool]) -> int:
    """Rewrite ``gm`` in place so that each call ``matches`` picks runs outside Thunder; the count."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and matches(n)]
    for n in nodes:
        n.target = _run_outside_thunder(n.target)
    if nodes:
        gm.recompile()
    return len(nodes)


def keep_collectives_out_of_thunder(gm) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so no collective lands in a Thunder region; the count."""
    return _send_outside_thunder(gm, lambda n: _is_collective_target(n.target))


def keep_autograd_functions_out_of_thunder(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that each ``autograd_function_apply`` of the form
    Thunder 0.2.6 cannot trace (no ``args_tensor_mask``: torch 2.11's) runs outside Thunder; the count."""
    return _send_outside_thunder(gm, lambda n: n.target is torch.ops.higher_order.autograd_function_apply
                                 and "args_tensor_mask" not in n.kwargs)


def _complex(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


# Products and quotients whose gradient through complex tensors Thunder 0.2.6 gets wrong: under
# plain ThunderCompiler, ``view_as_real(view_as_complex(q) * w)`` gives q another gradient than
# torch's autograd does (without the product, the same).
_COMPLEX_PRODUCTS = {operator.mul, torch.mul, operator.truediv, torch.div, operator.matmul, torch.matmul}


def warn_on_complex_products(gm: torch.fx.GraphModule) -> int:
    """Warn, once per graph, where a product or quotient of complex tensors may run in Thunder; the
    count. Sent to inductor, such a rotary embedding (DeepSeek-V2's and Llama-4's
    ``view_as_complex(q) * freqs_cis``) fails to compile there, so it stays, and its gradients are
    Thunder's: their query projection's off by more than its own size on the narrowed models of
    benchmarks/diagnostics/hf_conformance.py."""
    count = sum(n.op == "call_function" and n.target in _COMPLEX_PRODUCTS
                and any(_complex(a.meta.get("example_value")) for a in n.all_input_nodes) for n in gm.graph.nodes)
    if count:
        warnings.warn(f"thunder_memopt: {count} products of complex tensors run in Thunder, which differentiates "
                      f"them wrong (Thunder 0.2.6): the gradients that flow through them differ from torch's; "
                      f"train this model with another backend")
    return count


def keep_addmm_in_thunder(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that each ``torch.addmm(bias, x, w)`` with a 1-d bias
    (no ``beta``, ``alpha``) is ``F.linear(x, w.t(), bias)``: for a 2-d ``x``, aten's ``linear`` is that
    ``addmm``, on ``w.t().t()``, a view with ``w``'s strides. The count rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.addmm or node.kwargs or len(node.args) != 3:
            continue
        bias, x, w = node.args
        if not all(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)
                   for a in (bias, x, w)) or bias.meta["example_value"].ndim != 1:
            continue
        with gm.graph.inserting_before(node):
            transposed = call_with_example_value(gm.graph, torch.t, (w,))
        node.target, node.args = torch.nn.functional.linear, (x, transposed, bias)
        count += 1
    if count:
        gm.recompile()
    return count


_DIFF = ("input", "n", "dim", "prepend", "append")


def _diff_as_slices(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """``torch.diff`` (n=1) as the difference of two slices of the concatenation of its operands (of
    ``ne`` for booleans, as torch's logical_xor); False where it is another form."""
    given = {**dict(zip(_DIFF, node.args)), **node.kwargs}
    x, n, dim = given["input"], given.get("n", 1), given.get("dim", -1)
    parts = [p for p in (given.get("prepend"), x, given.get("append")) if p is not None]
    if n != 1 or not all(isinstance(p, torch.fx.Node) and "example_value" in p.meta for p in parts):
        return False
    value = x.meta["example_value"]
    d = dim % value.ndim
    before = (slice(None),) * d
    with graph.inserting_before(node):
        joined = call_with_example_value(graph, torch.cat, (parts,), {"dim": d}) if len(parts) > 1 else x
        later = call_with_example_value(graph, operator.getitem, (joined, (*before, slice(1, None))))
        earlier = call_with_example_value(graph, operator.getitem, (joined, (*before, slice(None, -1))))
        difference = call_with_example_value(graph, operator.ne if value.dtype == torch.bool else operator.sub,
                                             (later, earlier))
    node.replace_all_uses_with(difference)
    graph.erase_node(node)
    return True


def _new_ones_as_ones(node: torch.fx.Node) -> bool:
    """``x.new_ones(size, ...)`` as ``torch.ones`` of its result's shape, dtype and device; False for
    a shape dynamo left symbolic."""
    result = node.meta.get("example_value")
    if not isinstance(result, torch.Tensor) or not all(isinstance(s, int) for s in result.shape):
        return False
    node.op, node.target = "call_function", torch.ones
    node.args, node.kwargs = (tuple(result.shape),), {"dtype": result.dtype, "device": result.device}
    return True


def _eye_as_comparison(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """``torch.eye(n[, m], dtype=..., device=...)`` as ``(arange(n)[:, None] == arange(m)) .to(dtype)``,
    the same values (Thunder 0.2.6 has no ``eye``: Qwen3.5's and OLMo-Hybrid's linear attention
    failed in Thunder's interpreter); False for a size dynamo left symbolic."""
    result = node.meta.get("example_value")
    if not isinstance(result, torch.Tensor) or result.ndim != 2 or not all(isinstance(s, int) for s in result.shape):
        return False
    rows, columns = result.shape
    on = {"device": result.device}
    # The aranges' example values made in the graph's fake mode, as dynamo would (they read no node).
    with graph.inserting_before(node), getattr(result, "fake_mode", None) or contextlib.nullcontext():
        row = call_with_example_value(graph, torch.arange, (rows,), on)
        column = call_with_example_value(graph, torch.arange, (columns,), on)
        row = call_with_example_value(graph, torch.unsqueeze, (row, 1))
        diagonal = call_with_example_value(graph, torch.eq, (row, column))
        eye = call_with_example_value(graph, torch.Tensor.to, (diagonal, result.dtype))
    node.replace_all_uses_with(eye)
    graph.erase_node(node)
    return True


def keep_mask_preparation_in_thunder(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that ``torch.diff``, ``Tensor.new_ones`` and
    ``torch.eye``, which Thunder runs only through its torch fallback or not at all, become ops
    Thunder has, with the same values; the count rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if (node.op, node.target) in (("call_function", torch.diff), ("call_method", "diff")):
            count += _diff_as_slices(gm.graph, node)
        elif (node.op, node.target) == ("call_method", "new_ones"):
            count += _new_ones_as_ones(node)
        elif (node.op, node.target) == ("call_function", torch.eye):
            count += _eye_as_comparison(gm.graph, node)
    if count:
        gm.recompile()
    return count


def _last_axis_span(index, size: int) -> tuple[int, int] | None:
    """``(start, stop)`` where ``index`` is ``(..., slice(start, stop))`` with step 1."""
    if not (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)):
        return None
    start, stop, step = index[1].indices(size)
    return (start, stop) if step == 1 and start < stop else None


def _fill_as_cat(graph: torch.fx.Graph, empty: torch.fx.Node) -> bool:
    """``empty`` (``new_empty`` or ``torch.empty``) filled by ``copy_`` into slices that tile its last
    axis before any other use, as the ``torch.cat`` of the sources, each broadcast to its slice's
    shape and cast to ``empty``'s dtype (as ``copy_`` does); False where it is another form."""
    value = empty.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.ndim == 0 or not all(isinstance(s, int) for s in value.shape):
        return False
    fills, others = [], []
    for user in empty.users:
        span = _last_axis_span(user.args[1], value.shape[-1]) if user.target is operator.getitem else None
        copies = list(user.users)
        if span is None or len(copies) != 1 or copies[0].target != "copy_" or copies[0].args[0] is not user:
            others.append(user)
            continue
        (copy,) = copies
        if copy.users or copy.kwargs or len(copy.args) != 2 or not isinstance(copy.args[1], torch.fx.Node):
            return False
        fills.append((span, user, copy))
    fills.sort(key=lambda f: f[0])
    spans = [f[0] for f in fills]
    if not fills or spans[0][0] != 0 or spans[-1][1] != value.shape[-1] or any(
            a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max((f[2] for f in fills), key=order.get)
    if any(order[o] < order[last] for o in others):
        return False
    pieces = []
    with graph.inserting_before(last.next):  # in order (inserting_after(last) would reverse them)
        for (start, stop), _, copy in fills:
            source = copy.args[1]
            piece = call_with_example_value(graph, torch.Tensor.expand, (source, *value.shape[:-1], stop - start))
            if source.meta["example_value"].dtype != value.dtype:
                piece = call_with_example_value(graph, torch.Tensor.to, (piece, value.dtype))
            pieces.append(piece)
        joined = call_with_example_value(graph, torch.cat, (pieces,), {"dim": -1})
    for o in others:
        o.replace_input_with(empty, joined)
    for _, view, copy in fills:
        graph.erase_node(copy)
        graph.erase_node(view)
    graph.erase_node(empty)
    return True


def fill_of_slices_as_cat(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that an empty tensor filled by ``copy_`` into
    slices that tile its last axis is the ``torch.cat`` of what is copied (``_fill_as_cat``), the
    same values with no in-place op; the count rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if (node.op, node.target) in (("call_method", "new_empty"), ("call_function", torch.empty)):
            count += _fill_as_cat(gm.graph, node)
    if count:
        gm.recompile()
    return count
