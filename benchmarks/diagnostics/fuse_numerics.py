"""Fused vs unfused replays vs plain Thunder on CUDA: per-gradient max abs difference."""
import sys, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from _train import train_step
from thunder_memopt import MemoryOptimization
torch.use_deterministic_algorithms(True, warn_only=True)
for model in ["stablecode-completion-alpha-3b", "Llama-3-8B"]:
    runs = {"plain": train_step(model, [], device="cuda"), "plain2": train_step(model, [], device="cuda"),
            "unfused": train_step(model, [MemoryOptimization(fuse_replays=False)], device="cuda"),
            "fused": train_step(model, [MemoryOptimization()], device="cuda")}
    ref = runs["plain"]
    for k, r in runs.items():
        diffs = {n: (r.grads[n].float() - ref.grads[n].float()).abs().max().item() for n in ref.grads}
        bad = {n: d for n, d in diffs.items() if not torch.equal(r.grads[n], ref.grads[n])}
        print(model, k, "loss equal", torch.equal(r.loss, ref.loss), "grads differing", len(bad), "of", len(diffs), "max", max(diffs.values()), sorted(bad)[:4])
