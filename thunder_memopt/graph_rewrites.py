"""The backend's rewrites of a dynamo graph before ThunderCompiler splits it (``rewrite_for_thunder``).

Each works around one thing Thunder 0.2.6 does not do, with the same values:
- collectives, torch 2.11's ``autograd_function_apply`` and changes of ``.data`` run in inductor;
- ``addmm``, ``diff``, ``new_ones``, ``eye``, ``unfold``, ``%`` and torch's aliases (``torch.multiply``)
  become ops Thunder has, so the graph does not split;
- a broadcast 0-d tensor that needs a gradient is broadcast from ones;
- a complex product read through ``view_as_real`` is computed in real ops (one left is warned of);
- in-place ops on tensors the graph makes become out-of-place ones (``in_place_rewrites``).
Each function's docstring says what fails without it.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable

import torch
import torch.fx

from thunder_memopt.causal_inputs import call_with_example_value
from thunder_memopt.in_place_rewrites import (changed_in_place, fill_of_slices_as_cat, in_place_as_out_of_place,
                                              slice_updates_as_cat)

__all__ = [
    "rewrite_for_thunder", "keep_autograd_functions_out_of_thunder", "keep_collectives_out_of_thunder",
    "keep_data_changes_out_of_thunder", "unfold_as_slices",
    "keep_addmm_in_thunder", "aliases_as_their_ops", "keep_mask_preparation_in_thunder",
    "zero_dim_operands_reshaped", "complex_products_as_real", "warn_on_complex_products",
]


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
    keep_data_changes_out_of_thunder(gm)
    complex_products_as_real(gm)
    warn_on_complex_products(gm)
    keep_addmm_in_thunder(gm)
    aliases_as_their_ops(gm)
    unfold_as_slices(gm)
    keep_mask_preparation_in_thunder(gm)
    fill_of_slices_as_cat(gm)
    slice_updates_as_cat(gm)
    in_place_as_out_of_place(gm)
    zero_dim_operands_reshaped(gm)


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
    """A callable Thunder has no mapping for, so its splitter sends the node to inductor; ``target`` is a
    function, or a method's name (the tensor its first argument)."""

    def outside(*args, **kwargs):
        if isinstance(target, str):
            return getattr(args[0], target)(*args[1:], **kwargs)
        return target(*args, **kwargs)

    label = target if isinstance(target, str) else getattr(target, "__name__", "op")
    outside.__name__ = outside.__qualname__ = f"thunder_memopt_outside_thunder_{label}"  # in split reasons
    return outside


def _send_outside_thunder(gm: torch.fx.GraphModule, matches: Callable[[torch.fx.Node], bool]) -> int:
    """Rewrite ``gm`` in place so that each call ``matches`` picks runs outside Thunder; the count."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and matches(n)]
    for n in nodes:
        n.op, n.target = "call_function", _run_outside_thunder(n.target)
    if nodes:
        gm.recompile()
    return len(nodes)


def keep_collectives_out_of_thunder(gm) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so no collective lands in a Thunder region; the count.
    With ``torch._dynamo.config.skip_fsdp_hooks=False`` FSDP2's functional collectives reach the
    backend, and Thunder maps ``wait_tensor`` to identity: the results would be wrong."""
    return _send_outside_thunder(gm, lambda n: _is_collective_target(n.target))


def keep_autograd_functions_out_of_thunder(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that each ``autograd_function_apply`` of the form
    Thunder 0.2.6 cannot trace (no ``args_tensor_mask``: torch 2.11's) runs outside Thunder; the count.
    torch 2.11 traces a custom ``torch.autograd.Function`` (BLOOM's GELU in training) so, with
    ``saved_for_backward_idx``, where Thunder's lookaside reads ``args_tensor_mask`` (KeyError)."""
    return _send_outside_thunder(gm, lambda n: n.target is torch.ops.higher_order.autograd_function_apply
                                 and "args_tensor_mask" not in n.kwargs)


def _changes_data(node: torch.fx.Node) -> bool:
    """Whether ``node`` changes a tensor's ``.data`` in place (``x.data.clamp_(...)``)."""
    target = node.args[0] if node.args else None
    if not (isinstance(target, torch.fx.Node) and target.target is torch._C._autograd._get_data_attr):
        return False
    # An in-place operator (``x.data *= 2``) or any in-place method (``clamp_``, ``zero_``, ``copy_``).
    in_place_method = node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_")
    return in_place_method or changed_in_place(node) is not None


def keep_data_changes_out_of_thunder(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that an in-place change of a tensor's ``.data`` runs
    outside Thunder; the count. ``.data`` itself runs outside (Thunder has no ``_get_data_attr``), and
    the change, in a Thunder region, made that region's inputs alias updates, which Thunder 0.2.6
    failed on where two inputs view one storage at different sizes (Gemma-3n's
    ``self.correction_coefs.weight.data.clamp_(...)`` beside its per-layer inputs and a view of them)."""
    return _send_outside_thunder(gm, _changes_data)


def _complex(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


# Products and quotients whose gradient through complex tensors Thunder 0.2.6 gets wrong: under
# plain ThunderCompiler, ``view_as_real(view_as_complex(q) * w)`` gives q another gradient than
# torch's autograd does (without the product, the same). Sent to inductor, that product failed to
# compile there (view_as_complex's strides).
_COMPLEX_PRODUCTS = {operator.mul, torch.mul, operator.truediv, torch.div, operator.matmul, torch.matmul}


def warn_on_complex_products(gm: torch.fx.GraphModule) -> int:
    """Warn, once per graph, where a product or quotient of two tensors, one of them complex, still
    runs in Thunder (``complex_products_as_real`` rewrites the rotary embeddings' form); the count. A
    complex tensor times a number is left out: its gradient needs no conjugate."""
    count = sum(n.op == "call_function" and n.target in _COMPLEX_PRODUCTS and len(n.all_input_nodes) == 2
                and any(_complex(a.meta.get("example_value")) for a in n.all_input_nodes) for n in gm.graph.nodes)
    if count:
        warnings.warn(f"thunder_memopt: {count} products of complex tensors run in Thunder, which differentiates "
                      f"them wrong (Thunder 0.2.6): the gradients that flow through them differ from torch's; "
                      f"train this model with another backend")
    return count


def _real_and_imaginary(graph: torch.fx.Graph, z: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Nodes of ``z``'s real and imaginary parts, read from the real tensor that ``view_as_complex``
    made ``z`` of, or else from ``view_as_real(z)`` (an op Thunder does not have: it runs outside)."""
    pairs = z.args[0] if z.op == "call_function" and z.target is torch.view_as_complex else None
    if pairs is None:
        pairs = call_with_example_value(graph, torch.view_as_real, (z,))
    return tuple(call_with_example_value(graph, operator.getitem, (pairs, (Ellipsis, i))) for i in (0, 1))


def _combined(graph: torch.fx.Graph, op, first: tuple, second: tuple) -> torch.fx.Node:
    """A node of ``op(first[0] * first[1], second[0] * second[1])``."""
    products = [call_with_example_value(graph, operator.mul, pair) for pair in (first, second)]
    return call_with_example_value(graph, op, tuple(products))


def complex_products_as_real(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that ``view_as_real(x * y)``, with ``x`` and ``y``
    complex, is ``stack([a c - b d, a d + b c], -1)`` of their real and imaginary parts: the rotary
    embedding of DeepSeek-V2 and Llama-4, ``view_as_real(view_as_complex(q) * freqs)``, in real ops.
    Thunder 0.2.6 differentiates the complex product wrong (q's gradient is not torch's). The count
    rewritten; a product read otherwise than through ``view_as_real`` is left (and warned of)."""
    count = 0
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2
                and all(isinstance(a, torch.fx.Node) and _complex(a.meta.get("example_value")) for a in node.args)
                and node.users and all(u.target is torch.view_as_real for u in node.users)):
            continue
        with gm.graph.inserting_before(node):
            (a, b), (c, d) = (_real_and_imaginary(gm.graph, z) for z in node.args)
            real = _combined(gm.graph, operator.sub, (a, c), (b, d))
            imaginary = _combined(gm.graph, operator.add, (a, d), (b, c))
            pairs = call_with_example_value(gm.graph, torch.stack, ((real, imaginary),), {"dim": -1})
        for view in list(node.users):
            view.replace_all_uses_with(pairs)
            gm.graph.erase_node(view)
        factors = node.args
        gm.graph.erase_node(node)
        # Not the graph's dead-code pass: it would drop in-place ops whose results nothing reads.
        for z in factors:
            if not z.users and z.target is torch.view_as_complex:
                gm.graph.erase_node(z)
        count += 1
    if count:
        gm.recompile()
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


# torch's aliases that Thunder 0.2.6 has no symbol for, and the ops they stand for, with the same
# parameters (torch documents each as an alias).
_ALIASES = {
    "multiply": "mul", "subtract": "sub", "divide": "div", "negative": "neg", "absolute": "abs", "clip": "clamp",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne", "fix": "trunc",
    "arccos": "acos", "arcsin": "asin", "arctan": "atan", "arctan2": "atan2", "moveaxis": "movedim",
}
_ALIAS_FUNCTIONS = {getattr(module, alias): getattr(module, op) for alias, op in _ALIASES.items()
                    for module in (torch, torch.Tensor)}


def aliases_as_their_ops(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that each call of one of torch's aliases
    (``torch.multiply``, ``x.clip``, ...) calls the op it stands for; the count rewritten. Thunder
    runs the aliases only through its torch fallback, and its splitter sends them to inductor:
    Gemma-3n's ``torch.multiply`` split each layer, and the in-place add after it then changed a
    region's input, which Thunder's ``copy_`` refuses. ``%`` of a tensor, which Thunder does not map
    at all (its meta fails), is ``torch.remainder``, as torch defines it: BLT's n-gram hash split
    its ``torch.no_grad()`` block, and the step's grad mode stayed off after it."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _ALIAS_FUNCTIONS:
            node.target = _ALIAS_FUNCTIONS[node.target]
        elif node.op == "call_function" and node.target is operator.mod and any(
                isinstance(a.meta.get("example_value"), torch.Tensor) for a in node.all_input_nodes):
            node.target = torch.remainder
        elif node.op == "call_method" and node.target in _ALIASES:
            node.target = _ALIASES[node.target]
        else:
            continue
        count += 1
    if count:
        gm.recompile()
    return count


# The widest window written as slices; a wider one is left as it is (where Thunder's splitter fails).
_UNFOLD_SLICES = 64


def unfold_as_slices(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that ``x.unfold(dim, size, step)`` is the ``stack``,
    on a new last axis, of ``size`` strided slices of ``x`` along ``dim`` (the same values); the count.
    ThunderCompiler 0.2.6's splitter fails on ``unfold``: its automatic registration raises im2col's
    error ("Expected 3D or 4D (batch mode) tensor": BLT's hash of byte n-grams). Sent to inductor
    instead, it would split that hash's ``torch.no_grad()`` block, as ``%`` did (``aliases_as_their_ops``)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target not in ("unfold", torch.Tensor.unfold) or node.kwargs or len(node.args) != 4:
            continue
        x, dim, size, step = node.args
        value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(value, torch.Tensor) and all(isinstance(a, int) for a in (dim, size, step, *value.shape))
                and 0 < size <= _UNFOLD_SLICES and step > 0 and value.ndim > 0 and size <= value.shape[dim]):
            continue
        dim %= value.ndim
        span = (value.shape[dim] - size) // step * step + 1
        with gm.graph.inserting_before(node):
            slices = [call_with_example_value(gm.graph, operator.getitem,
                                              (x, (*(slice(None),) * dim, slice(i, i + span, step))))
                      for i in range(size)]
            windows = call_with_example_value(gm.graph, torch.stack, (slices,), {"dim": -1})
        node.replace_all_uses_with(windows)
        gm.graph.erase_node(node)
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
    Thunder has, with the same values; the count rewritten. transformers' mask preparation calls the
    first two; ThunderCompiler's splitter would hand them to inductor, and the graph would split
    between the ops that make the causal mask and the attention that reads it, where the
    ``causal_mask`` pass can no longer see how the mask was made."""
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


# Elementwise ops that broadcast their tensor operands to their result's shape.
_BROADCASTING = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
                 operator.pow, torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.where, torch.maximum,
                 torch.minimum, torch.atan2, torch.lerp}
_BROADCASTING_METHODS = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "atan2", "lerp"}


def zero_dim_operands_reshaped(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that a 0-d tensor the graph makes, that needs a
    gradient and that an elementwise op broadcasts, reaches the op reshaped to ones of the result's
    rank (the same values); the count. Thunder 0.2.6 does not sum the gradient of such a tensor over
    the broadcast: ``a.sum() * x`` failed in its backward (an ``expand`` of the unsummed gradient:
    DiffLlama's ``lambda_full * attn_output2``, HY-V4), and ``a.sum() * a`` gave ``a`` a wrong
    gradient, under plain ThunderCompiler too. A 0-d input of the graph (a parameter) is not affected."""
    count = 0
    for node in list(gm.graph.nodes):
        if not ((node.op == "call_function" and node.target in _BROADCASTING)
                or (node.op == "call_method" and node.target in _BROADCASTING_METHODS)):
            continue
        result = node.meta.get("example_value")
        if not isinstance(result, torch.Tensor) or result.ndim == 0:
            continue
        for operand in node.all_input_nodes:
            value = operand.meta.get("example_value")
            if (operand.op != "placeholder" and isinstance(value, torch.Tensor) and value.ndim == 0
                    and value.requires_grad):
                with gm.graph.inserting_before(node):
                    ones = call_with_example_value(gm.graph, torch.reshape, (operand, (1,) * result.ndim))
                node.replace_input_with(operand, ones)
                count += 1
    if count:
        gm.recompile()
    return count

