"""``python -m thunder_memopt plan``: a training step's per-rank peak allocated memory, planned before
launch, on a machine without a GPU.

One Block (a litgpt config's, or a transformers causal LM's decoder layer, ``hf_models``) at its
real width and the head (final norm, head and loss; transformers': the model's own loss) are traced
on the meta device under ``MemoryOptimization``, as the GPU's executors make them (the fused loss
head, cuDNN attention and the fusion executor's regions, claimed for meta and never compiled;
transformers' attention with its key and value heads repeated). Each program's recompute ladder is
planned and priced as ``memory_limit`` prices it (``passes.fit``), and the step is composed from
those programs as the benchmark runs it (``benchmarks/fsdp2``: FSDP2 units of each Block, litgpt's
embedding and the root, under ``thunderfx_backend``; ``Layout``) with ``fit``'s terms: the
parameters' shards and FSDP2's gathered parameters, the optimizer's states, the root's gradients
and each other Block's saved tensors, gathered parameters or gradient (``fit.first_step`` and
``fit.StepTerms``, from ``Fsdp2Unit``s computed from the parameters' shapes); and the optimizer's
step, as torch's foreach AdamW takes it. Not modelled: reserved memory; transformers' logit scaling
and soft-capping (Granite, Gemma 2), and models without rotary embeddings.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from thunder_memopt import arguments
from thunder_memopt.models import DTYPES, LossHead, narrow_config
from thunder_memopt.passes import fit, recompute

__all__ = ["Program", "StepPlan", "Layout", "SHARD_MODES", "SOURCES", "BUDGETS", "trace_programs", "plan_step", "main"]

SHARD_MODES = ("zero2", "zero3", "none")
SOURCES = ("litgpt", "transformers")  # whose model code: --model-source
BUDGETS = (1.0, 0.5, 0.0)  # the settings printed, as activation_budget
GiB = 2**30


@dataclass(frozen=True)
class Program:
    """One compiled program's ladder on meta: each rung priced, the rung each budget takes."""

    rungs: tuple[fit.RungCost, ...]
    input_bytes: int  # its forward's inputs: the parameters it reads, gathered, and its activations in
    parameter_bytes: int  # of those, its parameters
    budget_rungs: dict[float, int]  # activation_budget -> rung (recompute.choose_by_budget)
    # The pair peak at budget 1.0 without a limit: a head's with its gradients in the forward.
    default_pair_peak: int


@dataclass(frozen=True)
class StepPlan:
    """The predicted per-rank peak allocated bytes of each setting, and the plan a limit takes."""

    settings: dict[str, int]  # "budget 1.0" -> bytes
    limit_bytes: int
    limit_choice: fit.FitChoice  # the Block's, the head's peaks in others_bytes
    resident_bytes: int  # parameters, gathered parameters, optimizer states, batch

    @property
    def fits(self) -> bool:
        return self.limit_choice.fits


@contextlib.contextmanager
def _executors_claim_meta(gpu: bool) -> Iterator[list]:
    """With ``gpu``, the GPU's executors, claiming meta tensors: cuDNN attention's checker passes,
    flash's window kernels serve meta, the fusion executor takes the meta device, the loss head's
    chunk math is priced as one kernel, as on CUDA, and no region is compiled ahead. Else a CPU's:
    the fused loss head and Thunder's defaults, as ``thunderfx_backend(fusion=False)`` runs on CPU."""
    import thunder
    import thunder.torch as ltorch

    import thunder_memopt.transform as transform_module
    from thunder_memopt.executors import InductorFusionExecutor, cudnn_attention_ex, linear_cross_entropy_ex
    from thunder_memopt.executors._head_accounting import PRICED_AS_COMPILED
    from thunder_memopt.executors.window_attention import SERVED_DEVICES

    if not gpu:
        yield [linear_cross_entropy_ex, *thunder.get_default_executors()]
        return
    impl = cudnn_attention_ex.implmap[ltorch.scaled_dot_product_attention.id]
    checker, compile_ahead = impl.checker, transform_module.compile_ahead
    impl.checker, transform_module.compile_ahead = (lambda *a, **k: True), (lambda traces: 0)
    PRICED_AS_COMPILED.add("meta")
    SERVED_DEVICES.add("meta")
    try:
        fusion = InductorFusionExecutor("memopt_fusion_meta", devices=("meta",))
        yield [linear_cross_entropy_ex, cudnn_attention_ex, fusion, *thunder.get_default_executors()]
    finally:
        impl.checker, transform_module.compile_ahead = checker, compile_ahead
        PRICED_AS_COMPILED.discard("meta")
        SERVED_DEVICES.discard("meta")


def _ladder(module: torch.nn.Module, args: Sequence[torch.Tensor], executors: list, *, head: bool) -> Program:
    """``module`` jitted on meta under ``memory_limit=1`` (no rung fits, every rung priced), its
    ladder recorded as the planner receives it; a ``head`` once more at budget 1.0, where the fused
    loss head computes its gradients in the forward."""
    import thunder

    from thunder_memopt.core.memory import estimate_step
    from thunder_memopt.transform import MemoryOptimization

    memopt = MemoryOptimization(memory_limit=1, over_limit="lowest", optimizer_states=0,
                                offload_rates=fit.NOMINAL_RATES)
    planner, ladders = memopt._fit, []
    choose = planner.choose
    planner.choose = lambda plans, forward, backward, fusion=None: (ladders.append((plans, forward, backward)),
                                                                    choose(plans, forward, backward, fusion))[1]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "thunder_memopt: no recompute plan fits")
        thunder.jit(module, transforms=[memopt], executors=executors)(*args)
    (choice,), (plans, forward, backward) = memopt.fit_report.choices, ladders[-1]
    budget_rungs = {b: recompute.choose_by_budget(plans, forward, backward, b) for b in BUDGETS}
    pair = choice.rungs[0].pair_peak_bytes
    if head:
        default = thunder.jit(module, transforms=[MemoryOptimization()], executors=executors)
        default(*args)
        pair = estimate_step(thunder.last_traces(default)[-1], thunder.last_backward_traces(default)[-1]).peak_bytes
    parameters = sum(p.nbytes for p in module.parameters())
    inputs = parameters + sum(a.nbytes for a in args)
    return Program(choice.rungs, inputs, parameters, budget_rungs, pair)


@dataclass(frozen=True)
class Layout:
    """The model as the benchmark shards it, by its parameters' shapes: a Block (a decoder layer),
    the FSDP2 units other than the Blocks and the root (litgpt's embedding), and the root's."""

    n_embd: int
    block: tuple[tuple[int, ...], ...]
    others: tuple[tuple[tuple[int, ...], ...], ...]
    root: tuple[tuple[int, ...], ...]


def _shapes(module: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p.shape) for p in module.parameters())


class _DecoderLayer(torch.nn.Module):
    """A transformers decoder layer called as its model calls it: the rotary embedding's cos and sin."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.layer(x, position_embeddings=(cos, sin))


class _CausalLMHead(torch.nn.Module):
    """A transformers causal LM's final norm, head and its own loss (``loss_function``: the logits in
    fp32, the labels shifted), on the last decoder layer's output; it returns the logits too, as the
    model does, so the fused head computes its gradients from slices of them, as it runs there."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head
        self.loss_function, self.vocab_size = model.loss_function, model.config.vocab_size

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.norm(hidden))
        return self.loss_function(logits, labels, vocab_size=self.vocab_size), logits


@contextlib.contextmanager
def _sdpa_without_gqa() -> Iterator[None]:
    """transformers' SDPA with its key and value heads repeated (``repeat_kv``), as litgpt's Block
    runs it: Thunder's SDPA takes no ``enable_gqa``."""
    from transformers.integrations import sdpa_attention

    use_gqa = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
    try:
        yield
    finally:
        sdpa_attention.use_gqa_in_sdpa = use_gqa


def trace_programs(model_name: str, *, n_embd: int | None, block_size: int, micro_batch_size: int,
                   dtype: torch.dtype, gpu: bool = True, source: str = "litgpt") -> tuple[Layout, Program, Program]:
    """The model's layout, and the Block's and the head's programs, traced on meta at ``block_size``
    tokens as a GPU's executors (``gpu``) or a CPU's make them; ``source``: litgpt's config names, or
    transformers' causal LMs (``hf_models``)."""
    shape = (micro_batch_size, block_size)
    if source == SOURCES[1]:
        return _transformers_programs(model_name, n_embd=n_embd, shape=shape, dtype=dtype, gpu=gpu)
    from litgpt.model import Block

    config = narrow_config(model_name, n_layer=1, n_embd=n_embd, block_size=block_size)
    with _executors_claim_meta(gpu) as executors, torch.device("meta"):
        block = Block(config, block_idx=0).to(dtype)
        x = torch.empty(*shape, config.n_embd, dtype=dtype, requires_grad=True)
        cos = torch.empty(1, block_size, config.rope_n_elem, dtype=dtype)
        block_program = _ladder(block, (x, cos, cos.clone()), executors, head=False)
        norm = config.norm_class(config.n_embd, eps=config.norm_eps)
        head = torch.nn.Sequential(norm, torch.nn.Linear(config.n_embd, config.padded_vocab_size,
                                                         bias=config.lm_head_bias)).to(dtype)
        targets = torch.empty(*shape, dtype=torch.long)
        head_program = _ladder(LossHead(head), (x, targets), executors, head=True)
    embedding = ((config.padded_vocab_size, config.n_embd),)
    layout = Layout(config.n_embd, _shapes(block), (embedding,), _shapes(head))
    return layout, block_program, head_program


def _transformers_programs(model_name: str, *, n_embd: int | None, shape: tuple[int, int], dtype: torch.dtype,
                           gpu: bool) -> tuple[Layout, Program, Program]:
    """As ``trace_programs`` for a transformers causal LM, of one decoder layer built on meta; under
    FSDP2 the benchmark's units are the decoder layers and the root, which holds the rest."""
    from thunder_memopt import hf_models

    config = hf_models.config(model_name, n_layer=1, n_embd=n_embd, block_size=shape[1])
    model = hf_models.build(model_name, config, dtype=dtype, device="meta", seed=0)
    if getattr(model.model, "rotary_emb", None) is None:
        raise ValueError(f"plan traces transformers models with rotary embeddings; {model_name} has none")
    (layer,) = hf_models.decoder_layers(model)
    with _executors_claim_meta(gpu) as executors, torch.device("meta"), _sdpa_without_gqa():
        x = torch.empty(*shape, config.hidden_size, dtype=dtype, requires_grad=True)
        cos, sin = model.model.rotary_emb(x, torch.arange(shape[1])[None])
        block_program = _ladder(_DecoderLayer(layer), (x, cos, sin), executors, head=False)
        labels = torch.empty(*shape, dtype=torch.long)
        head_program = _ladder(_CausalLMHead(model), (x, labels), executors, head=True)
    in_layer = {id(p) for p in layer.parameters()}
    root = tuple(tuple(p.shape) for p in model.parameters() if id(p) not in in_layer)
    return Layout(config.hidden_size, _shapes(layer), (), root), block_program, head_program


def _shard(shape: Sequence[int], itemsize: int, world_size: int) -> tuple[int, int]:
    """A parameter's local shard and its gathered size, in bytes: FSDP2 pads dim 0 to a multiple of
    the world size."""
    rows = math.ceil(shape[0] / world_size) if shape else 1
    rest = math.prod(shape[1:]) * itemsize
    return rows * rest, rows * world_size * rest


def _unit(shapes: Sequence[Sequence[int]], itemsize: int, world_size: int, *, zero3: bool, root: bool,
          running: bool) -> fit.Fsdp2Unit:
    sharded = sum(_shard(s, itemsize, world_size)[0] for s in shapes)
    gathered = sum(_shard(s, itemsize, world_size)[1] for s in shapes)
    return fit.Fsdp2Unit(sharded_bytes=sharded, unsharded_bytes=gathered, unsharded_now=0, optimized_bytes=sharded,
                         reshard_after_forward=zero3 and not root, root=root, running=running,
                         signature=tuple(map(tuple, shapes)))


def plan_step(layout: Layout, block: Program, head: Program, *, n_layer: int, world_size: int, shard_mode: str,
              micro_batch_size: int, block_size: int, dtype: torch.dtype, optimizer_states: int,
              limit_bytes: int) -> StepPlan:
    """The step composed from its programs (module docstring). The peak is taken at the two places
    the planner takes it: the last Block's backward, with every other Block's saved tensors alive
    and the gradients of the units whose backward ran; the head's backward, with every Block's."""
    itemsize = dtype.itemsize
    # At one rank FSDP2 still gathers: its gathered parameters are copies of the shards.
    fsdp2 = shard_mode != "none"
    n = world_size if fsdp2 else 1
    zero3 = shard_mode == "zero3"

    def units(running: str) -> list[fit.Fsdp2Unit]:
        blocks = [_unit(layout.block, itemsize, n, zero3=zero3, root=False, running=running == "block" and i == 0)
                  for i in range(n_layer)]
        others = [_unit(shapes, itemsize, n, zero3=zero3, root=False, running=False) for shapes in layout.others]
        return [*blocks, *others, _unit(layout.root, itemsize, n, zero3=zero3, root=True, running=running == "head")]

    batch = 2 * micro_batch_size * block_size * torch.int64.itemsize

    def resident(running: str, program: Program) -> fit.StepTerms:
        """What the step holds beside the programs' own activations while ``program`` runs its backward:
        its inputs and the first step's terms (the root's gradients whole; each other Block's
        gathered parameters until its backward ends, then its gradient: ``fit.StepTerms``)."""
        us = units(running)
        if fsdp2:
            first = fit.first_step(us, 0, optimizer_states, states_made=False, allocated_seen=False)
            held, gathered, call_gradient = first.bytes, first.call_gathered_bytes, first.call_gradient_bytes
        else:  # one device: the parameters whole, no gathered copies; the gradients as FSDP2's
            local = sum(u.sharded_bytes for u in us)
            block = running == "block"
            held = optimizer_states * local + local - program.parameter_bytes + (us[-1].sharded_bytes if block else 0)
            gathered, call_gradient = 0, us[0].sharded_bytes if block else 0
        return fit.StepTerms(program.input_bytes + held + batch, calls=n_layer if running == "block" else 1,
                             call_gathered_bytes=gathered, call_gradient_bytes=call_gradient)

    # The optimizer's step, as torch's foreach AdamW runs it: the shards, their gradients, the states,
    # and one temporary of the shards' size (torch.optim.adam._multi_tensor_adam's exp_avg_sq_sqrt).
    local = sum(u.sharded_bytes for u in units("none"))
    at_optimizer = local * (2 + optimizer_states + (optimizer_states > 0)) + batch

    at_block, at_head = resident("block", block), resident("head", head)

    def peak(block_rung: int, head_rung: int | None) -> int:
        block_saved = block.rungs[block_rung].saved_bytes
        head_pair = head.default_pair_peak if head_rung is None else head.rungs[head_rung].pair_peak_bytes
        return max(at_block.peak(block.rungs[block_rung]),
                   at_head.static_bytes + n_layer * block_saved + head_pair, at_optimizer)

    settings = {f"thunder+memopt @{b:g}": peak(block.budget_rungs[b], None if b == 1.0 else head.budget_rungs[b])
                for b in BUDGETS}
    # memory_limit: the Block's rung by the limit, the head's peak at each Block rung (its own rung by
    # the limit too) as the later program whose static term holds the Blocks' saved tensors.
    others = []
    for k in range(len(block.rungs)):
        saved = n_layer * block.rungs[k].saved_bytes
        head_terms = fit.StepTerms(static_bytes=at_head.static_bytes + saved)
        others.append(max(fit.choose_by_limit(head.rungs, head_terms, limit_bytes).predicted_peak_bytes, at_optimizer))
    choice = fit.choose_by_limit(block.rungs, at_block, limit_bytes, others)
    return StepPlan(settings, limit_bytes, choice, at_block.static_bytes - block.input_bytes)


def _device_memory(text: str) -> int:
    """The card's memory: bytes (an integer, or with KiB, MiB, GiB, TiB)."""
    value = arguments.memory_limit(text)
    if not isinstance(value, int):
        raise argparse.ArgumentTypeError(f"{text!r} is not bytes (80GiB, 85899345920)")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m thunder_memopt plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-source", choices=SOURCES, default="litgpt",
                   help="whose model code: litgpt's GPT, or a transformers causal LM (its decoder layers FSDP2's "
                        "units, its own loss), as benchmarks/benchmark_fsdp2.py --model-source builds them")
    p.add_argument("--model-name", default="Llama-3-8B",
                   help="litgpt: a config name; transformers: a released model's name of thunder_memopt.hf_models, "
                        "or a causal-LM model type or config class (at its default width)")
    p.add_argument("--n-layer", type=arguments.positive_int, default=None, help="layers (default: the config's)")
    p.add_argument("--n-embd", type=arguments.narrow_width, default=None, help="narrow to this width (default: real)")
    p.add_argument("--block-size", type=arguments.positive_int, default=8192, help="sequence length T")
    p.add_argument("--micro-batch-size", type=arguments.positive_int, default=1)
    p.add_argument("--world-size", type=arguments.positive_int, default=1, help="ranks N the model is sharded over")
    p.add_argument("--shard-mode", choices=SHARD_MODES, default="zero2", help="FSDP2's (none: one device, no FSDP2)")
    p.add_argument("--device-memory", type=_device_memory, default=80 * GiB, help="the card's memory (80GiB)")
    p.add_argument("--optimizer-states", type=arguments.non_negative_int, default=2, help="per parameter (AdamW: 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = p.parse_args(argv)
    from thunder_memopt import hf_models

    check = arguments.litgpt_model_name if args.model_source == "litgpt" else hf_models.model_name
    try:
        args.model_name = check(args.model_name)
    except argparse.ArgumentTypeError as error:
        p.error(f"argument --model-name: {error}")
    if args.shard_mode == "none" and args.world_size != 1:
        p.error(f"--world-size {args.world_size} with --shard-mode none: one device holds the whole model")
    return args


def _depth(source: str, model_name: str) -> int:
    """The model's layers: its litgpt config's, or its transformers config's."""
    if source == "litgpt":
        from litgpt import Config

        return Config.from_name(model_name).n_layer
    from thunder_memopt import hf_models

    return hf_models.config(model_name, n_layer=1, n_embd=None, block_size=1).__class__().num_hidden_layers


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    n_layer = args.n_layer or _depth(args.model_source, args.model_name)
    dtype = DTYPES[args.dtype]
    layout, block, head = trace_programs(args.model_name, n_embd=args.n_embd, block_size=args.block_size,
                                         micro_batch_size=args.micro_batch_size, dtype=dtype, source=args.model_source)
    plan = plan_step(layout, block, head, n_layer=n_layer, world_size=args.world_size, shard_mode=args.shard_mode,
                     micro_batch_size=args.micro_batch_size, block_size=args.block_size, dtype=dtype,
                     optimizer_states=args.optimizer_states, limit_bytes=args.device_memory)
    print(f"# {args.model_source} {args.model_name}, {n_layer} layers, n_embd {layout.n_embd}, T={args.block_size}, "
          f"micro-batch "
          f"{args.micro_batch_size}, {args.dtype}, {args.shard_mode} over {args.world_size} rank(s), "
          f"{args.optimizer_states} optimizer states per parameter, device memory {args.device_memory / GiB:.2f} GiB")
    print("\nPredicted per-rank peak allocated (reserved memory is not predicted):\n")
    print("| setting | peak allocated GiB | fits |\n|---|---|---|")
    for name, nbytes in plan.settings.items():
        print(f"| {name} | {nbytes / GiB:.2f} | {nbytes <= plan.limit_bytes} |")
    choice = plan.limit_choice
    rung = choice.rungs[choice.rung]
    print(f"\nmemory_limit={plan.limit_bytes} takes the Block's rung {choice.rung} of {len(choice.rungs)} "
          f"(saves {rung.saved_bytes / 2**20:.0f} MiB per Block): predicted "
          f"{choice.predicted_peak_bytes / GiB:.2f} GiB, "
          + ("fits" if plan.fits else "does not fit (MemoryOptimization refuses it: over_limit='raise')"))
