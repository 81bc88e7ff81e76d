"""bench/trace_summary.py: a profiled step's device time, from a Chrome trace."""

from __future__ import annotations

import gzip
import json

from bench import trace_summary


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_busy_time_gaps_and_per_name_totals_are_per_step(tmp_path):
    events = [
        # Two steps of gemm, norm, gemm; the host's 1000 us between them is no gap.
        kernel("gemm", 0, 10), kernel("norm", 11, 2), kernel("gemm", 14, 10),
        kernel("gemm", 1024, 10), kernel("norm", 1035, 2), kernel("gemm", 1038, 10),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},  # host: skipped
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1050, "dur": 1},
    ]
    path = tmp_path / "step.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    text = trace_summary.summarize(path, steps=2, max_gap_us=50, width=20)
    lines = text.splitlines()
    assert lines[0] == (
        "step.json.gz: per step (2 steps) 4 device events, 22 us busy, 3 us in gaps under "
        "50 us (median 1.00 us)"
    )
    assert lines[2].split() == ["20.0", "2.0", "10.00", "gemm"]
    assert lines[3].split() == ["2.0", "1.0", "2.00", "norm"]
    assert lines[4].split() == ["0.5", "0.5", "1.00", "Memcpy", "HtoD"]


def test_a_trace_without_device_events_says_so(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x"}]}))
    assert "no device events" in trace_summary.summarize(path, 5, 50, 20)
