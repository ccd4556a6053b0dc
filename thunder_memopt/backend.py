"""A ``torch.compile`` backend: Thunder's ThunderCompiler with MemoryOptimization enabled and
thunder_memopt's executors (``thunder_memopt.executors()``) in front of Thunder's.

- ``thunderfx_backend``: builds it. ThunderCompiler appends its own transform to the list it is
  given, so the caller's list is copied, never mutated.
- Its options are checked when it is built, not at the first call inside dynamo: ``transforms`` and
  ``executors`` by type, any other keyword by name against what Thunder 0.2.6 reads
  (``THUNDER_OPTIONS``): ``thunder.jit`` takes any name and ignores those it does not know.
- Each dynamo graph goes through ``graph_rewrites.rewrite_for_thunder`` first; where the causal
  mask pass runs, masks made in one graph and read in another keep their proof (``causal_inputs``).
- ``loss_type_warning_skipped_when_compiling``: a transformers model's default loss, traced without its
  warning (a graph break).
- The splitter's per-node checks that pass are kept across its compiles (``node_checks``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import Any

import thunder
import torch
from thunder.core.transform_common import Transform
from thunder.extend import Executor, get_executor

from thunder_memopt.causal_inputs import compile_with_causal_inputs
from thunder_memopt.executors import cudnn_attention_ex, executors
from thunder_memopt.graph_rewrites import rewrite_for_thunder
from thunder_memopt.transform import MemoryOptimization

__all__ = ["THUNDER_OPTIONS", "loss_type_warning_skipped_when_compiling", "thunderfx_backend"]

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


def loss_type_warning_skipped_when_compiling() -> None:
    """Where transformers is imported: under dynamo, ``PreTrainedModel.loss_function`` gives a model
    whose ``loss_type`` transformers does not know the default loss (``ForCausalLMLoss``), as in eager,
    without the warning it logs there. Dynamo breaks the graph at a logger's call: GPT-2's loss
    (GPT2LMHeadModel names no loss type) ran in a graph of its own, apart from the head's linear, and
    the loss head was not fused. Outside dynamo the property is transformers' own. (Dynamo's
    ``ignore_logging_functions`` would skip the call too, but torch 2.11 then fails to write its
    compile metrics, with an error logged at each compile: it sorts the set and writes it as JSON.)"""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return
    model_class = modeling_utils.PreTrainedModel
    transformers_own = model_class.__dict__.get("loss_function")
    if not isinstance(transformers_own, property) or getattr(transformers_own.fget, "warning_skipped", False):
        return

    def loss_function(self):
        if (torch.compiler.is_compiling() and not hasattr(self, "_loss_function")
                and getattr(self, "loss_type", None) not in modeling_utils.LOSS_MAPPING):
            return modeling_utils.LOSS_MAPPING["ForCausalLM"]
        return transformers_own.fget(self)

    loss_function.warning_skipped = True
    model_class.loss_function = property(loss_function, transformers_own.fset, doc=transformers_own.__doc__)


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
    # thunder.dynamo (with torch.utils.benchmark and setuptools: 0.2 s) is imported where a backend is made,
    # not with the package, which thunder.jit's users import too.
    from thunder.dynamo import ThunderCompiler

    from thunder_memopt.node_checks import checks_kept

    loss_type_warning_skipped_when_compiling()  # before dynamo traces the model
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
        with checks_kept():
            if causal_inputs:
                return compile_with_causal_inputs(gm, example_inputs, compiler)
            return compiler(gm, example_inputs)

    backend.compiler = compiler  # subgraph_infos and traces stay reachable
    return backend
