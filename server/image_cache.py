"""An LRU of processed images and videos keyed by the blake3 of the fetched bytes (and,
in server/media_fetch.py, the kind and the preprocessing settings they were processed under).

Decoding a PNG and resizing / normalising it into patches costs tens of milliseconds
of CPU per image, on the same cores the engine computes on. Clients often send the
same image again (a system image, a retried or multi-turn request); with this cache
a repeat costs one hash of its bytes. Byte-identical input under identical settings
gives an identical `ProcessedImage`, so reuse cannot change an answer. Entries are
immutable and shared; the budget counts their pixel bytes (uint8 levels: a 448x448 image
takes 1.2 MB).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import blake3

from engine.multimodal.image_processor import ProcessedImage


def bytes_key(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class ProcessedImageCache:
    """Thread-safe (the decode pool calls it). `max_bytes == 0` turns it off.
    `on_lookup(hit)` hears of every lookup, `on_resize(bytes held)` of every change (the
    server's metrics: a cache filling up looks like a leak unless it is shown)."""

    def __init__(
        self,
        max_bytes: int,
        *,
        on_lookup: Callable[[bool], None] | None = None,
        on_resize: Callable[[int], None] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, ProcessedImage] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._on_lookup = on_lookup
        self._on_resize = on_resize

    def get(self, key: str) -> ProcessedImage | None:
        with self._lock:
            image = self._entries.get(key)
            if image is None:
                self.misses += 1
            else:
                self._entries.move_to_end(key)
                self.hits += 1
        if self._on_lookup is not None:
            self._on_lookup(image is not None)
        return image

    def put(self, key: str, image: ProcessedImage) -> None:
        size = image.pixel_levels.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.pixel_levels.nbytes
            held = self._bytes
        if self._on_resize is not None:
            self._on_resize(held)

    def __len__(self) -> int:
        return len(self._entries)
