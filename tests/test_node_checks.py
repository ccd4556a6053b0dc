"""thunder_memopt.node_checks: ThunderCompiler's per-node support checks that pass are kept across a
thunderfx_backend's compiles. Against Thunder's own check on every node: the same split, the same
loss and gradients bit for bit, and fewer checks run (a second layer repeats the first's nodes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import thunder.dynamo.utils as dynamo_utils
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.diagnostics

from benchmarks.diagnostics.hf_conformance import build  # noqa: E402
from thunder_memopt import node_checks, thunderfx_backend  # noqa: E402


def _step(monkeypatch, keep: bool):
    """A narrowed 2-layer Llama's loss, gradients and split under thunderfx_backend(fusion=False), with
    the checks kept or each run by Thunder, and how many of Thunder's checks ran."""
    thunders = node_checks._THUNDERS_CHECK
    ran = []

    def counted(*args):
        ran.append(args[1].name)
        return thunders(*args)

    # checks_kept keeps checks where the splitter calls Thunder's own (here, the counted one), and
    # leaves any other function it finds there.
    monkeypatch.setattr(node_checks, "_THUNDERS_CHECK", counted)
    monkeypatch.setattr(node_checks, "_PASSED", set())
    monkeypatch.setattr(dynamo_utils, "try_execute_thunder_symbol", counted if keep else lambda *a: counted(*a))
    torch._dynamo.reset()
    model, _ = build("llama", layers=2)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    backend = thunderfx_backend(fusion=False)
    loss = torch.compile(model, backend=backend)(input_ids=x, labels=x).loss
    loss.backward()
    split = [(len(info.thunder_compiled_fns), [r.info for r in info.split_reasons])
             for info in backend.compiler.subgraph_infos]
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, split, len(ran)


def test_kept_checks_split_as_thunders_own_and_run_fewer(monkeypatch):
    loss, grads, split, checks = _step(monkeypatch, keep=False)
    kept_loss, kept_grads, kept_split, kept_checks = _step(monkeypatch, keep=True)
    print(f"\nThunder's checks run: {checks}, with the checks kept {kept_checks}")
    assert kept_split == split
    assert torch.equal(kept_loss, loss)
    assert all(torch.equal(kept_grads[n], g) for n, g in grads.items())
    assert kept_checks < checks, (kept_checks, checks)
