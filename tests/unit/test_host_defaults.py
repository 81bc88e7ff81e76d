"""The defaults that depend on the host (server/host_defaults.py): usable cores, API
processes and image threads, and the settings that take them when left unset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.host_defaults import (
    default_api_server_count,
    default_image_decode_threads,
    usable_cores,
)
from server.settings import SettingsError, load_settings


def test_api_server_count_defaults_to_a_quarter_of_the_cores_on_a_gpu_and_one_elsewhere() -> None:
    assert [default_api_server_count("cuda", cores) for cores in (2, 4, 8, 16, 64)] == [
        1, 1, 2, 4, 4,
    ]  # fmt: skip
    assert default_api_server_count("cuda:1", 16) == 4
    assert default_api_server_count("cpu", 64) == 1
    assert default_api_server_count("auto", 64) == (4 if torch.cuda.is_available() else 1)
    assert load_settings(["--device", "cpu"], {}).api_server_count == 1
    assert load_settings(["--api-server-count", "3"], {}).api_server_count == 3
    addresses = ["--engine-inbox-address", "tcp://127.0.0.1:5001",
                 "--engine-outbox-address", "tcp://127.0.0.1:5002"]  # fmt: skip
    assert load_settings([*addresses, "--device", "cuda"], {}).api_server_count == 1


def test_usable_cores_honour_a_cgroup_cpu_quota(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    affinity = usable_cores(tmp_path / "absent")
    cpu_max.write_text("max 100000\n")  # no quota
    assert usable_cores(cpu_max) == affinity
    cpu_max.write_text("150000 100000\n")  # docker run --cpus 1.5
    assert usable_cores(cpu_max) == min(affinity, 2)
    cpu_max.write_text("10000 100000\n")  # a tenth of a core is still one
    assert usable_cores(cpu_max) == 1
    for garbled in ("garbled\n", "100000 0\n"):
        cpu_max.write_text(garbled)
        assert usable_cores(cpu_max) == affinity


def test_image_decode_threads_default_to_half_the_cores_shared_by_the_api_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert [default_image_decode_threads(cores, 1) for cores in (1, 2, 4, 12, 16, 64)] == [
        2, 2, 2, 6, 8, 8
    ]  # fmt: skip
    assert default_image_decode_threads(16, 4) == 2 and default_image_decode_threads(64, 2) == 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert load_settings(["--model", "m"], {}).image_decode_thread_count() == 8
    two = load_settings(["--model", "m", "--api-server-count", "2"], {})
    assert two.image_decode_thread_count() == 4
    assert load_settings(["--image-decode-threads", "3"], {}).image_decode_thread_count() == 3
    with pytest.raises(SettingsError, match="image_decode_threads must be positive"):
        load_settings(["--image-decode-threads", "0"], {})
    monkeypatch.delattr("os.sched_getaffinity")  # not on every platform
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    assert load_settings(["--model", "m"], {}).image_decode_thread_count() == 6
