"""bench/sampler.py's smoke run: every preset samples and is timed."""

from __future__ import annotations

from bench import sampler as sampler_bench


def test_every_preset_runs(capsys):
    argv = ["--rows", "3", "--vocab", "64", "--prompt-len", "5", "--repeats", "2"]
    assert sampler_bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("3 rows x 64 logits on cpu")
    assert [line.split()[0] for line in lines[1:]] == list(sampler_bench.PRESETS)
    assert all(float(line.split()[1]) > 0 for line in lines[1:])
