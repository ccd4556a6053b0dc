"""The fused loss head's math on one chunk of logits, and the model's ops between its matmul and its loss.

``steps`` are the elementwise ops a model applies to the head's logits before the cross-entropy,
in order, each as ``(name, value)``: ``("mul", c)`` and ``("true_divide", c)`` by a Python number
(Granite's ``logits / logits_scaling``, Cohere's ``logits * logit_scale``), ``("tanh", None)``
(with the two, Gemma-2's final soft-capping ``tanh(logits / cap) * cap``) and ``("to", dtype)``
(a Thunder dtype). Each chunk applies them to its model-dtype logits as the model does, each op
in the dtype it ran in, so that the chunk holds the model's very values; then the chunk is upcast
to fp32. Their derivative multiplies the logits' gradient, in reverse order, in fp32.
"""

from __future__ import annotations

import torch
import thunder.core.dtypes as dtypes

__all__ = ["Steps", "transformed", "apply_steps", "steps_applied_", "steps_dtype", "lse_and_target_logit",
           "logits_grad", "loss_terms_and_logits_grad_", "scaled", "softcap_steps"]

Steps = tuple[tuple[str, object], ...]
_ARITHMETIC = {"mul": torch.mul, "true_divide": torch.true_divide}


def softcap_steps(softcap: float | None) -> Steps:
    """The steps of ``softcap * tanh(logits / softcap)`` on the fp32 logits (``linear_cross_entropy``'s option)."""
    if softcap is None:
        return ()
    return (("to", dtypes.float32), ("true_divide", softcap), ("tanh", None), ("mul", softcap))


def steps_dtype(steps: Steps | None, dtype):
    """The dtype of logits of ``dtype`` after ``steps``: that of their last cast."""
    casts = [value for op, value in steps or () if op == "to"]
    return casts[-1] if casts else dtype


def apply_steps(logits: torch.Tensor, steps: Steps | None, factors: list | None = None, *,
                in_place: bool = False) -> torch.Tensor:
    """``logits`` after ``steps``, each in the dtype the model ran it in: a new tensor where there
    are steps, unless ``in_place`` (the same bits, written over ``logits`` where no cast comes
    first). ``factors``, where given, gets each step's derivative: a number to multiply or divide by
    (``(op, value)``), or for ``tanh`` an fp32 tensor, 1 - tanh^2 of the values it gave."""
    z = logits
    for op, value in steps or ():
        out = {"out": z} if in_place else {}
        if op == "to":
            z = z.to(dtypes.to_torch_dtype(value))
        elif op == "tanh":
            z = torch.tanh(z, **out)
            if factors is not None:
                factors.append(z.float().square().neg_().add_(1.0))
        else:
            z = _ARITHMETIC[op](z, value, **out)
            if factors is not None:
                factors.append((op, value))
    return z


def steps_applied_(logits: torch.Tensor, steps: Steps | None = None) -> tuple:
    """``logits`` overwritten by their values after ``steps``, which end in their dtype: compiled,
    one pass over them instead of one per op (Gemma-2's soft-cap: three over 4.2 GB at T=8192)."""
    logits.copy_(apply_steps(logits, steps))
    return ()


def transformed(logits: torch.Tensor, steps: Steps | None, factors: list | None = None) -> torch.Tensor:
    """A chunk's model-dtype logits after ``steps``, in fp32: a new tensor, free to overwrite."""
    z = apply_steps(logits, steps, factors)
    return z.to(torch.float32, copy=z is logits)


def _times_derivative_(g: torch.Tensor, factors: list) -> torch.Tensor:
    """``g``, the gradient of the steps' result, made the gradient of their input, in place."""
    for factor in reversed(factors):
        if isinstance(factor, torch.Tensor):
            g *= factor
        elif factor[0] == "mul":
            g *= factor[1]
        else:
            g /= factor[1]
    return g


def lse_and_target_logit(logits, target, steps=None):
    """Each row's log-sum-exp and its target's logit, from one chunk's model-dtype logits."""
    z = transformed(logits, steps)
    picked = z.gather(1, target.unsqueeze(1)).squeeze(1)
    # In place: one chunk of fp32 logits is all the transient memory, when run eagerly.
    top = z.amax(dim=-1, keepdim=True)
    lse = z.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
    return lse, picked


def logits_grad(logits, lse, column, hit, row_scale, added=None, steps=None, compiled=False):
    """(d loss / d logits,) of one chunk, in the logits' dtype: softmax - one_hot(target), times each
    row's scale (zero for ignored tokens), plus ``added`` (the gradient of the steps' result where
    the model also returns it), times the steps' derivative. ``column`` is each row's target column
    in the chunk, and ``hit`` says whether the target falls in it. ``compiled``: traced for inductor.
    A tuple, as every compiled function returns."""
    factors: list = []
    z = transformed(logits, steps, factors)
    g = z.sub_(lse[:, None]).exp_()
    # Minus the one-hot target. Eagerly an indexed update in place allocates nothing; compiled, it
    # would make inductor materialize the chunk in fp32, where a mask is pointwise and fuses. Both
    # subtract 1 at the target and nothing elsewhere.
    if compiled:
        g.sub_(((torch.arange(g.shape[1], device=g.device) == column[:, None]) & hit[:, None]).to(torch.uint8))
    else:
        g[torch.arange(g.shape[0], device=g.device), column] -= hit.to(g.dtype)
    g *= row_scale[:, None]
    if added is not None:
        g += added
    return (_times_derivative_(g, factors).to(logits.dtype),)


def loss_terms_and_logits_grad_(logits, target, hit, row_scale, steps=None, compiled=False):
    """A chunk's loss terms (log-sum-exp, target logit), its logits overwritten by their gradient."""
    lse, picked = lse_and_target_logit(logits, target, steps)
    logits.copy_(logits_grad(logits, lse, target, hit, row_scale, None, steps, compiled)[0])
    return lse, picked


def scaled(grad, *grads):
    """The unit-upstream gradients computed in the forward, times the upstream gradient."""
    return tuple(g * grad for g in grads)
