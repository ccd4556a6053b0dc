"""The README's python snippets run as a user runs them, on CPU.

Each python block of README.md follows a marker ``<!-- test: NAME -->``; this file runs each in a
fresh namespace, on the tiny models the snippets build. The FSDP2 snippet runs under a one-rank
gloo process group, with the environment torchrun would give it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import thunder
import torch
import torch._dynamo
import torch.distributed as dist
from torch.distributed.elastic.utils.distributed import get_free_port

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MARKED = re.compile(r"<!-- test: (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)```", re.DOTALL)
SNIPPETS = {m["name"]: m["code"] for m in MARKED.finditer(README)}
FUSED_HEAD = "memopt_linear_cross_entropy"


def _run(name: str) -> dict:
    torch._dynamo.reset()
    namespace: dict = {"__name__": f"readme_{name}"}
    exec(compile(SNIPPETS[name], f"README.md:{name}", "exec"), namespace)
    loss = namespace["loss"]
    assert loss.ndim == 0 and math.isfinite(loss.item()), loss
    grads = [p.grad for p in namespace["model"].parameters()]
    assert grads and all(g is not None for g in grads)
    return namespace


def _uses_fused_head(traces) -> bool:
    return any(b.sym.name.startswith(FUSED_HEAD) for t in traces for b in t.bound_symbols)


def test_every_python_block_is_run():
    blocks = re.findall(r"^```python$", README, re.MULTILINE)
    assert len(blocks) == len(SNIPPETS) == 4, (len(blocks), sorted(SNIPPETS))  # trainer: tests/test_trainer.py


def test_thunder_jit_fuses_the_head():
    namespace = _run("jit")
    assert _uses_fused_head([thunder.last_traces(namespace["jitted"])[-1]])


def test_fsdp2_with_thunderfx_backend_fuses_the_head(monkeypatch):
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(get_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    try:
        namespace = _run("fsdp2")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    compiler = namespace["backend"].compiler
    traces = [thunder.last_traces(fn)[-1] for info in compiler.subgraph_infos for fn in info.thunder_compiled_fns]
    assert _uses_fused_head(traces)


def test_the_backend_by_name():
    _run("by-name")
