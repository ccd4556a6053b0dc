"""Narrowed litgpt models: the real architectures at a width that runs anywhere.

The report, the examples, the tests and the benchmark all build, feed and train their models
here, so that "the narrowed stablecode" and "a training step" mean one thing across the project.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "DTYPES",
    "narrow_config",
    "build_model",
    "random_batch",
    "GPTWithLoss",
    "HeadWithLoss",
    "LossHead",
    "next_token_loss",
    "training_step",
]


# Head size of narrowed models (narrow_config).
HEAD_SIZE = 64
# Model dtypes by the names the command lines take: short (bf16) and torch's own (bfloat16).
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def narrow_config(
    model_name: str,
    *,
    n_layer: int,
    n_embd: int | None = None,
    block_size: int | None = None,
    head_size: int = HEAD_SIZE,
    vocab_size: int = 512,
):
    """A litgpt ``Config`` of ``model_name`` with ``n_layer`` layers and, if given, width ``n_embd``.

    Narrowing keeps the architecture: head size, the ratio of query heads to key/value groups, the
    MLP's expansion ratio, the norm, the rotary fraction and parallel residual. ``n_embd=None`` keeps
    the real width (and the real vocabulary).
    """
    from litgpt import Config

    base = Config.from_name(model_name)
    overrides: dict = {"n_layer": n_layer}
    if block_size is not None:
        overrides["block_size"] = block_size
    if n_embd is not None:
        if n_embd % head_size:
            raise ValueError(f"n_embd={n_embd} is not a multiple of head_size={head_size}")
        n_head = n_embd // head_size
        group_ratio = base.n_head // base.n_query_groups
        n_query_groups = max(1, n_head // group_ratio)
        ratio = base.intermediate_size / base.n_embd
        intermediate = int(round(ratio * n_embd / 64)) * 64
        overrides.update(
            n_embd=n_embd,
            n_head=n_head,
            n_query_groups=n_query_groups,
            head_size=head_size,
            intermediate_size=intermediate,
            vocab_size=vocab_size,
            padded_vocab_size=vocab_size,
        )
        if base.moe_intermediate_size:
            overrides["moe_intermediate_size"] = intermediate
    return Config.from_name(model_name, **overrides)


def build_model(config, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0):
    """A litgpt GPT with deterministic initial weights."""
    from litgpt import GPT

    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(config)
    return model.to(dtype)


def random_batch(config, *, batch_size: int, seq_len: int, device="cpu", seed: int = 0):
    """Token ids and next-token targets drawn from the vocabulary."""
    return random_batches(config, count=1, batch_size=batch_size, seq_len=seq_len, device=device, seed=seed)[0]


def random_batches(config, *, count: int, batch_size: int, seq_len: int, device="cpu",
                   seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``random_batch``, drawn one after another from one generator: the first is
    ``random_batch``'s with the same seed."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=g).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return batches


class GPTWithLoss(torch.nn.Module):
    """A GPT and its next-token cross-entropy as one module, so that a compiler sees, and can
    optimize, the whole step.

    ``upcast_logits`` computes the loss on fp32 logits (the report); without it the loss takes the
    logits in the model's dtype, as litgpt trains (the benchmark).
    """

    def __init__(self, gpt: torch.nn.Module, *, upcast_logits: bool = False) -> None:
        super().__init__()
        self.gpt = gpt
        self.upcast_logits = upcast_logits

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.gpt(input_ids), targets, upcast_logits=self.upcast_logits)


class LossHead(torch.nn.Module):
    """The head and the loss: hidden states and targets in, the mean cross-entropy out.

    Under FSDP2 make it a unit of its own (``fully_shard(model.loss_head)``). Its input, the last
    Block's output, requires grad, so FSDP2 frees the head's gathered weight and reduce-scatters its
    gradient as soon as its backward ends. In the root's unit both would stay whole through every
    Block's backward: 2 GiB in bf16 at Llama-3's vocabulary, where the step's peak is. A unit is one
    graph under torch.compile, so the head still fuses with its cross-entropy.
    """

    def __init__(self, head: torch.nn.Module, *, upcast_logits: bool = False) -> None:
        super().__init__()
        self.head = head
        self.upcast_logits = upcast_logits

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.head(hidden), targets, upcast_logits=self.upcast_logits)


class HeadWithLoss(torch.nn.Module):
    """GPTWithLoss with the head moved out of the GPT's forward, next to the loss (``LossHead``):
    the module to compile under FSDP2.

    Under torch.compile every FSDP2 unit (each Block) breaks the graph, and a graph break inside a
    call splits its caller's frame too: the head would end the GPT's last graph and the loss start
    another, and no compiler could fuse the two. Here they are one graph, in the root's unit or in
    ``loss_head``'s own. (Only without final soft-capping, which litgpt applies after its head.)
    ``upcast_logits`` as GPTWithLoss's.
    """

    def __init__(self, gpt: torch.nn.Module, *, upcast_logits: bool = False) -> None:
        super().__init__()
        self.loss_head = LossHead(gpt.lm_head, upcast_logits=upcast_logits)
        gpt.lm_head = torch.nn.Identity()
        self.gpt = gpt

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_head(self.gpt(input_ids), targets)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, *, upcast_logits: bool = False) -> torch.Tensor:
    """Mean cross-entropy of (batch, T, vocab) logits against (batch, T) targets, on fp32 logits
    if ``upcast_logits``."""
    if upcast_logits:
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def training_step(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
                  input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One optimizer step on one batch: the loss ``loss_of(input_ids, targets)``, its backward, the
    optimizer's step, and the gradients dropped (set to None). Returns the loss, detached."""
    loss = loss_of(input_ids, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
