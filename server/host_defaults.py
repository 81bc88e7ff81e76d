"""Defaults that depend on the host: the cores this process may use, and from them the
API processes and image threads `tessera serve` starts when the settings leave them
unset (server/settings.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may run on (its affinity: a container's cpuset), or the
    machine's where the platform cannot say (sched_getaffinity is Linux's); fewer where a
    cgroup v2 quota caps the container (`docker run --cpus 4`, a Kubernetes CPU limit),
    which leaves the affinity at every core of the host."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2 quota: the affinity stands
        pass
    return cores


def default_api_server_count(device: str, num_cores: int) -> int:
    """One API process in front of a CPU engine, whose steps are the bound. On a GPU that
    one Python process (parsing, image preprocessing, detokenizing, streaming) bounds
    serving: under issue 8's load on an H100 with 16 cores, 1 / 2 / 4 processes gave 5741 /
    7825 / 9207 output tokens/s and a TTFT p50 of 2.15 / 1.35 / 0.91 s (docs/gpu.md,
    2026-11-27), the single process busy 96% of the run. A quarter of the cores, 1 to 4,
    leaves the rest to the engine, the image threads and the clients."""
    from engine.device_config import resolve_device  # torch: only where the default is asked

    if resolve_device(device).type != "cuda":
        return 1
    return max(1, min(4, num_cores // 4))


def default_image_decode_threads(num_cores: int, api_server_count: int) -> int:
    """Half the cores, shared among the API processes, 2 to 8 threads per process. Image
    decoding and preprocessing release the GIL (a burst of 128 448x448 PNGs: 3.0 ms an
    image on one thread, 1.6 ms on two, on the 2-core development machine), and a burst of
    image requests queues on these threads: on the H100's 16-core host, two threads held
    Qwen2-VL-2B requests 334 ms on average under issue 8's load (docs/gpu.md). The other
    half of the cores is left to the engine process, the event loops and the clients."""
    return max(2, min(8, num_cores // (2 * api_server_count)))
