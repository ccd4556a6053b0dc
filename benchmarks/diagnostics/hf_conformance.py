"""The conformance matrix: every causal LM that transformers maps (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
narrowed, trained two AdamW steps under ``thunderfx_backend()`` against eager, on CPU.

- ``narrowed_config``: the architecture's default config (no hub access) at width 64, 2 layers, 4
  heads over 2 KV heads of size 16, vocabulary 256, experts and low ranks shrunk alike, one layer of
  each distinct kind of a ``layer_types`` pattern, dropout off, fp32, SDPA where the model has it.
- ``excluded``: classes that are not decoder-only language models on ``input_ids`` (the decoder of
  an encoder-decoder model, an encoder run as a decoder, a multimodal model), with the reason.
- ``conform``: eager and ``torch.compile(model, backend=thunderfx_backend())`` from the same weights,
  the losses and gradients of both steps compared (``LOSS_RTOL``, ``GRAD_RTOL``), and what took
  effect: the fused loss head, the attention path, the Thunder regions and their split reasons.
- The matrix runs each architecture in a subprocess with a timeout and writes docs/conformance.md:

    python benchmarks/diagnostics/hf_conformance.py --jobs 2 --output docs/conformance.md
    python benchmarks/diagnostics/hf_conformance.py --only llama gpt2   # a few, table to stdout
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# Relative to the eager value's magnitude: the loss, and each parameter's gradient (max abs error over
# the larger of its max abs eager gradient and GRAD_FLOOR of the model's largest: a gradient that is zero
# but for rounding, as a key projection's bias under softmax, is noise). fp32 sums of a few hundred terms
# in another order (the fused head's chunks, Thunder's decomposed attention) differ by about 1e-6 of
# that; a wrong op by far more.
# The second step's gradients, 1e-3: the first AdamW step moves a weight by about the learning rate
# whatever its gradient's size, so rounding noise in a gradient near zero moves it by up to 2 x lr.
LOSS_RTOL = 1e-5
GRAD_RTOL = (1e-4, 1e-3)  # by step
GRAD_FLOOR = 1e-3
STEPS, BATCH, SEQ_LEN, VOCAB = 2, 2, 32, 256
SLIDING_WINDOW = 16  # shorter than SEQ_LEN: a sliding window masks something
TIMEOUT_S = 900

# Config fields set where the default config has them (names vary between architectures).
_WIDTH, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN = 64, 4, 2, 16, 128
NARROW: dict[str, object] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "dim"), _WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), _HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), _KV_HEADS),
    **dict.fromkeys(("head_dim", "attention_head_dim", "v_head_dim", "global_head_dim"), _HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "d_ff"), _FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 64),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "rotary_dim": 8,
    **dict.fromkeys(("index_head_dim",), _HEAD_DIM), **dict.fromkeys(("index_n_heads",), _HEADS),
    **dict.fromkeys(("mamba_d_state", "mamba_chunk_size", "ssm_state_size", "state_size"), 16),
    "vocab_size": VOCAB,
}


@dataclasses.dataclass(frozen=True)
class Result:
    """One row of the matrix."""

    name: str  # the model type
    model_class: str
    status: str  # match, mismatch, crash, timeout, cannot run, excluded
    reason: str = ""
    attn_implementation: str = ""
    losses_eager: tuple[float, ...] = ()
    losses_thunder: tuple[float, ...] = ()
    loss_error: float = 0.0  # max over steps, relative
    grad_error: float = 0.0  # max over steps and parameters, relative
    grad_errors: tuple[float, ...] = ()  # each step's, max over parameters
    worst_parameter: str = ""
    head: str = ""  # fused, fused (logits kept), not fused
    attention: str = ""
    graphs: int = 0  # dynamo graphs
    regions: int = 0  # Thunder regions
    split_reasons: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()  # thunder_memopt's one-line fallback warnings
    seconds: float = 0.0


def _model_class(name: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])


def architectures() -> list[str]:
    """The model types transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def excluded(name: str) -> str | None:
    """Why ``name``'s causal-LM class is not a decoder-only language model on plain ``input_ids``; None if it is."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if name in _NOT_TEXT_LM:
        return _NOT_TEXT_LM[name]
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name]
    config = CONFIG_MAPPING[name]()
    text = f"; its text model is the row {name}_text" if f"{name}_text" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
    if config.is_encoder_decoder:
        return "the decoder of an encoder-decoder model"
    if name in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder (masked-LM) architecture, its causal-LM class the encoder run with is_decoder=True"
    if class_name.endswith("ForConditionalGeneration"):
        return "multimodal (text with images, audio or video): the mapped class is the whole model" + text
    sub = getattr(config, "sub_configs", {}) or {}
    if any(key in sub for key in ("vision_config", "audio_config", "vq_config")):
        return f"multimodal config ({', '.join(k for k in sub if k != 'text_config')})" + text
    return None


# Not derivable from the config: no language model of plain input_ids.
_NOT_TEXT_LM = {
    **dict.fromkeys(("musicgen", "musicgen_melody"),
                    "audio: a decoder of codebook tokens, input_ids (batch x codebooks, T), under a text encoder"),
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"),
                    "a speculative-decoding assistant: its forward reads the target model's hidden states"),
}


# Fields whose consistency the generic narrowing does not keep.
_SPECIAL: dict[str, dict] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=SLIDING_WINDOW),
    "mamba2": dict(num_heads=2 * _WIDTH // _HEAD_DIM),  # expand (2) x hidden = heads x head size
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": {
        "rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}}),  # head size 16: 8 frequencies
    "dbrx": dict(attn_config=dict(kv_n_heads=_KV_HEADS, rope_theta=1e4, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=_FFN, moe_num_experts=4, moe_top_k=2)),
    **dict.fromkeys(("gemma3n_text", "gemma4_text", "gemma4_unified_text"), dict(
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, num_kv_shared_layers=0, laurel_rank=8,
        per_layer_config={})),
    "blt": dict(encoder_hash_byte_group_vocab=512, **{f"{part}_config": dict(
        hidden_size=_WIDTH, hidden_size_global=_WIDTH, num_hidden_layers=1, num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS, head_dim=_HEAD_DIM, intermediate_size=_FFN)
        for part in ("patcher", "encoder", "decoder", "global")}),
}


# Causes found for what a row shows, where the row cannot say it (checked on 2026-12-06 with the same
# narrowed model, 1 layer, 16 tokens).
KNOWN = {
    "doge": "transformers', not Thunder's: in eager, masking_utils skips the causal mask where SDPA can take "
            "is_causal, and Doge's attention then hands SDPA its dynamic mask alone, with no causality; traced, "
            "the mask is made. torch.compile(backend='eager') differs from eager alike (loss 5.5704 against "
            "5.5610), and thunderfx_backend() matches it (the same loss, gradients within 3.1e-5; 2026-12-07)",
    # MoE models whose routers normalize their top-k weights in place, which matched after
    # in_place_rewrites.in_place_as_out_of_place (2026-12-07; plain ThunderCompiler() gives the router another
    # gradient). The head: on CPU transformers' grouped_mm fallback reads its offsets with tolist() in its
    # backward, which fails under tracing; dynamo breaks the graph there, and the logits and the loss are
    # made in two graphs.
    **dict.fromkeys(("mixtral", "mellum", "solar_open", "exaone_moe", "glm4_moe", "hunyuan_v1_moe", "minimax",
                     "mimo_v2_flash", "minimax_m2", "minimax_m3_vl_text", "deepseek_v3", "glm4_moe_lite",
                     "glm_moe_dsa", "axk1"),
                    "head not fused: on CPU the graph breaks at transformers' grouped_mm fallback (read on mixtral)"),
    "nemotron_h": "step 2 differs at the first Mamba mixer's in_proj under torch.compile's own backends too: "
                  "aot_eager 5.1e-4, inductor 8.0e-4 at the same weight, where eager with its step-1 gradients "
                  "perturbed by 1e-6 differs at step 2 by 4.8e-7 (2026-12-07); step 1 matches",
    "phimoe": "random in training: its router samples experts (Gumbel noise, rand_like), and eager itself, "
              "seeded otherwise, differs at step 2 by 1.7 at the router's weight (2026-12-07); step 1 matches",
    "deepseek_v4": "a gradient on one side only: eager leaves 4 parameters that the narrowed model does not "
                   "read at 32 tokens (its compressors') without a gradient, where the compiled step gives them "
                   "zeros (AdamW then decays them); the losses agree at both steps (8.6e-8)",
}


def _layer_pattern(types: Sequence, layers: int) -> list:
    """One layer of each distinct kind (in their first order), at least ``layers`` layers from the pattern."""
    kinds = list(dict.fromkeys(types))
    return (kinds + list(types))[: max(layers, len(kinds))] if len(kinds) < layers else kinds


def narrowed_config(name: str, *, layers: int = 2, **overrides):
    """``name``'s default config narrowed (``NARROW``), dropout off, SDPA where the model has it,
    ``use_cache=False``; ``overrides`` last."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[name]
    fields = config_class().to_dict()
    given = {k: v for k, v in NARROW.items() if k in fields}
    given.update({k: layers for k in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") if k in given})
    if "qk_rope_head_dim" in fields:  # multi-head latent attention: rotary on part of each head, K and V per head
        given.update({k: v for k, v in (("head_dim", 8), ("qk_head_dim", 16), ("num_key_value_heads", _HEADS))
                      if k in fields})
    for key, value in fields.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            given[key] = 0.0
        elif key.endswith("_token_id") and value is not None:
            ids = value if isinstance(value, list) else [value]
            if any(i >= VOCAB for i in ids):  # an embedding's padding_idx must be in the vocabulary
                given[key] = {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2)
    if isinstance(fields.get("sliding_window"), int):
        given["sliding_window"] = SLIDING_WINDOW
    if "attn_layer_indices" in fields:  # hybrids: a state-space layer, then an attention layer
        given["attn_layer_indices"] = [1]
    if isinstance(fields.get("layer_types"), list) and fields["layer_types"]:
        given["layer_types"] = _layer_pattern(fields["layer_types"], layers)
        for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
            if key in given:
                given[key] = len(given["layer_types"])
    given.update(_SPECIAL.get(name, {}))
    given.update(use_cache=False, **overrides)
    return config_class(**given)


def build(name: str, *, seed: int = 0, **overrides) -> tuple[torch.nn.Module, str]:
    """The causal-LM class of ``name`` on its narrowed config with random weights, fp32, and the
    attention implementation it runs (``sdpa`` where the class has it)."""
    model_class = _model_class(name)
    implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    config = narrowed_config(name, **overrides)
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.train()
    return model, implementation


def _train(model: torch.nn.Module, x: torch.Tensor, steps: int, backend=None
           ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Each step's loss and gradients, of ``model`` or, with ``backend``, of ``torch.compile(model, backend=backend)``."""
    call = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses, grads = [], []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = call(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return losses, grads


def _grad_errors(eager: list[dict], thunder: list[dict]) -> tuple[list[float], str]:
    """Each step's largest relative gradient error over the parameters, and where the worst (by its
    step's tolerance) is."""
    errors, worst, where = [], 0.0, ""
    for step, (e, t) in enumerate(zip(eager, thunder)):
        floor = GRAD_FLOOR * max((g.abs().max().item() for g in e.values()), default=0.0)
        step_error = 0.0
        for n in sorted(set(e) | set(t)):
            if n not in e or n not in t:
                return [float("inf")], f"{n} (step {step + 1}: a gradient on one side only)"
            scale = max(e[n].abs().max().item(), floor)
            err = (t[n] - e[n]).abs().max().item() / scale if scale else (t[n] - e[n]).abs().max().item()
            step_error = err if not err <= step_error else step_error  # NaN counts as worst
            if not err / GRAD_RTOL[step] <= worst:
                worst, where = err / GRAD_RTOL[step], f"{n} (step {step + 1})"
        errors.append(step_error)
    return errors, where


def _sdpa_calls(trace) -> list[tuple[bool, bool]]:
    """(is_causal, has a mask) of each SDPA call in ``trace``."""
    import thunder.torch as ltorch

    signature = inspect.signature(ltorch.scaled_dot_product_attention.meta)
    calls = []
    for b in trace.bound_symbols:
        if b.sym.name == "scaled_dot_product_attention":
            bound = signature.bind(*b.args, **b.kwargs)
            bound.apply_defaults()
            calls.append((bound.arguments["is_causal"] is True, bound.arguments["attn_mask"] is not None))
    return calls


def effects(backend) -> dict:
    """What took effect in a ``thunderfx_backend``'s Thunder regions: the head, the attention path,
    the region count and the split reasons."""
    import thunder

    compiler = getattr(backend, "compiler", backend)  # thunderfx_backend or ThunderCompiler
    fns = [fn for info in compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    names, calls, executed_sdpa = set(), [], False
    for fn in fns:
        traces = thunder.last_traces(fn)
        before_autodiff = [t for t in traces if _sdpa_calls(t) or "cross_entropy" in {b.sym.name for b in t.bound_symbols}]
        if before_autodiff:
            calls += _sdpa_calls(before_autodiff[-1])
        for t in traces[-1:] + thunder.last_backward_traces(fn)[-1:]:
            names.update(b.sym.name for b in t.bound_symbols)
            executed_sdpa |= any("sdpa" in b.sym.name or "attention" in b.sym.name for b in t.bound_symbols)
    fused = sorted(n for n in names if n.startswith("memopt_linear_cross_entropy"))
    head = ("fused (logits kept)" if any("and_logits" in n for n in fused) else "fused") if fused else "not fused"
    if calls:
        causal = sum(c for c, _ in calls)
        masked = sum(m for _, m in calls)
        parts = [f"is_causal {causal}/{len(calls)}"] if causal else []
        parts += [f"mask {masked}/{len(calls)}"] if masked else []
        parts += [f"neither {len(calls) - causal - masked}/{len(calls)}"] if len(calls) > causal + masked else []
        attention = ", ".join(parts) + ("" if executed_sdpa else ", decomposed")
    else:
        attention = "no SDPA (matmuls)"
    reasons = []
    for info in compiler.subgraph_infos:
        for r in info.split_reasons or ():
            target = re.search(r"target: (.*?)( only has| has been| is not|$)", r.info)
            reasons.append(f"{r.reason_type.name.lower()}: {target.group(1) if target else r.info}")
    return dict(head=head, attention=attention, graphs=len(compiler.subgraph_infos), regions=len(fns),
                split_reasons=tuple(dict.fromkeys(reasons)))


def conform(name: str, *, steps: int = STEPS, seq_len: int = SLIDING_WINDOW * 2, batch: int = BATCH,
            backend_factory=None, **overrides) -> Result:
    """``name`` trained ``steps`` AdamW steps in eager and under ``thunderfx_backend()`` (or
    ``backend_factory()``) from the same weights and tokens; the comparison and what took effect."""
    from thunder_memopt import thunderfx_backend

    start = time.perf_counter()
    class_name = _model_class(name).__name__
    reason = excluded(name)
    if reason is not None:
        return Result(name, class_name, "excluded", reason)
    try:
        eager_model, implementation = build(name, **overrides)
        thunder_model = copy.deepcopy(eager_model)
        x = torch.randint(3, eager_model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(1))
        eager_losses, eager_grads = _train(eager_model, x, steps)
    except Exception as e:
        return Result(name, class_name, "cannot run", f"eager: {_one_line(e)}", seconds=time.perf_counter() - start)
    torch._dynamo.reset()
    backend = (backend_factory or thunderfx_backend)()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            thunder_losses, thunder_grads = _train(thunder_model, x, steps, backend)
        except Exception as e:
            return Result(name, class_name, "crash", _one_line(e), implementation, tuple(eager_losses),
                          seconds=time.perf_counter() - start)
    loss_error = max(abs(t - e) / abs(e) if e else abs(t) for e, t in zip(eager_losses, thunder_losses))
    grad_errors, worst = _grad_errors(eager_grads, thunder_grads)
    matches = loss_error <= LOSS_RTOL and all(e <= tol for e, tol in zip(grad_errors, GRAD_RTOL))
    fallbacks = tuple(dict.fromkeys(str(w.message)[:160] for w in caught if str(w.message).startswith("thunder_memopt")))
    return Result(name, class_name, "match" if matches else "mismatch", "", implementation, tuple(eager_losses),
                  tuple(thunder_losses), loss_error, max(grad_errors), tuple(grad_errors), worst, fallbacks=fallbacks,
                  seconds=time.perf_counter() - start, **effects(backend))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


_MARK = "HF_CONFORMANCE_RESULT "


def run_isolated(name: str, timeout: float, threads: int) -> Result:
    """``conform(name)`` in a subprocess: a crash, a hang or a killed interpreter is a row, not the end."""
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # A session of its own, so that a timeout ends its compile workers with it.
    process = subprocess.Popen([sys.executable, __file__, "--worker", name], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return Result(name, _model_class(name).__name__, "timeout", f"over {timeout:.0f} s", seconds=timeout)
    for line in stdout.splitlines():
        if line.startswith(_MARK):
            return _result(json.loads(line[len(_MARK):]))
    errors = [line for line in stderr.splitlines() if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    reason = errors[-1][:200] if errors else f"exit code {process.returncode}, no result"
    return Result(name, _model_class(name).__name__, "crash", reason, seconds=time.perf_counter() - start)


def _result(fields: dict) -> Result:
    return Result(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _fmt(x: float) -> str:
    return "-" if x == 0 else f"{x:.1e}"


def table(results: Sequence[Result]) -> str:
    head = ("| architecture | class | result | loss err | grad err | head | attention | graphs / regions "
            "| split reasons | notes |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        notes = "; ".join(x for x in (r.reason, KNOWN.get(r.name, ""), f"worst: {r.worst_parameter}" if r.status == "mismatch" else "",
                                      *r.fallbacks, "" if r.attn_implementation in ("sdpa", "") else
                                      f"attention: {r.attn_implementation}") if x)
        ran = r.status in ("match", "mismatch")
        cells = (r.name, r.model_class, r.status, _fmt(r.loss_error) if ran else "", (" / ".join(map(_fmt, r.grad_errors)) or _fmt(r.grad_error)) if ran else "",
                 r.head, r.attention, f"{r.graphs} / {r.regions}" if ran else "", ", ".join(r.split_reasons),
                 notes.replace("|", "\\|"))
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows)


def summary(results: Sequence[Result]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def document(results: Sequence[Result], command: str) -> str:
    import thunder
    import transformers

    return f"""# Conformance: transformers' causal LMs under thunderfx_backend()

Generated by `{command}` on {datetime.date.today().isoformat()} at commit `{_commit()}` (torch {torch.__version__},
lightning-thunder {thunder.__version__}, transformers {transformers.__version__}, CPU, fp32).

Each architecture of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from its default config narrowed
(width {_WIDTH}, 2 layers, or one of each kind of a `layer_types` pattern, {_HEADS} heads over {_KV_HEADS} KV heads of size
{_HEAD_DIM}, vocabulary {VOCAB}, sliding windows {SLIDING_WINDOW}, dropout off), with SDPA where the class has it and
`use_cache=False`. It trains {STEPS} AdamW steps of `model(input_ids=x, labels=x).loss` on an unpadded batch of
{BATCH} x {SLIDING_WINDOW * 2} tokens, in eager and under `torch.compile(model, backend=thunderfx_backend())` (the
default `MemoryOptimization()` and `executors()`, so the causal-mask and loss-head passes run), from the same
weights. **match**: every step's loss within {LOSS_RTOL:g} of eager's (relative) and every parameter's gradient
within {GRAD_RTOL[0]:g} (step 1) and {GRAD_RTOL[1]:g} (step 2, after an AdamW step) of its largest eager entry (or of {GRAD_FLOOR:g} of the model's largest, where that is more: a
gradient that is zero but for rounding, as a key projection's bias under softmax, is noise). **head**: a `memopt_linear_cross_entropy*` symbol in the
traces. **attention**: the SDPA calls Thunder traced, after the causal-mask pass (`decomposed`: on CPU Thunder
runs them as matmuls and softmax). **graphs / regions**: dynamo graphs and the Thunder regions in them;
**split reasons**: what ThunderCompiler's splitter left to inductor. Each architecture runs in a subprocess
with a timeout.

Summary: {summary(results)}.

{table(results)}
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these model types only")
    parser.add_argument("--jobs", type=int, default=1, help="architectures at once, each in a subprocess")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds for one architecture")
    parser.add_argument("--output", type=Path, help="write the markdown document here (default: table to stdout)")
    parser.add_argument("--jsonl", type=Path, help="keep the results here, one JSON line each: an architecture "
                        "already there is not run again (unless in --rerun)")
    parser.add_argument("--rerun", nargs="+", default=(), metavar="NAME", help="run these again though in --jsonl")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: the document from --jsonl, architectures not there as 'not run'")
    parser.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        warnings.filterwarnings("ignore", message=".*transformer_engine.*")
        print(_MARK + json.dumps(dataclasses.asdict(conform(args.worker))), flush=True)
        return
    names = architectures()
    for option, given in (("--only", args.only or ()), ("--rerun", args.rerun)):
        unknown = sorted(set(given) - set(names))
        if unknown:
            parser.error(f"{option}: {unknown[0]!r} is not a model type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    names = [n for n in names if n in args.only] if args.only else names
    threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    results: dict[str, Result] = {}
    if args.jsonl and args.jsonl.exists():  # later lines replace earlier ones
        kept = (_result(json.loads(line)) for line in args.jsonl.read_text().splitlines() if line.strip())
        results = {r.name: r for r in kept if r.name in names and r.name not in args.rerun}

    def one(name: str) -> Result:
        reason = excluded(name)
        result = Result(name, _model_class(name).__name__, "excluded", reason) if reason else run_isolated(
            name, args.timeout, threads)
        results[name] = result
        detail = result.reason or f"loss {_fmt(result.loss_error)} grad {_fmt(result.grad_error)} head {result.head}"
        print(f"[{len(results)}/{len(names)}] {name}: {result.status} ({result.seconds:.0f} s) {detail}", flush=True)
        if args.jsonl:
            with args.jsonl.open("a") as f:
                f.write(json.dumps(dataclasses.asdict(result)) + "\n")
        return result

    if args.report_only:
        results.update({n: Result(n, _model_class(n).__name__, *(("excluded", reason) if (reason := excluded(n))
                                                                 else ("not run",))) for n in names if n not in results})
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, [n for n in names if n not in results]))
    ordered = [results[n] for n in names]
    command = "python benchmarks/diagnostics/hf_conformance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.output:
        args.output.write_text(document(ordered, command.strip()))
        print(f"{summary(ordered)}; wrote {args.output}")
    else:
        print(table(ordered))
        print(summary(ordered))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
