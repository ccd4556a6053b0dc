"""Write the dated log of benchmark invocations into README.md, between its ``<!-- log -->`` markers.

    python benchmarks/results/make_log.py

One entry per invocation of ``benchmark_fsdp2.py``: the rows of one file with one command line
(less the options that only say how it ran: ``--resume``, ``--time-limit``, ``--log-dir``,
``--trial-timeout``, ``--plot``, and the folder of ``--out``), no more than an hour apart. Each
entry gives the UTC dates of its rows, the package that ran (the first commit whose
``thunder_memopt`` tree is the rows' ``memopt_tree``; else the rows' ``memopt_commit``), the GPU
and ranks, the command and the file. Files in ``archive/`` are marked so.
"""

from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
START, END = "<!-- log -->", "<!-- /log -->"
HOW_IT_RAN = {"--resume": 0, "--time-limit": 1, "--log-dir": 1, "--trial-timeout": 1, "--plot": 1}
GAP = timedelta(hours=1)


def first_commit_of_tree() -> dict[str, str]:
    """thunder_memopt tree id -> the first commit (short) whose package is that tree."""
    git = ["git", "-C", str(HERE)]
    commits = subprocess.run([*git, "rev-list", "--all", "--reverse"], capture_output=True, text=True,
                             check=True).stdout.split()
    query = "".join(f"{c}:thunder_memopt\n" for c in commits)
    trees = subprocess.run([*git, "cat-file", "--batch-check"], input=query, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    found: dict[str, str] = {}
    for commit, line in zip(commits, trees):
        tree = line.split()[0]
        found.setdefault(tree, commit[:7])
    return found


def command_of(row: dict) -> str:
    words, kept, skip = (row.get("command") or "").split(), [], 0
    for word in words:
        if skip:
            skip -= 1
            continue
        if word in HOW_IT_RAN:
            skip = HOW_IT_RAN[word]
            continue
        kept.append(word)
    text = " ".join(kept)
    text = re.sub(r"(--out|--memory-snapshot) \S*/", r"\1 ", text)
    return text.replace("benchmarks/benchmark_fsdp2.py", "benchmark_fsdp2.py")


def invocations(path: Path, trees: dict[str, str]) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("date")]
    rows.sort(key=lambda r: r["date"])
    entries: list[dict] = []
    for row in rows:
        when = datetime.fromisoformat(row["date"])
        command = command_of(row)
        tree = row.get("memopt_tree")
        package = trees.get(tree) if tree else None
        package = package or (f"{row['memopt_commit']} (as the rows say)" if row.get("memopt_commit") else "–")
        last = next((e for e in reversed(entries) if e["command"] == command), None)
        if last is not None and when - last["end"] <= GAP:
            last["end"] = when
            last["rows"] += 1
            if package not in last["packages"]:
                last["packages"].append(package)
            continue
        entries.append({"start": when, "end": when, "rows": 1, "command": command, "packages": [package],
                        "where": (f"1 × {row.get('gpu') or 'CPU'}, SIMULATED rank 0 of {row['world_size']}"
                                  if row.get("simulated") else f"{row.get('world_size', '?')} × {row.get('gpu') or 'CPU'}"),
                        "file": ("archive/" if path.parent.name == "archive" else "") + path.name})
    return entries


def log_table() -> str:
    trees = first_commit_of_tree()
    entries = [e for p in sorted([*HERE.glob("*.jsonl"), *HERE.glob("archive/*.jsonl")]) for e in invocations(p, trees)]
    entries.sort(key=lambda e: e["start"])
    lines = []
    day = None
    for e in entries:
        if e["start"].date() != day:
            day = e["start"].date()
            lines += ["", f"### {day.isoformat()}", "",
                      "| UTC | package | ranks × GPU | command | file | rows |", "|---|---|---|---|---|---|"]
        span = e["start"].strftime("%H:%M") + ("" if e["end"] == e["start"] else "-" + e["end"].strftime("%H:%M"))
        lines.append(f"| {span} | {', '.join(f'`{p}`' for p in e['packages'])} | {e['where']} | "
                     f"`{e['command']}` | `{e['file']}` | {e['rows']} |")
    return "\n".join(lines).lstrip("\n")


def main() -> None:
    text = README.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{log_table()}\n{END}{tail}")


if __name__ == "__main__":
    main()
