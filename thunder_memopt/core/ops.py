"""The op taxonomy: which ops are elementwise, views, copies, reductions, expensive, random,
collectives or side-effecting, read by every pass and by both executors.

A bound symbol is classified by the names of its whole decomposition, normalized so that the
executor symbol (``torch_slice_prim_impl``), the ltorch symbol (``torch.nn.functional.gelu``) and the
prim (``PrimIDs.SLICE``) of one op get one name. Every op of litgpt's traces is named here, none
guessed from a substring (``unclassified_names``, tested on stablecode, Llama and Falcon). Thunder's
``prims.OpTags`` are read where they say more than a name: an op tagged ``RANDOM_OP`` is random,
``IN_PLACE`` or ``DONT_DCE`` has side effects, ``MATMUL_OP`` is expensive, whatever its name.

Classes:
- ``OpKind`` for the recompute pass: CHEAP ops are replayed at any budget, EXPENSIVE ones (matmuls,
  attention, softmax, embedding, cross-entropy) only below budget 1.0, NEVER ones are always saved.
- ``fusible_name``: what the fusion executor may compile into a region (thunder_memopt.executors).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

from thunder.core import prims
from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol, Symbol

__all__ = [
    "OpKind",
    "op_kind",
    "symbols",
    "op_names",
    "normalized",
    "leaf_names",
    "moves_data",
    "fusible_name",
    "unclassified_names",
    "is_random",
    "is_collective",
    "RANDOM_NAMES",
    "COLLECTIVE_NAMES",
    "SIDE_EFFECT_NAMES",
    "OFFLOAD_NAMES",
    "ELEMENTWISE",
    "VIEWS",
    "COPIES",
    "CREATION",
    "NORM_REDUCTIONS",
    "SOFTMAX_AND_LOSS",
    "MATMULS",
    "ATTENTION",
    "EMBEDDING",
    "FUSED_LOSS_HEAD",
    "FUSED_LOSS_HEAD_MATMULS",
    "WINDOW_ARGUMENT",
]

# Replaying would draw new numbers.
RANDOM_NAMES = frozenset({
    "uniform", "uniform_philox", "bernoulli", "randn", "rand", "rand_like", "randn_like", "randint",
    "normal", "multinomial", "dropout", "get_and_update_rng_state", "get_rng_state", "set_rng_state",
    "manual_seed",
})
# Collectives and their futures.
COLLECTIVE_NAMES = frozenset({
    "all_gather", "all_reduce", "reduce_scatter", "broadcast", "wait", "synchronize", "send", "recv",
    "pack", "unpack", "update_bucket_view", "pack_for_fsdp", "unpack_for_fsdp", "stash_grad_for_fsdp",
    "synchronize_tensor_parallel_input", "synchronize_tensor_parallel_output",
})
# thunder_memopt's copies of saved tensors to the host and back (executors/offload.py).
OFFLOAD_NAMES = frozenset({"memopt_offload", "memopt_offload_wait", "memopt_offload_release", "memopt_reload",
                           "memopt_wait_reload"})
# In-place ops and ops that act on the host or on streams.
SIDE_EFFECT_NAMES = frozenset({"copy_", "copy_with_setitem", "print", "item", "put_grad", "sink"}) | OFFLOAD_NAMES

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "neg", "abs", "exp", "exp2", "expm1",
    "log", "log1p", "log2", "sqrt", "rsqrt", "reciprocal", "tanh", "sigmoid", "erf", "erfc", "sin",
    "cos", "pow", "maximum", "minimum", "clamp", "where", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not",
    "convert_element_type", "to", "type_as", "sign", "signbit", "fmod", "remainder", "floor", "ceil",
    "round", "trunc", "silu", "gelu", "relu", "tril", "triu", "masked_fill", "softplus",
})
VIEWS = frozenset({  # move no data
    "broadcast_in_dim", "reshape", "transpose", "slice", "slice_prim", "squeeze", "shallow_copy",
    "expand", "unsqueeze", "permute", "split", "chunk", "view", "view_as", "flatten", "movedim",
    "__getitem__", "getitem", "unbind",
})
COPIES = frozenset({"cat", "stack", "pad", "flip", "contiguous", "stride_order", "clone"})
CREATION = frozenset({"iota", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "arange"})
NORM_REDUCTIONS = frozenset({"var_mean", "sum", "amax", "amin", "mean", "var"})
SOFTMAX_AND_LOSS = frozenset({
    "softmax", "_softmax", "log_softmax", "_log_softmax", "log_softmax_backward", "logsumexp",
    "nll_loss", "nll_loss_backward", "cross_entropy", "take_along_dim", "take_along_axis", "gather",
})
MATMULS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "convolution", "conv1d", "conv2d",
    "conv3d", "_grouped_mm", "grouped_mm",
})
ATTENTION = frozenset({
    "scaled_dot_product_attention",
    # Thunder's sdpa executor (thunder/executors/sdpaex.py) and thunder_memopt's cuDNN executor.
    "sdpaex_grad_forward_scaled_dot_product_efficient_attention",
    "sdpafx_grad_forward_scaled_dot_product_efficient_attention",
    "sdpaex_scaled_dot_product_efficient_attention_backward",
    "sdpafx_scaled_dot_product_efficient_attention_backward",
    "memopt_cudnn_sdpa_attention_forward", "memopt_cudnn_sdpa_attention_backward",
    "memopt_window_attention", "memopt_window_attention_forward", "memopt_window_attention_backward",
})
# thunder_memopt's sliding-window attention (executors/window_attention.py): the position of its
# window, the keys each query reads, among its arguments.
WINDOW_ARGUMENT = {"memopt_window_attention": 3, "memopt_window_attention_forward": 3,
                   "memopt_window_attention_backward": 6}
EMBEDDING = frozenset({"embedding", "embedding_backward", "take"})
# thunder_memopt's fused linear + cross-entropy (executors/chunked_cross_entropy.py): matmuls over
# the vocabulary, never fused into a region. Each op's count of (tokens x hidden) @ (hidden x vocab)
# products: the logits; in the backward, or the forward that computes the gradients, the logits
# again and the products for the hidden state's and the weight's gradients.
FUSED_LOSS_HEAD_MATMULS = {
    "memopt_linear_cross_entropy": 1, "memopt_linear_cross_entropy_forward": 1,
    "memopt_linear_cross_entropy_and_logits": 1, "memopt_linear_cross_entropy_forward_and_logits": 1,
    "memopt_linear_cross_entropy_backward": 3, "memopt_linear_cross_entropy_forward_with_gradients": 3,
    "memopt_linear_cross_entropy_scale_gradients": 0,
    "memopt_linear_cross_entropy_forward_and_logits_with_gradients": 3,
    # Where the model's logits get a gradient of their own, two more (and the logits again).
    "memopt_linear_cross_entropy_scale_gradients_and_logits_grad": 0,
}
FUSED_LOSS_HEAD = frozenset(FUSED_LOSS_HEAD_MATMULS)
# The fused head's ops that read the model's own gradient of its logits, and that argument's index:
# where that gradient reaches one alone, an unused one is never made (core.trace.unmade_cotangents).
HEAD_LOGITS_GRAD = {"memopt_linear_cross_entropy_scale_gradients_and_logits_grad": 1,
                    "memopt_linear_cross_entropy_backward": 10}

# Its forwards are never replayed: what they save is the log-sum-exp (4 bytes a token), or the
# gradients that the backward's variant computes with fewer matmuls (head_gradients="backward"), and
# a replay redoes the vocabulary matmul, the largest of the step, and with the logits as the model's
# result makes them whole again in the backward (2 GiB at Llama-3, T=8192).
FUSED_LOSS_HEAD_FORWARDS = FUSED_LOSS_HEAD - {"memopt_linear_cross_entropy_backward",
                                              "memopt_linear_cross_entropy_scale_gradients",
                                              "memopt_linear_cross_entropy_scale_gradients_and_logits_grad"}

_CHEAP = ELEMENTWISE | VIEWS | COPIES | CREATION | NORM_REDUCTIONS
_EXPENSIVE = MATMULS | ATTENTION | EMBEDDING | SOFTMAX_AND_LOSS | FUSED_LOSS_HEAD
_KNOWN = _CHEAP | _EXPENSIVE | RANDOM_NAMES | COLLECTIVE_NAMES | SIDE_EFFECT_NAMES
# Ops the fusion executor compiles. Softmax and the loss pieces fuse (inductor's online softmax);
# matmuls, attention and embeddings keep their library kernels.
_FUSIBLE = ELEMENTWISE | VIEWS | COPIES | CREATION | NORM_REDUCTIONS | SOFTMAX_AND_LOSS


class OpKind(enum.Enum):
    CHEAP = "cheap"  # replayed at any budget
    EXPENSIVE = "expensive"  # replayed only below budget 1.0
    NEVER = "never"  # always saved


def symbols(bsym: BoundSymbol) -> Iterator[Symbol]:
    """The symbol of a bound symbol and those of its whole decomposition, outermost first."""
    yield bsym.sym
    for sub in bsym.subsymbols:
        yield from symbols(sub)


def op_names(bsym: BoundSymbol) -> tuple[str, ...]:
    """The names of a bound symbol and of its decomposition, outermost first."""
    return tuple(sym.name for sym in symbols(bsym))


def normalized(name: str) -> str:
    """One name per op: ``torch_slice_prim_impl`` -> ``slice``, ``torch_prims_reshape_impl`` ->
    ``reshape``, ``torch.nn.functional.gelu`` -> ``gelu``, ``PrimIDs.VAR_MEAN`` -> ``var_mean``."""
    name = name.rsplit(".", 1)[-1].lower()
    for prefix in ("torch_prims_", "torch_", "prims_", "ltorch_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for suffix in ("_prim_impl", "_impl"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name


def leaf_symbols(bsym: BoundSymbol) -> list[BoundSymbol]:
    """The innermost bound symbols a bound symbol decomposes into (itself if it does not)."""
    if not bsym.subsymbols:
        return [bsym]
    return [leaf for sub in bsym.subsymbols for leaf in leaf_symbols(sub)]


def leaf_names(bsym: BoundSymbol) -> list[str]:
    """The normalized names of the innermost symbols a bound symbol decomposes into."""
    return [normalized(leaf.sym.name) for leaf in leaf_symbols(bsym)]


def _tags(bsym: BoundSymbol) -> set:
    return {t for sym in symbols(bsym) for t in (getattr(sym, "tags", None) or ())}


def _names(bsym: BoundSymbol) -> set[str]:
    raw = op_names(bsym)
    return {normalized(n) for n in raw} | set(raw)


def is_random(bsym: BoundSymbol) -> bool:
    names = _names(bsym)
    return prims.OpTags.RANDOM_OP in _tags(bsym) or bool(names & RANDOM_NAMES)


def is_collective(bsym: BoundSymbol) -> bool:
    return bool(_names(bsym) & COLLECTIVE_NAMES)


def op_kind(bsym: BoundSymbol) -> OpKind:
    """Whether a bound symbol may be replayed in the backward, and at which budgets."""
    names, tags = _names(bsym), _tags(bsym)
    if is_random(bsym) or is_collective(bsym) or names & SIDE_EFFECT_NAMES or prims.OpTags.IN_PLACE in tags:
        return OpKind.NEVER
    if bsym.sym.name in FUSED_LOSS_HEAD_FORWARDS:
        return OpKind.NEVER
    if any(p for p in bsym.flat_proxy_args if not isinstance(p, TensorProxy)):
        # A number computed in the forward would not exist in the backward.
        return OpKind.NEVER
    if names & _EXPENSIVE or prims.OpTags.MATMUL_OP in tags:
        return OpKind.EXPENSIVE
    if all(n in _CHEAP for n in leaf_names(bsym)):
        return OpKind.CHEAP
    return OpKind.NEVER


def unclassified_names(bsym: BoundSymbol) -> list[str]:
    """The names in a bound symbol that the taxonomy does not know: none if its own name (or a tag
    that classifies it) is known, else its own name if it has no decomposition, else those of its
    decomposition, level by level. What it lists is never replayed (``op_kind`` says NEVER) and
    never fused, but the tests require it to be empty on litgpt's traces, so that a new op is named
    here rather than guessed."""
    name = bsym.sym.name
    tags = set(getattr(bsym.sym, "tags", None) or ())
    if normalized(name) in _KNOWN or name in _KNOWN or tags & {prims.OpTags.MATMUL_OP, prims.OpTags.RANDOM_OP}:
        return []
    if not bsym.subsymbols:
        return [name]
    return [n for sub in bsym.subsymbols for n in unclassified_names(sub)]


def moves_data(bsym: BoundSymbol) -> bool:
    """Whether any step of the bound symbol reads and writes memory (not only views)."""
    return any(n not in VIEWS for n in leaf_names(bsym))


def fusible_name(name: str) -> bool:
    """Whether an op of this (symbol or id) name may run in a fusion region."""
    n = normalized(name)
    return n in _FUSIBLE and n not in RANDOM_NAMES and n not in SIDE_EFFECT_NAMES
