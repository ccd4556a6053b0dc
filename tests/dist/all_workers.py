"""torchrun worker: every worker under tests/dist/ in one job, so that the processes start, import
and set up gloo once: thunder fsdp (thunder_fsdp_worker.py), the transformers Llama under FSDP2
(hf_fsdp2_worker.py, where transformers is installed) and FSDP2 under thunderfx_backend
(fsdp2_worker.py), for tests/test_collectives.py; checkpoints of FSDP2 training
(checkpoint_worker.py), for tests/test_checkpoint.py. Each builds its models from fixed seeds and
resets dynamo before it compiles, so that it reports what it reports in a job of its own.

argv[1] is a directory: the checkpoint worker writes its files under ``checkpoint/``, and rank 0
writes ``{worker: its report}`` as JSON to ``reports.json``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch.distributed as dist

import checkpoint_worker
import fsdp2_worker
import thunder_fsdp_worker
from _common import finish


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    reports = {"thunder_fsdp": thunder_fsdp_worker.report()}
    if importlib.util.find_spec("transformers") is not None:
        import hf_fsdp2_worker

        reports["hf_fsdp2"] = hf_fsdp2_worker.report()
    reports["fsdp2"] = fsdp2_worker.report()
    (out / "checkpoint").mkdir(exist_ok=True)
    reports["checkpoint"] = checkpoint_worker.report(out / "checkpoint")
    finish(str(out / "reports.json"), reports)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
