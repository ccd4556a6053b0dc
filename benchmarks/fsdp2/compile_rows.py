"""What a row records of how its step compiled, as flat JSON fields.

    offload_fields      the offload plans of thunder+memopt's compiled pairs
    thunderfx_summary   ThunderFX's graphs, the Thunder regions in them, why they split, and the
                        attentions and thunder_memopt symbols of the regions' traces
    attention_kinds     each attention of one region's traces (is_causal, window, mask, neither)
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from thunder_memopt.passes.offload import OffloadPlan

SPLIT_REASON_CHARS = 200  # of each reason ThunderFX gives for a split: the op and why


def offload_fields(plans: list[OffloadPlan]) -> dict[str, Any]:
    """A row's fields for the offload plans of its compiled pairs: bytes summed over the plans, the
    rates they were made for, and each plan's model of its copies, to hold against a --profile row's."""
    return {
        "offloaded_bytes": sum(plan.offloaded_bytes for plan in plans),
        "offload_kept_bytes": sum(plan.kept_bytes for plan in plans),
        "offload_exposed_ms": 1e3 * sum(plan.exposed_seconds for plan in plans),
        "offload_to_host_gbps": plans[0].rates.to_host / 1e9,
        "offload_to_device_gbps": plans[0].rates.to_device / 1e9,
        "offload_plans": [{"offloaded_bytes": plan.offloaded_bytes, "forward_ms": 1e3 * plan.forward_seconds,
                           "to_host_end_ms": 1e3 * plan.to_host_end_seconds, "exposed_ms": 1e3 * plan.exposed_seconds,
                           "spilled": len(plan.spilled)}
                          for plan in plans],
    }


def attention_kinds(traces: list) -> list[str]:
    """Each attention of a Thunder region's forward traces as thunder_memopt's passes left it:
    ``is_causal``, ``mask`` or ``neither``, or ``window`` (a mask proven a sliding window, run on
    flash's window kernel), from the last trace that still calls torch's SDPA or the window op
    (after the passes, before the executors claim them)."""
    import thunder.torch as ltorch

    from thunder_memopt.executors.window_attention import window_attention

    sdpa = inspect.signature(ltorch.scaled_dot_product_attention.meta)
    with_attention = [[b for b in t.bound_symbols
                       if b.sym.id in (ltorch.scaled_dot_product_attention.id, window_attention.id)] for t in traces]
    kinds = []
    for b in next((calls for calls in reversed(with_attention) if calls), []):
        if b.sym.id == window_attention.id:
            kinds.append("window")
            continue
        bound = sdpa.bind(*b.args, **b.kwargs)
        bound.apply_defaults()
        masked, causal = bound.arguments["attn_mask"] is not None, bound.arguments["is_causal"]
        kinds.append("mask" if masked else "is_causal" if causal else "neither")
    return kinds


def thunderfx_summary(compiler) -> dict[str, Any]:
    """How ThunderFX compiled the step: dynamo's graphs, the Thunder regions in them and why the
    graphs were split; over the regions (one serves every decoder layer or Block under fsdp2), the
    attentions as thunder_memopt's passes left them (``attention_kinds``): with ``is_causal`` (a mask
    proven causal where it is made, in the region or in the graph that made the region's mask
    input, thunder_memopt.causal_inputs), on the window kernel (a mask proven a sliding window),
    with a mask, or neither; a graph whose mask inputs come
    marked and unmarked has a region for each; and the thunder_memopt symbols and attention kernels
    of the last forward traces: ``memopt_cudnn_sdpa_*`` where cuDNN took attention (never on CPU),
    ``memopt_linear_cross_entropy_*`` where the loss head fused."""
    import thunder

    attentions = {"is_causal": 0, "window": 0, "mask": 0, "neither": 0}
    symbols: set[str] = set()
    regions = [fn for info in compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    for fn in regions:
        traces = thunder.last_traces(fn)
        for kind in attention_kinds(traces):
            attentions[kind] += 1
        symbols.update(b.sym.name for b in traces[-1].bound_symbols
                       if b.sym.name.startswith("memopt_") or "sdpa" in b.sym.name or "attention" in b.sym.name)
    reasons = {re.sub(r" at 0x[0-9a-f]+", "", reason.info.splitlines()[0])[:SPLIT_REASON_CHARS]  # no addresses
               for info in compiler.subgraph_infos for reason in info.split_reasons}
    return {"graphs": len(compiler.subgraph_infos), "regions": len(regions), "split_reasons": sorted(reasons),
            "attentions": attentions, "symbols": sorted(symbols)}
