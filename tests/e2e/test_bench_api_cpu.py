"""bench/api_cpu.py end to end, small: it starts the real server, runs its loads and
reports the API process's CPU per request and per token from /proc."""

from __future__ import annotations

import json
import sys

import pytest

from bench.api_cpu import main

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_api_cpu_reports_every_load(tmp_path, capsys):
    # /proc counts CPU time in 10 ms ticks: 4 requests of 4 tokens once read 0.0 s for both
    # processes. 16 x 16 tokens keep each process well past a tick.
    out = tmp_path / "api_cpu.json"
    flags = ["--num-requests", "16", "--concurrency", "4", "--max-tokens", "16"]
    loads = ["--loads", "text", "image", "image-same"]
    assert main([*flags, *loads, "--input-len", "20", "--image-size", "64x64", "--out",
                 str(out)]) == 0  # fmt: skip
    results = json.loads(out.read_text())["this"]
    for load in ("text", "image", "image-same"):
        row = results[load]
        assert row["completed"] == 16
        assert row["api_cpu_s"] > 0 and row["engine_cpu_s"] > 0
        assert row["api_us_per_token"] == pytest.approx(1e6 * row["api_cpu_s"] / 256)
    table = capsys.readouterr().out
    assert "| text | this |" in table and "| image | this |" in table
    assert "| image-same | this |" in table


def test_api_cpu_compares_variants(tmp_path, capsys):
    out = tmp_path / "api_cpu.json"
    flags = ["--num-requests", "16", "--concurrency", "4", "--max-tokens", "16"]
    assert main([*flags, "--loads", "text", "--input-len", "20", "--variants", "",
                 "--api-server-count 2", "--out", str(out)]) == 0  # fmt: skip
    results = json.loads(out.read_text())
    two = "this --api-server-count 2"
    assert set(results) == {"this", two}
    for name in results:
        assert results[name]["text"]["completed"] == 16
        assert results[name]["text"]["api_cpu_s"] > 0  # two: summed over both API processes
    assert f"| text | {two} / this |" in capsys.readouterr().out
