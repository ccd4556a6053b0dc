"""``python -m thunder_memopt plan``'s predicted per-rank peak allocated bytes against the committed
GPU rows of ``benchmarks/results/*.jsonl`` (issue 51, item 5), as a markdown table with the error.

Each configuration is the first row of thunder+memopt at budget 1.0, 0.5 or 0.0 (the budgets the
plan prints), its default head gradients and no offload, of the files and commits named in ``ROWS``;
each model and T is traced once on meta (``thunder_memopt.plan.trace_programs``):

    python benchmarks/diagnostics/plan_validation.py > benchmarks/results/plan_validation.md
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from thunder_memopt.plan import plan_step, trace_programs

RESULTS = Path(__file__).resolve().parents[1] / "results"
# (file, the row's commit): litgpt rows of FSDP2 at one rank and SIMULATED 8 and 64 ranks (some under
# a cap of 40 or 45 GiB); transformers rows of FSDP2 at one rank and of the whole model on one device.
ROWS = (
    ("stablecode_32l_zero2_1xH200_per_token.jsonl", "8611a0e"),
    ("stablecode_8l_zero2_1xH200_T8192_pareto.jsonl", "274ebb3"),
    ("stablecode_32l_zero2_sim8.jsonl", "6db2fb4-dirty"),
    ("llama3_8b_32l_zero2_sim8_T8192_budgets.jsonl", "274ebb3"),
    ("llama3_8b_32l_zero2_sim8_1xH100_T8192_cap45.jsonl", "498b044"),
    ("stablecode_32l_zero2_1xH100_T16384_cap40.jsonl", "498b044"),
    ("stablecode_32l_zero2_1xH100_T32768_cap40.jsonl", "498b044"),
    ("llama3_70b_80l_zero3_sim64_T8192_budget0.jsonl", "858ecda"),
    ("hf_qwen3_8b_4l_zero2_1xH100_T8192.jsonl", "4f839f7-dirty"),  # the package tree of 94a9646
    ("hf_gemma_2_2b_4l_zero2_1xH100_T8192.jsonl", "c2c6b3f-dirty"),
    ("hf_qwen3_8b_4l_none_1xH100_T8192.jsonl", "4f839f7-dirty"),
    ("hf_qwen2_5_7b_4l_none_1xH100_T8192.jsonl", "4f839f7-dirty"),
    ("hf_llama_3_8b_4l_none_1xH100_T8192.jsonl", "4f839f7-dirty"),
    ("hf_mistral_7b_v0_3_4l_none_1xH100_T8192.jsonl", "c2c6b3f-dirty"),
    ("hf_phi_3_mini_4l_none_1xH100_T8192.jsonl", "498b044"),
    ("hf_gemma_2_2b_4l_none_1xH100_T8192.jsonl", "4f839f7-dirty"),
    ("hf_granite_3_8b_4l_none_1xH100_T8192.jsonl", "c2c6b3f-dirty"),
)
GiB = 2**30


def _rows() -> list[dict]:
    """The first ok thunder+memopt row of each configuration and budget in ``ROWS``."""
    seen, rows = set(), []
    for name, commit in ROWS:
        for line in (RESULTS / name).read_text().splitlines():
            row = json.loads(line)
            if (row.get("row_type") != "run" or row.get("status") != "ok" or row.get("backend") != "thunder+memopt"
                    or row.get("memopt_commit") != commit or row.get("offload_keep") is not None
                    or row.get("head_gradients") is not None):
                continue
            key = (row["model"], row["n_layer"], row["block_size"], row["world_size"], _shard_mode(row),
                   row["budget"])
            if key not in seen:
                seen.add(key)
                rows.append({**row, "file": name})
    return rows


def _shard_mode(row: dict) -> str:
    """FSDP2's shard mode, or "none" where the row compiled the whole model on one device."""
    return "none" if row.get("distributed_mode") == "none" else row["shard_mode"]


def main() -> None:
    warnings.simplefilter("ignore")
    traced = {}
    print("| model | layers | T | ranks | shard | budget | measured GiB | predicted GiB | error | row |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in _rows():
        source = row.get("model_source", "litgpt")
        key = (source, row["model"], row["block_size"], row["micro_batch_size"])
        if key not in traced:
            traced[key] = trace_programs(row["model"], n_embd=None, block_size=row["block_size"],
                                         micro_batch_size=row["micro_batch_size"], dtype=torch.bfloat16,
                                         source=source)
        layout, block, head = traced[key]
        plan = plan_step(layout, block, head, n_layer=row["n_layer"], world_size=row["world_size"],
                         shard_mode=_shard_mode(row), micro_batch_size=row["micro_batch_size"],
                         block_size=row["block_size"], dtype=torch.bfloat16, optimizer_states=2, limit_bytes=1 << 50)
        name = f"thunder+memopt @{row['budget']:g}"
        if name not in plan.settings:
            continue
        measured, predicted = row["peak_alloc_rank0"], plan.settings[name]
        ranks = f"{row['world_size']}" + (" (simulated)" if row.get("simulated") else "")
        model = row["model"] + (" (transformers)" if source != "litgpt" else "")
        print(f"| {model} | {row['n_layer']} | {row['block_size']} | {ranks} | {_shard_mode(row)} | "
              f"{row['budget']:g} | {measured / GiB:.2f} | {predicted / GiB:.2f} | "
              f"{100 * (predicted - measured) / measured:+.1f}% | {row['file']} ({row['memopt_commit']}) |", flush=True)


if __name__ == "__main__":
    main()
