"""The backend's rewrites of in-place ops on tensors a dynamo graph makes, as out-of-place ops with the
same values (``graph_rewrites.rewrite_for_thunder`` calls them):
- an empty tensor filled through slices that tile it becomes a ``torch.cat``;
- an update of one span of one axis (``x[1:] += y``) becomes a ``torch.cat``;
- an in-place op on a tensor viewed by nothing before the change (or a single change through a view)
  becomes its out-of-place form.
Thunder 0.2.6 saves a tensor for the backward and then changes it, or fails where a region's inputs
alias at other sizes; each function's docstring says where.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx

from thunder_memopt.causal_inputs import call_with_example_value

__all__ = ["fill_of_slices_as_cat", "slice_updates_as_cat", "in_place_as_out_of_place", "changed_in_place"]


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
    same values with no in-place op; the count rewritten. DeepSeek's multi-head latent attention (and
    MiniCPM3, GLM-4-MoE-Lite, LongCat-Flash, Youtu) fills its keys so; Thunder 0.2.6's
    ``insert_alias_updates`` fails on it where the region's inputs view one storage at different
    sizes, as that attention's split of keys and values does."""
    count = 0
    for node in list(gm.graph.nodes):
        if (node.op, node.target) in (("call_method", "new_empty"), ("call_function", torch.empty)):
            count += _fill_as_cat(gm.graph, node)
    if count:
        gm.recompile()
    return count


# In-place ops and their out-of-place forms, where the two give the same values (the in-place result
# cast to the mutated tensor's dtype). Random fills and copies are not here: they have no such form.
_OUT_OF_PLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.iand: operator.and_, operator.ior: operator.or_,
    operator.ixor: operator.xor,
}
_OUT_OF_PLACE_METHODS = {
    f"{name}_": name for name in (
        "add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
        "sigmoid", "tanh", "relu", "clamp", "clamp_min", "clamp_max", "masked_fill", "index_add",
        "scatter", "scatter_add", "addcmul", "addcdiv", "lerp", "float_power")
}


def changed_in_place(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor node that ``node`` changes in place, where it is one of the ops above."""
    if (node.op == "call_function" and node.target in _OUT_OF_PLACE_OPERATORS) or (
            node.op == "call_method" and node.target in _OUT_OF_PLACE_METHODS):
        target = node.args[0] if node.args else None
        if isinstance(target, torch.fx.Node) and isinstance(target.meta.get("example_value"), torch.Tensor):
            return target
    return None


def _storage(node: torch.fx.Node) -> int | None:
    value = node.meta.get("example_value")
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def in_place_as_out_of_place(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that an in-place op on a tensor that the graph
    makes is its out-of-place form, later uses reading the result (``_changes_alone`` says where);
    the count rewritten. Thunder 0.2.6 turns ``x /= s`` into ``copy_(x / s, x)`` but saves ``x`` for
    the backward, which then reads the new value where it needs the old one: the MoE
    routers' ``weights /= weights.sum(-1, keepdim=True)`` (Mixtral, GLM-4-MoE, HunYuan-MoE, ...) gave
    their router weights a wrong gradient, under plain ThunderCompiler too. A tensor viewed before it
    is changed, or one of the graph's inputs, is left alone: the change must reach the other names."""
    groups: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        storage = _storage(node)
        if storage is not None:
            groups.setdefault(storage, []).append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    count = 0
    for root, *others in groups.values():
        changes = _changes_alone(root, others, order)
        for change in changes:
            _as_out_of_place(gm.graph, change, order)
        count += len(changes)
    if count:
        gm.recompile()
    return count


def _changes_alone(root: torch.fx.Node, others: list[torch.fx.Node], order: dict) -> list[torch.fx.Node]:
    """The in-place changes of ``root``'s tensor among ``others`` (the nodes after ``root`` that share
    its storage, in graph order) that can be out of place: those that come first, where any other
    alias is made after the last of them, so that it reads the final value; or a single change, of
    ``root`` or a view of it, where no other alias made before it is read after it (Gemma-3n's
    ``predictions = predictions.permute(3, 0, 1, 2); predictions += hidden_states``). None
    otherwise, and none for a tensor the graph does not make (an input)."""
    if root.op not in ("call_function", "call_method"):
        return []
    chain = [root]
    for node in others:
        if changed_in_place(node) not in chain:
            break
        chain.append(node)
    changes = chain[1:]
    if all(changed_in_place(n) is None for n in others[len(changes):]):
        return changes
    (change, *more) = [n for n in others if changed_in_place(n) is not None]
    changed = changed_in_place(change)
    read_after = any(order[u] > order[change] for n in (root, *others) if order[n] < order[change]
                     and n is not changed for u in n.users)
    return [] if more or read_after else [change]


def _out_of_place_form(graph: torch.fx.Graph, change: torch.fx.Node) -> torch.fx.Node:
    """A node, inserted before ``change`` (an in-place op on ``x``), of its out-of-place form in ``x``'s
    dtype."""
    dtype = change.args[0].meta["example_value"].dtype
    if change.op == "call_function":
        function = _OUT_OF_PLACE_OPERATORS[change.target]
    else:
        function = getattr(torch.Tensor, _OUT_OF_PLACE_METHODS[change.target])
    with graph.inserting_before(change):
        result = call_with_example_value(graph, function, change.args, change.kwargs)
        if result.meta["example_value"].dtype != dtype:
            result = call_with_example_value(graph, torch.Tensor.to, (result, dtype))
    return result


def _as_out_of_place(graph: torch.fx.Graph, change: torch.fx.Node, order: dict) -> None:
    """``change``, which alters ``x`` in place, as its out-of-place form; the uses of ``x`` after it, and
    its own, read the new tensor."""
    x = change.args[0]
    result = _out_of_place_form(graph, change)
    for use in [u for u in x.users if order.get(u, -1) > order[change]]:
        use.replace_input_with(x, result)
    change.replace_all_uses_with(result)
    graph.erase_node(change)


def _one_axis_span(index, shape: torch.Size) -> tuple[int, int, int, bool] | None:
    """``(dim, start, stop, keeps_dim)`` where ``index`` picks one span of one axis (a slice of step 1,
    or an int, which drops the axis) and all of the others, as ``x[1:]`` or ``x[:, 3]`` do."""
    entries = index if isinstance(index, tuple) else (index,)
    if sum(e is Ellipsis for e in entries) > 1:
        return None
    picks = [(i, e) for i, e in enumerate(entries) if e is not Ellipsis and e != slice(None)]
    if len(picks) != 1 or not all(e is Ellipsis or isinstance(e, int) or (isinstance(e, slice) and all(
            b is None or isinstance(b, int) for b in (e.start, e.stop, e.step))) for e in entries):
        return None  # a tensor index, or a bound dynamo left symbolic
    (position, pick), ellipsis = picks[0], entries.index(Ellipsis) if Ellipsis in entries else len(entries)
    dim = position if position < ellipsis else len(shape) - (len(entries) - position)
    if not 0 <= dim < len(shape) or isinstance(pick, bool):
        return None
    if isinstance(pick, int):
        start = pick % shape[dim] if -shape[dim] <= pick < shape[dim] else None
        return None if start is None else (dim, start, start + 1, False)
    start, stop, step = pick.indices(shape[dim])
    return (dim, start, stop, True) if step == 1 and start < stop else None


def _slice_update_as_cat(graph: torch.fx.Graph, update: torch.fx.Node, order: dict) -> bool:
    """``update`` (``x[index] = value``, or ``x[index] op= y``: a view, its in-place op, the setitem) as
    ``x = cat(before, value, after)`` along the updated axis, later uses reading the new ``x``; False
    where ``x`` is not made by the graph, or another alias of it is read after the update or changed."""
    x, index, value = update.args
    example = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if not (isinstance(example, torch.Tensor) and isinstance(value, (torch.fx.Node, int, float, bool))
            and not update.kwargs and all(isinstance(s, int) for s in example.shape)):
        return False
    span = _one_axis_span(index, example.shape)
    storage = _storage(x)
    aliases = [n for n in graph.nodes if n is not x and _storage(n) == storage]
    view = value.args[0] if isinstance(value, torch.fx.Node) and changed_in_place(value) is not None else None
    made = [n for n in (x, *aliases) if n.op in ("call_function", "call_method")]
    # An alias made before the update must not be read after it; one made after is made of the new x.
    if span is None or len(made) != 1 + len(aliases) or any(
            n is not value and n is not view and (any(order[u] > order[update] for u in n.users)
                                                  if order[n] < order[update] else changed_in_place(n) is not None)
            for n in aliases):
        return False
    if view is not None and not (view.target is operator.getitem and view.args == (x, index)
                                 and list(view.users) == [value] and list(value.users) == [update]):
        return False
    dim, start, stop, keeps_dim = span
    axis = (slice(None),) * dim
    changed = value
    # A number's fill made in the graph's fake mode, as dynamo would (it reads no node).
    with graph.inserting_before(update), getattr(example, "fake_mode", None) or contextlib.nullcontext():
        if view is not None:
            value = _out_of_place_form(graph, changed)
        shape = (*example.shape[:dim], *([stop - start] if keeps_dim else []), *example.shape[dim + 1:])
        if isinstance(value, torch.fx.Node):
            piece = call_with_example_value(graph, torch.Tensor.expand, (value, *shape))
        else:
            piece = call_with_example_value(graph, torch.full, (shape, value),
                                            {"dtype": example.dtype, "device": example.device})
        if not keeps_dim:
            piece = call_with_example_value(graph, torch.unsqueeze, (piece, dim))
        if piece.meta["example_value"].dtype != example.dtype:
            piece = call_with_example_value(graph, torch.Tensor.to, (piece, example.dtype))
        pieces = [call_with_example_value(graph, operator.getitem, (x, (*axis, slice(a, b))))
                  for a, b in ((0, start), (stop, example.shape[dim])) if a < b]
        pieces.insert(1 if start > 0 else 0, piece)
        joined = call_with_example_value(graph, torch.cat, (pieces,), {"dim": dim})
    for use in [u for u in x.users if order.get(u, -1) > order[update]]:
        use.replace_input_with(x, joined)
    graph.erase_node(update)
    if view is not None:
        graph.erase_node(changed)  # its out-of-place form reads the view
    return True


def slice_updates_as_cat(gm: torch.fx.GraphModule) -> int:
    """Rewrite a dynamo ``GraphModule`` in place so that an update of one span of one axis of a tensor
    the graph makes (``x[1:] += y``, ``x[:, 0] = y``) is the ``torch.cat`` of the parts it keeps and
    the new values (``_slice_update_as_cat``); the count rewritten. Gemma-3n's AltUp adds to a slice
    of its predictions in place: where the tensor reached a Thunder region as an input beside a view
    of another input of other size, Thunder 0.2.6's ``insert_alias_updates`` failed (a reshape)."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
            count += _slice_update_as_cat(gm.graph, node, {n: i for i, n in enumerate(gm.graph.nodes)})
    if count:
        gm.recompile()
    return count
