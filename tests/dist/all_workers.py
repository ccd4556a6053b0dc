"""torchrun worker: the three workers of tests/test_collectives.py in one job, so that the
processes start, import and set up gloo once: thunder fsdp (thunder_fsdp_worker.py), the
transformers Llama under FSDP2 (hf_fsdp2_worker.py, where transformers is installed) and FSDP2
under thunderfx_backend (fsdp2_worker.py). Each builds its models from fixed seeds and resets dynamo
before it compiles, so that it reports what it reports in a job of its own.

Writes, from rank 0, ``{worker: its report}`` as JSON to argv[1].
"""

from __future__ import annotations

import importlib.util
import sys

import torch.distributed as dist

import fsdp2_worker
import thunder_fsdp_worker
from _common import finish


def main(path: str) -> None:
    dist.init_process_group("gloo")
    reports = {"thunder_fsdp": thunder_fsdp_worker.report()}
    if importlib.util.find_spec("transformers") is not None:
        import hf_fsdp2_worker

        reports["hf_fsdp2"] = hf_fsdp2_worker.report()
    reports["fsdp2"] = fsdp2_worker.report()
    finish(path, reports)


if __name__ == "__main__":
    main(sys.argv[1])
