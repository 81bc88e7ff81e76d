"""bench/gpu_decode_attention.py's CPU smoke run: the Triton kernel under the interpreter over
a sweep of its knobs (FlashInfer and the timing need a GPU)."""

from __future__ import annotations

import json

from bench import gpu_decode_attention


def test_cpu_smoke_run_sweeps_the_triton_configurations(tmp_path):
    """Every split count at the first tile, then the other tiles, warps and stages at the
    first phase's winner (untimed on CPU: the first split listed)."""
    out = tmp_path / "attention.json"
    argv = [
        "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "3",
        "--context-lens", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--block-size", "8", "--splits", "2", "0", "--block-n", "16", "32", "--stages", "0", "2",
        "--out", str(out),
    ]  # fmt: skip
    assert gpu_decode_attention.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["batch_size"], r["impl"]) for r in results[:5]] == [
        (1, "triton splits=2 block_n=16 warps=4 stages=default"),
        (1, "triton splits=auto block_n=16 warps=4 stages=default"),
        (1, "triton splits=2 block_n=16 warps=4 stages=2"),
        (1, "triton splits=2 block_n=32 warps=4 stages=default"),
        (1, "triton splits=2 block_n=32 warps=4 stages=2"),
    ]
    assert len(results) == 10 and all(r["max_abs_diff"] < 1e-5 for r in results)
