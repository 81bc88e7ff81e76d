"""Copies between host and device that never stall the host.

A plain `torch.tensor(host_list, device="cuda")` copies from pageable memory, which makes
the host wait until the stream has finished everything queued before the copy. Here, on
CUDA, the values are staged in pinned memory and copied with `non_blocking=True`: the copy
is queued behind earlier kernels like any other, and the host moves on to launch more.
PyTorch's caching host allocator keeps each pinned block alive until its copy has run, so
callers may drop the host tensor at once. On CPU these are plain tensors.

The way back (`copy_to_host`) is queued the same way and waited for with its own event.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def to_device(
    data: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`data` (a host list, nested list or CPU tensor) as a `dtype` tensor on `device`."""
    if isinstance(data, torch.Tensor):
        host = data.to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_to_device(destination: torch.Tensor, source: torch.Tensor) -> None:
    """`destination.copy_(source)` for a CPU `source`, non-blocking on CUDA."""
    if destination.device.type != "cuda":
        destination.copy_(source)
        return
    destination.copy_(source.pin_memory(), non_blocking=True)


@dataclass(frozen=True)
class HostCopy:
    """A device tensor on its way to (pinned) host memory. `get()` waits for this copy
    alone, not for device work queued after it: with overlap scheduling the next step is
    queued before this step's tokens are read, and `.tolist()` on the device tensor would
    wait for that step too."""

    tensor: torch.Tensor  # on the host; complete once `done` has passed
    done: torch.cuda.Event | None  # None: already complete (CPU)

    def get(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.tensor


def copy_to_host(source: torch.Tensor) -> HostCopy:
    """Queues `source`'s copy to pinned host memory (no host sync on CUDA)."""
    if source.device.type != "cuda":
        return HostCopy(source, None)
    host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    host.copy_(source, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


class DeviceTimer:
    """Times a stretch of queued device work: CUDA events on a GPU (read them only after the
    step's host sync), the host clock on CPU, where work runs as it is queued."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        self._start = self._stop = 0.0

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._stop = time.perf_counter()

    def seconds(self) -> float:
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._stop - self._start
