"""The fused loss head across vocabularies, against inductor's unfused head, on a GPU.

Hidden 4096, T=8192, bf16, vocabularies 32000 (Llama-2), 49155 (Granite, odd), 128256 (Llama-3),
151936 (Qwen3) and 256000 (Gemma): median forward+backward ms (CUDA events) and peak MiB above the
inputs of
- inductor: ``torch.compile``d ``F.cross_entropy(F.linear(h, W).float(), t)``, alone and also
  returning the logits (as a transformers model does under ``torch.compile``);
- the fused head with the logits recomputed in the backward (``linear_cross_entropy``), and with
  the gradients in the forward;
- the fused head that also returns the logits, as transformers' models are fused (the ops the
  loss_head pass puts in a trace, run directly): recomputing them in the backward
  (``memopt_linear_cross_entropy_forward_and_logits`` and ``_backward``), and with the gradients in
  the forward from the logits' views (``..._forward_and_logits_with_gradients`` and
  ``..._scale_gradients_and_logits_grad``), at each ``--slice-mib`` of the logits' gradient, and
  so again with the logits' unused gradient unmade, as Thunder runs the head that the loss-head
  pass marks (executors.unmade_gradients).
Each row names the chunk shapes the head chose (executors._head_shapes). With ``--profile``, the
top CUDA kernels per vocabulary of the heads in ``PROFILED``: ``nvjet`` (sm90) or ``cutlass_80``
(sm80) matmuls, and the kernels around them.
Under 4 minutes on an H100 (most of it inductor's five compilations):

    python benchmarks/diagnostics/head_shapes.py [--profile] [--heads LABEL ...] [--rounds N]

``--device cpu --vocab 512 --tokens 256`` runs a smoke test of the script on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch
import thunder.core.dtypes as dtypes
from loss_head import measure, profile

from thunder_memopt.executors import chunked_cross_entropy as cce
from thunder_memopt.executors import linear_cross_entropy
from thunder_memopt.executors import _head_shapes, unmade_gradients
from thunder_memopt.executors._head_shapes import chunk_tokens, vocabulary_width

VOCABULARIES = (32000, 49155, 128256, 151936, 256000)
# The heads --profile profiles: the fused head recomputing its logits, and, as a transformers model
# runs, inductor's and the fused head that return their logits (the latter at each --slice-mib).
PROFILED = ("fused, logits recomputed", "inductor, unfused, logits returned",
            "fused, logits returned, gradients in forward")
HIDDEN = 4096


def upcast_unfused(hidden, weight, targets):
    """The unfused head as transformers' loss computes it: the logits upcast to fp32."""
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float(), targets)


def _upcast_unfused_and_logits(hidden, weight, targets):
    logits = torch.nn.functional.linear(hidden, weight)
    return torch.nn.functional.cross_entropy(logits.float(), targets), logits


def compiled_unfused_with_logits():
    """upcast_unfused, compiled, that also returns the logits as a transformers model does (autograd
    then hands them a gradient of zeros), held as with_logits holds them."""
    compiled = torch.compile(_upcast_unfused_and_logits)

    def head(hidden, weight, targets):
        loss, logits = compiled(hidden, weight, targets)
        loss.logits = logits
        return loss

    return head


class _WithLogits(torch.autograd.Function):
    """The fused head that also returns the logits, by the ops the loss_head pass puts in a trace."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        options = (-100, "mean", chunk, ())
        loss, logits, lse = cce._forward_and_logits_impl(hidden, weight, None, targets, *options, dtypes.float32)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.options = options
        return loss, logits

    @staticmethod
    def backward(ctx, grad, logits_grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        grads = cce._backward_impl(grad, hidden, weight, None, targets, lse, *ctx.options, logits_grad)
        return grads[0], grads[1], None, None


class _WithLogitsInForward(torch.autograd.Function):
    """The same head with the gradients in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        options = (-100, "mean", chunk, ())
        loss, logits, lse, *unit = cce._logits_with_gradients_impl(hidden, weight, None, targets, *options,
                                                                    dtypes.float32)
        ctx.save_for_backward(hidden, weight, targets, lse, *unit[:2])
        ctx.options = options
        return loss, logits

    @staticmethod
    def backward(ctx, grad, logits_grad):
        hidden, weight, targets, lse, *unit = ctx.saved_tensors
        grads = cce._scale_with_logits_grad_impl(grad, logits_grad, hidden, weight, None, targets, lse, *ctx.options,
                                                 *unit, None)
        return grads[0], grads[1], None, None


class _WithLogitsUnmade(_WithLogitsInForward):
    """The same, connected to autograd as Thunder connects a function whose logits the loss-head pass
    marked: where they are left unused, their gradient is one broadcast zero, never made
    (executors.unmade_gradients)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        ctx.set_materialize_grads(False)
        loss, logits = _WithLogitsInForward.forward(ctx, hidden, weight, targets, chunk)
        ctx.missing = unmade_gradients.missing_gradients((loss, logits), (logits,))
        return loss, logits

    @staticmethod
    def backward(ctx, grad, logits_grad):
        return _WithLogitsInForward.backward(ctx, *unmade_gradients.made_gradients((grad, logits_grad), ctx.missing))


def with_logits(hidden, weight, targets, function=_WithLogits):
    chunk = chunk_tokens(targets.shape[0], weight.shape[0], device=hidden.device.type)
    loss, logits = function.apply(hidden, weight, targets, chunk)
    loss.logits = logits  # held until the step ends, as a model's output holds them
    return loss


def with_logits_in_forward(slice_mib: int, function=_WithLogitsInForward):
    """with_logits, the gradients in the forward, in slices of ``slice_mib`` of the logits' gradient."""

    def head(hidden, weight, targets):
        _head_shapes.GRADIENT_SLICE_BYTES = slice_mib * 2**20
        return with_logits(hidden, weight, targets, function)

    return head


def measure_on(device: str, fn, hidden, weight, targets) -> tuple[float, float | None]:
    """(median ms, peak MiB above the inputs) on CUDA; on the CPU one timed step and no peak."""
    if device == "cuda":
        return measure(fn, hidden, weight, targets)[:2]
    start = time.perf_counter()
    fn(hidden, weight, targets).backward()
    return (time.perf_counter() - start) * 1e3, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--vocab", type=int, nargs="+", default=VOCABULARIES)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--profile", action="store_true", help="the top CUDA kernels of the heads in PROFILED")
    parser.add_argument("--slice-mib", type=int, nargs="+", default=[_head_shapes.GRADIENT_SLICE_BYTES // 2**20],
                        help="sizes of a slice of the logits' gradient, with the logits returned")
    parser.add_argument("--heads", nargs="+", metavar="LABEL",
                        help="only the heads whose label starts with one of these (default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the heads this many times, in turn, and give the median round (and the "
                             "range) of each: a ratio that run-to-run drift of the GPU does not skew")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("head_shapes: needs a GPU (or --device cpu)")
        return 2
    n = args.tokens
    print(f"T={n}, hidden {args.hidden}, bf16, {args.device}; peak = max allocated above the inputs\n")
    print("| vocab | head | chunk tokens | slice classes | fwd+bwd ms | peak MiB |")
    print("|---|---|---|---|---|---|")
    profiles: list[str] = []
    for vocab in args.vocab:
        g = torch.Generator(device=args.device).manual_seed(0)
        hidden = torch.randn(n, args.hidden, device=args.device, generator=g).bfloat16().requires_grad_()
        weight = (torch.randn(vocab, args.hidden, device=args.device, generator=g)
                  * args.hidden**-0.5).bfloat16().requires_grad_()
        targets = torch.randint(0, vocab, (n,), device=args.device, generator=g)
        chunk = chunk_tokens(n, vocab, device=args.device)
        shapes = f"{chunk} | {vocabulary_width(n, vocab, chunk) if n < vocab else '-'}"
        in_forward = functools.partial(linear_cross_entropy, gradients_in_forward=True)
        heads = (("inductor, unfused", torch.compile(upcast_unfused), "- | -"),
                 ("inductor, unfused, logits returned", compiled_unfused_with_logits(), "- | -"),
                 ("fused, logits recomputed", linear_cross_entropy, shapes),
                 ("fused, gradients in forward", in_forward,
                  f"{chunk_tokens(n, vocab, gradients_in_forward=True, device=args.device)} | -"),
                 ("fused, logits returned", with_logits, shapes))
        for mib in args.slice_mib:
            _head_shapes.GRADIENT_SLICE_BYTES = mib * 2**20
            rows, columns = _head_shapes.gradient_slices(n, vocab, 2)
            heads += ((f"fused, logits returned, gradients in forward ({mib} MiB slices)",
                       with_logits_in_forward(mib), f"{rows} | {columns}"),
                      (f"fused, logits returned, gradients in forward, unused gradient unmade ({mib} MiB slices)",
                       with_logits_in_forward(mib, _WithLogitsUnmade), f"{rows} | {columns}"))
        if args.heads:
            heads = tuple(h for h in heads if h[0].startswith(tuple(args.heads)))
        rounds = [[measure_on(args.device, fn, hidden, weight, targets) for _, fn, _ in heads]
                  for _ in range(args.rounds)]
        for i, (label, fn, chosen) in enumerate(heads):
            times = sorted(r[i][0] for r in rounds)
            ms = f"{times[len(times) // 2]:.2f}" + (f" ({times[0]:.2f}-{times[-1]:.2f})" if len(times) > 1 else "")
            peak = rounds[-1][i][1]
            print(f"| {vocab} | {label} | {chosen} | {ms} | {'-' if peak is None else f'{peak:.0f}'} |", flush=True)
            if args.profile and args.device == "cuda" and label.startswith(PROFILED):
                profiles.append(f"vocab {vocab}, {label}:\n" + profile(fn, hidden, weight, targets))
        del hidden, weight, targets
    for table in profiles:
        print("\n```\n" + table + "```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
