"""What is alive at the peak of a CUDA allocator snapshot (the benchmark's ``--memory-snapshot``).

A snapshot holds the allocator's history of the measured steps, which is tens of megabytes and
needs a browser (https://pytorch.org/memory_viz). This replays the history instead: allocations
count from their ``alloc`` to their ``free_completed`` (as ``torch.cuda.max_memory_allocated``
does), and those made before the recording began are counted from its start. It prints, for each
snapshot, the peak and its largest live allocations with where they were made, short enough to
commit:

    python benchmarks/diagnostics/snapshot_peak.py SNAPSHOT.pickle [...] [--top 12]
"""

from __future__ import annotations

import argparse
import pickle
from dataclasses import dataclass
from pathlib import Path

from thunder_memopt.arguments import positive_int

GIB = 2**30
MIB = 2**20
# Frames from these files say how torch allocates, not which part of the step asked for it.
CPP_SUFFIXES = (".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh")
LIBRARY_FRAMES = ("torch/", "<frozen", "threading.py", "contextlib.py", "functools.py")


@dataclass(frozen=True)
class Allocation:
    address: int
    size: int
    where: str  # the innermost frames that are not torch's own


@dataclass(frozen=True)
class Peak:
    allocated: int  # bytes at the peak
    baseline: int  # bytes allocated before the recording began and alive at its start
    event: int  # index of the trace event that reached the peak
    events: int
    live: tuple[Allocation, ...]  # largest first


def where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` Python frames outside torch's own files, innermost first (a snapshot
    holds C++ frames too, whose files are empty, ``??`` or C++ sources)."""
    own = [f for f in frames if not f["filename"].endswith(CPP_SUFFIXES) and f["filename"] not in ("", "??")
           and not any(part in f["filename"] for part in LIBRARY_FRAMES)]
    return " < ".join(f"{f['name']} ({Path(f['filename']).name}:{f['line']})" for f in own[:depth]) or "?"


def peak_of(snapshot: dict, device: int = 0) -> Peak:
    """Replay ``snapshot``'s trace of ``device`` and return what was alive at its peak."""
    events = snapshot["device_traces"][device]
    made_in_trace = {e["addr"] for e in events if e["action"] == "alloc"}
    # Blocks alive at the dump that the trace never saw allocated were alive from its start.
    before = {b["address"]: Allocation(b["address"], b["size"], where(b.get("frames", [])))
              for segment in snapshot["segments"] if segment["device"] == device
              for b in _blocks(segment) if b["state"] == "active_allocated" and b["address"] not in made_in_trace}
    live: dict[int, Allocation] = dict(before)
    seen: set[int] = set()
    # A free of an address the trace has not yet allocated frees one allocated before the recording.
    for e in events:
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in seen and e["addr"] not in live:
            live[e["addr"]] = Allocation(e["addr"], e["size"], "before the recording: " + where(e.get("frames", [])))
    baseline = allocated = sum(a.size for a in live.values())
    best = (allocated, -1, tuple(live.values()))
    for index, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = Allocation(e["addr"], e["size"], where(e.get("frames", [])))
            allocated += e["size"]
            if allocated > best[0]:
                best = (allocated, index, tuple(live.values()))
        elif e["action"] == "free_completed" and e["addr"] in live:
            allocated -= live.pop(e["addr"]).size
    return Peak(best[0], baseline, best[1], len(events), tuple(sorted(best[2], key=lambda a: -a.size)))


def _blocks(segment: dict) -> list[dict]:
    address, blocks = segment["address"], []
    for block in segment["blocks"]:
        blocks.append({**block, "address": address})
        address += block["size"]
    return blocks


def report(path: str, top: int) -> str:
    with open(path, "rb") as f:
        peak = peak_of(pickle.load(f))
    lines = [f"## {Path(path).name}", "",
             f"peak {peak.allocated / GIB:.2f} GiB at event {peak.event} of {peak.events}; "
             f"{peak.baseline / GIB:.2f} GiB allocated before the recording", "",
             "| MiB | where |", "|---|---|"]
    by_where: dict[str, list[int]] = {}
    for allocation in peak.live:
        by_where.setdefault(allocation.where, []).append(allocation.size)
    ranked = sorted(by_where.items(), key=lambda item: -sum(item[1]))
    for place, sizes in ranked[:top]:
        count = f" ({len(sizes)} allocations)" if len(sizes) > 1 else ""
        lines.append(f"| {sum(sizes) / MIB:.1f} | {place}{count} |")
    rest = sum(sum(sizes) for _, sizes in ranked[top:])
    lines += [f"| {rest / MIB:.1f} | the other {max(len(ranked) - top, 0)} places |", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+", help="pickles written by --memory-snapshot")
    parser.add_argument("--top", type=positive_int, default=12, help="places to list by bytes alive at the peak")
    args = parser.parse_args()
    for path in args.snapshots:
        try:
            print(report(path, args.top))
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, IndexError, TypeError) as error:
            parser.error(f"{path} is not a readable --memory-snapshot file: {type(error).__name__}: {error}")


if __name__ == "__main__":
    main()
