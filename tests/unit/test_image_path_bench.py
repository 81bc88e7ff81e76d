"""bench/image_path.py on a small image: every part is timed and the bytes sent are the
image's uint8 levels (one byte per value, temporal slots included)."""

from __future__ import annotations


def test_image_path_reports_every_part(capsys):
    from bench.image_path import main

    assert main(["--size", "56", "--repeat", "1"]) == 0
    lines = {
        line[:26].strip(): line[26:].split() for line in capsys.readouterr().out.splitlines()[1:]
    }
    for part in ("fetch over HTTP (CPU)", "process_image (fresh)", "process_image (warm)", "through ZMQ",
                 "normalise (engine)"):  # fmt: skip
        value, unit = lines[part]
        assert float(value) > 0 and unit == "ms", part
    assert lines["bytes sent"] == [str(16 * 3 * 2 * 14 * 14)]  # 56x56: 16 patches of C*T*P*P


def test_a_burst_of_images_is_timed_per_thread_count(capsys):
    from bench.image_path import burst_ms, main

    per_image, mean_wait = burst_ms(56, num_images=6, threads=2)
    assert 0 < per_image and 0 < mean_wait
    assert main(["--size", "56", "--repeat", "1", "--burst", "4", "--burst-threads", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "a burst of 4 distinct images, all at once:" in out
    assert "  1 decode threads" in out and "  3 decode threads" in out
