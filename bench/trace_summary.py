"""Where a profiled step's device time goes, read on any machine from a Chrome trace that
bench/gpu_decode.py (--profile-dir) wrote on the GPU:

    python3 bench/trace_summary.py profiles/qwen2-vl-2b-graphs-flashinfer-b1.json.gz

Prints, per step: the kernels (and copies and memsets), their busy time, the idle gaps
between them (gaps under --max-gap-us; longer ones are the host between steps), then each
kernel name's time, count and time per call, busiest first. A name's role (which
projection a cuBLAS kernel is) follows from its count and size: a decode step runs each
layer's kernels once per layer, in order (docs/gpu.md has the 2B shape's table).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    found = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"]
    return sorted(found, key=lambda e: e["ts"])


def summarize(path: Path, steps: int, max_gap_us: float, width: int) -> str:
    events = device_events(path)
    if not events:
        return f"{path}: no device events (a CPU run's trace?)"
    busy = sum(e["dur"] for e in events)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in itertools.pairwise(events)]
    short_gaps = [g for g in gaps if 0 <= g < max_gap_us]
    lines = [
        f"{path.name}: per step ({steps} steps) {len(events) / steps:.0f} device events, "
        f"{busy / steps:.0f} us busy, {sum(short_gaps) / steps:.0f} us in gaps under "
        f"{max_gap_us:g} us (median {statistics.median(short_gaps or [0]):.2f} us)",
        f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  name",
    ]
    time_by_name: Counter[str] = Counter()
    calls_by_name: Counter[str] = Counter()
    for event in events:
        time_by_name[event["name"]] += event["dur"]
        calls_by_name[event["name"]] += 1
    for name, total in time_by_name.most_common():
        calls = calls_by_name[name]
        lines.append(f"{total / steps:9.1f} {calls / steps:10.1f} {total / calls:8.2f}  "
                     f"{name[:width]}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=5,
                        help="steps in each trace (bench/gpu_decode.py's PROFILE_STEPS)")  # fmt: skip
    parser.add_argument("--max-gap-us", type=float, default=50.0)
    parser.add_argument("--width", type=int, default=100, help="characters of each name")
    args = parser.parse_args()
    for path in args.traces:
        print(summarize(path, args.steps, args.max_gap_us, args.width))


if __name__ == "__main__":
    main()
