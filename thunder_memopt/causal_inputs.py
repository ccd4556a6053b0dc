"""Causal masks across dynamo graphs: a mask that one graph makes causal, another graph's attention
reads with ``is_causal=True`` (a sliding window: on the window kernels).

Under FSDP2 (``fully_shard`` on each decoder layer) dynamo breaks the graph at every unit, so
transformers' causal mask is made in one graph (``create_causal_mask``) and reaches each decoder
layer's graph as an input, where the ``causal_mask`` pass sees nothing of how it was made. Here the
proof travels with the tensor:

- In the graph that makes a mask, each Thunder region whose outputs the ops that make them prove
  causal or sliding windows (``causal_mask.causal_outputs``) marks those output tensors at run
  time, with their band (0: causal; ``w``: a window of ``w`` keys). transformers
  combines the packed-sequence mask of the position ids, which the layers' units get from eager
  code: such a mask is causal if the position ids count ``0, 1, ...``, and is marked only where they
  do (a comparison of the position ids, not of the mask, and a host sync, once per step).
- A mark is the tensor's entry in a ``WeakIdKeyDictionary``, with its version counter, shape and band:
  keyed by the object's identity, not its values (a tensor's ``==`` is elementwise); it adds
  nothing to the tensor that dynamo guards on or FSDP2 copies; it goes with the tensor; and an
  in-place write (which bumps the version) or a resize voids it.
- A graph with boolean inputs that reach an attention's ``attn_mask`` runs one variant per pattern
  of marked masks among them, each compiled at its first use: where an input is marked, the
  variant reads, in its place, ``tril(ones_like(input))`` (a window: AND-ed with
  ``triu(ones_like(input), 1 - w)``), the same values made in the graph, so that the
  ``causal_mask`` pass proves them and the attention gets ``is_causal=True`` and no mask (or the
  window kernel). Every call picks its variant by the marks (one dictionary look-up per mask input); an
  unmarked mask, a real padding mask among them, runs the variant that reads it, with its numerics.

In torch 2.11 dynamo hands the backend the frame's real tensors as example inputs (a marked mask is
the same object as the producing graph's output), so the variant for the first call is compiled
with the graph. Where the example inputs are fakes, nothing is compiled until the first call.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence

import thunder
import torch
import torch.fx
from torch._guards import CompileContext, compile_context
from thunder.core.pytree import tree_flatten
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from thunder_memopt.passes.causal_mask import causal_outputs

__all__ = ["call_with_example_value", "compile_with_causal_inputs", "is_marked_causal", "marked_band", "mask_inputs"]

# A tensor proven a causal mask or a sliding window -> (its version counter, its shape, its band:
# 0 causal, w a window of w keys) when it was proven.
_MARKED: WeakIdKeyDictionary = WeakIdKeyDictionary()

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


def _mark(t: torch.Tensor, band: int) -> None:
    if not t.is_inference():  # inference tensors have no version counter
        _MARKED[t] = (t._version, t.shape, band)


def marked_band(t: object) -> int | None:
    """The band of ``t`` where it is a tensor that a compiled graph made and proved a causal mask (0)
    or a sliding window of ``w`` keys (``w``), unchanged since; None otherwise."""
    if not isinstance(t, torch.Tensor):
        return None
    mark = _MARKED.get(t)
    return mark[2] if mark is not None and mark[:2] == (t._version, t.shape) else None


def is_marked_causal(t: object) -> bool:
    """Whether ``t`` is a tensor that a compiled graph made and proved a causal mask, unchanged since."""
    return marked_band(t) == 0


def _holds_positions(t: torch.Tensor) -> bool:
    """Whether ``t`` holds ``0, 1, ...`` along its last axis (one host sync)."""
    positions = torch.arange(t.shape[-1], device=t.device, dtype=t.dtype)
    return torch.equal(t, positions.expand(t.shape))


class _MarkingRegion(torch.nn.Module):
    """A Thunder region that marks those of its outputs proven causal masks or windows, on each call."""

    def __init__(self, region: torch.nn.Module) -> None:
        super().__init__()
        self.region = region
        # By the id of a cache entry's traces (held, so that the id stays theirs): the outputs proven
        # causal masks or windows, with their premises and bands (causal_mask.causal_outputs), and
        # the counts of the trace's flattened outputs and inputs.
        self._found: dict[int, tuple[list, dict[int, tuple[tuple[int, ...], int]], int, int]] = {}

    def _causal_outputs(self) -> tuple[dict[int, tuple[tuple[int, ...], int]], int, int]:
        traces = thunder.last_traces(self.region)  # of the cache entry that ran
        entry = self._found.get(id(traces))
        if entry is None:
            trace = traces[0]
            entry = self._found[id(traces)] = (traces, causal_outputs(trace), len(tree_flatten((trace.output,))[0]),
                                               len(tree_flatten((trace.args, trace.kwargs))[0]))
        return entry[1:]

    def forward(self, *args):
        out = self.region(*args)
        causal, n_outputs, n_inputs = self._causal_outputs()
        if causal:
            # Flattened as Thunder flattens the trace's, so that positions match.
            outputs, inputs = tree_flatten((out,))[0], tree_flatten((args, {}))[0]
            holds: dict[int, bool] = {}
            for i, (premise, band) in causal.items():
                if len(outputs) != n_outputs or (premise and len(inputs) != n_inputs):
                    continue
                for j in premise:
                    if j not in holds:
                        holds[j] = _holds_positions(inputs[j])
                if all(holds[j] for j in premise):
                    _mark(outputs[i], band)
        return out


def _returns_a_mask(region: torch.nn.Module) -> bool:
    graph = getattr(getattr(region, "_model", None), "graph", None)
    if graph is None:
        return False
    (output,) = graph.find_nodes(op="output")
    values = [n.meta.get("example_value") for n in output.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.ndim >= 2 for v in values)


def _marking_masks(split: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``split`` (ThunderCompiler's) with each Thunder region that returns a boolean tensor marking it."""
    for name, region in list(split.named_children()):
        if name.startswith("thunder_") and _returns_a_mask(region):
            setattr(split, name, _MarkingRegion(region))
    return split


def _static_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and all(isinstance(s, int) for s in value.shape)


def mask_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The positions among ``gm``'s inputs of the boolean tensors, of static shapes, that an
    attention's ``attn_mask`` is computed from; none where any input has a symbolic shape."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    values = [p.meta.get("example_value") for p in placeholders]
    if not all(_static_tensor(v) or (v is not None and not isinstance(v, (torch.Tensor, torch.SymInt)))
               for v in values):
        return []
    reached: set[torch.fx.Node] = set()
    stack = [n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
             for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.fx.Node) and node not in reached:
            reached.add(node)
            stack.extend(node.all_input_nodes)
    return [i for i, (p, v) in enumerate(zip(placeholders, values))
            if p in reached and isinstance(v, torch.Tensor) and v.dtype == torch.bool and v.ndim >= 2]


def call_with_example_value(graph: torch.fx.Graph, target, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """A new ``call_function`` node with the example value dynamo would have recorded for it, which
    ThunderCompiler's splitter reads."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    values = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["example_value"])
    # The mode the example values were made in (dynamo's tracing context may hold another).
    fake_mode = next((v.fake_mode for v in tree_leaves(values) if isinstance(v, torch._subclasses.FakeTensor)), None)
    with fake_mode or contextlib.nullcontext():
        node.meta["example_value"] = target(*values[0], **values[1])
    return node


def _with_masks_made_causal(gm: torch.fx.GraphModule, bands: dict[int, int]) -> torch.fx.GraphModule:
    """A copy of ``gm`` in which the input at each position of ``bands`` is read as
    ``tril(ones_like(input))``, AND-ed with ``triu(ones_like(input), 1 - w)`` for a window of ``w``
    keys: its values where it is marked, made in the graph, where the causal_mask pass proves them."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = list(graph.find_nodes(op="placeholder"))
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i, band in bands.items():
        mask = placeholders[i]
        with graph.inserting_before(first_op):
            ones = call_with_example_value(graph, torch.ones_like, (mask,))
            causal = call_with_example_value(graph, torch.tril, (ones,))
            if band:
                window = call_with_example_value(graph, torch.triu, (ones, 1 - band))
                causal = call_with_example_value(graph, torch.bitwise_and, (causal, window))
        mask.replace_all_uses_with(causal, delete_user_cb=lambda user: user is not ones)
    variant = torch.fx.GraphModule(gm, graph)
    variant.meta.update(gm.meta)
    return variant


class _CausalInputs:
    """A dynamo graph's compiled callable: per call, the variant for the marks of its mask inputs
    (each's band, None where unmarked)."""

    def __init__(self, gm: torch.fx.GraphModule, compile_graph: Callable, positions: Sequence[int]) -> None:
        self._gm, self._compile_graph, self._positions = gm, compile_graph, tuple(positions)
        self._compile_id = CompileContext.current_compile_id()
        self._variants: dict[tuple[int | None, ...], Callable] = {}

    def compile(self, marked: tuple[int | None, ...], example_inputs: Sequence) -> Callable:
        gm = self._gm
        if any(m is not None for m in marked):
            try:
                gm = _with_masks_made_causal(self._gm, {i: m for i, m in zip(self._positions, marked) if m is not None})
            except Exception as e:  # the graph as dynamo gave it: every mask read as it is
                warnings.warn(f"thunder_memopt: causal_mask left the mask inputs as they were "
                              f"({type(e).__name__}: {e})")
                marked = (None,) * len(marked)
                gm = self._gm
        if marked not in self._variants:
            self._variants[marked] = self._compile_graph(gm, list(example_inputs))
        return self._variants[marked]

    def __call__(self, *args):
        marked = tuple(marked_band(args[i]) for i in self._positions)
        compiled = self._variants.get(marked)
        if compiled is None:
            # As part of dynamo's compile of this graph, as at its first call (Thunder leaves the
            # checks of the inputs' metadata to dynamo's guards then).
            with compile_context(CompileContext(self._compile_id)) if self._compile_id else contextlib.nullcontext():
                compiled = self.compile(marked, args)
            self._variants[marked] = compiled
        return compiled(*args)


def compile_with_causal_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence,
                               compiler: Callable[[torch.fx.GraphModule, list], torch.fx.GraphModule]) -> Callable:
    """``compiler(gm, example_inputs)`` (a ThunderCompiler), with the Thunder regions that return
    masks marking those proven causal, and, where masks reach ``gm``'s attentions as inputs, one
    variant per pattern of marked masks among them (module docstring)."""

    def compile_graph(graph: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        return _marking_masks(compiler(graph, inputs))

    positions = mask_inputs(gm)
    if not positions:
        return compile_graph(gm, list(example_inputs))
    callable_ = _CausalInputs(gm, compile_graph, positions)
    if not any(isinstance(example_inputs[i], torch._subclasses.FakeTensor) for i in positions):
        callable_.compile(tuple(marked_band(example_inputs[i]) for i in positions), example_inputs)
    return callable_
