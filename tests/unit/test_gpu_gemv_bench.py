"""bench/gpu_gemv.py's CPU smoke run (tiny shapes, Triton's interpreter) and its shapes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from bench import gpu_gemv  # noqa: E402


def test_projections_are_the_decoders_fused_weights():
    """Qwen2-VL-2B: q 1536 + k and v 2 x 256 (2 KV heads of 128), gate and up 2 x 8960."""
    shapes = {p.name: (p.out_features, p.in_features, p.has_bias)
              for p in gpu_gemv.projections("qwen2-vl-2b")}  # fmt: skip
    assert shapes == {"qkv": (2048, 1536, True), "o": (1536, 1536, False),
                      "gate_up": (17920, 1536, False), "down": (1536, 8960, False)}  # fmt: skip


def test_the_sweep_keeps_to_its_budget():
    grid = gpu_gemv.sweep_grid(rows=8, in_features=1536)
    assert grid and all(8 * b.block_n * b.block_k <= gpu_gemv.SWEEP_PRODUCT_ELEMENTS for b in grid)
    assert len(gpu_gemv.sweep_grid(rows=1, in_features=1536)) > len(grid)


def test_cpu_smoke_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it too; restored after the test
    out = tmp_path / "gemv.json"
    argv = ["--device", "cpu", "--dtype", "float32", "--sizes", "tiny", "--layers", "1",
            "--rows", "1", "3", "--sweep-rows", "--replays", "1", "--out", str(out)]  # fmt: skip
    assert gpu_gemv.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["projection"], r["rows"]) for r in results] == [
        (name, rows) for name in ("qkv", "o", "gate_up", "down") for rows in (1, 3)
    ]
    # float32 sums in two orders: a few units of the largest output, never more
    assert all(r["cublas_error_units"] < 8 and r["kernel_error_units"] < 8 for r in results)
    assert all(r["kernel_us"] > 0 and r["best_blocks"] == "default" for r in results)
    assert "tiny, 3 rows, one decode step's projections" in capsys.readouterr().out
