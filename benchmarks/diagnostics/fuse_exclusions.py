"""Fused replays on CUDA: which excluded ops make them bit-identical to plain Thunder?"""
import sys, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from _train import train_step
from thunder_memopt import MemoryOptimization, fuse
torch.use_deterministic_algorithms(True, warn_only=True)
base = set(fuse._FUSIBLE_LEAVES)
variants = {"none": set(), "erf": {"erf"}, "rsqrt": {"rsqrt"}, "div": {"div", "true_divide"},
            "erf+rsqrt+div": {"erf", "rsqrt", "div", "true_divide"}}
for model in ["stablecode-completion-alpha-3b", "Llama-3-8B"]:
    ref = train_step(model, [], device="cuda")
    for name, excluded in variants.items():
        fuse._FUSIBLE_LEAVES.clear(); fuse._FUSIBLE_LEAVES.update(base - excluded); fuse._compiled_functions.clear()
        r = train_step(model, [MemoryOptimization()], device="cuda")
        bad = [n for n in ref.grads if not torch.equal(r.grads[n], ref.grads[n])]
        print(model, "excluding", name, "loss equal", torch.equal(r.loss, ref.loss), "grads differing", len(bad), "of", len(ref.grads), flush=True)
