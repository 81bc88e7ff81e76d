"""Repeated image bytes are decoded and preprocessed once (server/image_cache.py)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import torch
from PIL import Image

from engine.multimodal.image_processor import ImageProcessorConfig, ProcessedImage
from server.image_cache import ProcessedImageCache
from server.media_fetch import MediaFetchConfig, MediaFetcher


def _processed(num_rows: int, tag: str) -> ProcessedImage:
    levels = torch.zeros(num_rows, 16, dtype=torch.uint8)  # 16 bytes per row
    return ProcessedImage(levels, ImageProcessorConfig().normalization, (1, 2, 2), 1, tag)


def _data_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_lru_evicts_the_least_recently_used_by_bytes():
    cache = ProcessedImageCache(max_bytes=3 * 64)  # room for three 4-row entries
    for key in "abc":
        cache.put(key, _processed(4, key))
    assert cache.get("a") is not None  # "a" is now the most recent
    cache.put("d", _processed(4, "d"))
    assert cache.get("b") is None and len(cache) == 3
    assert [cache.get(k).content_hash for k in "acd"] == ["a", "c", "d"]


def test_zero_budget_and_oversized_entries_are_not_kept():
    off = ProcessedImageCache(max_bytes=0)
    off.put("a", _processed(1, "a"))
    assert off.get("a") is None
    small = ProcessedImageCache(max_bytes=32)
    small.put("big", _processed(4, "big"))
    assert len(small) == 0


def test_fetcher_processes_identical_bytes_once():
    async def scenario() -> tuple[list[ProcessedImage], MediaFetcher]:
        fetcher = MediaFetcher(MediaFetchConfig(), ImageProcessorConfig())
        try:
            urls = [_data_url(1), _data_url(1), _data_url(2)]
            return [await fetcher.load_image(u, param="p") for u in urls], fetcher
        finally:
            await fetcher.aclose()

    (first, again, other), fetcher = asyncio.run(scenario())
    assert again is first  # served from the cache, not re-decoded
    assert other.content_hash != first.content_hash
    assert (fetcher.processed.hits, fetcher.processed.misses) == (1, 2)


def test_fetcher_without_cache_still_gives_equal_images():
    async def scenario() -> list[ProcessedImage]:
        config = MediaFetchConfig(processed_image_cache_bytes=0)
        fetcher = MediaFetcher(config, ImageProcessorConfig())
        try:
            return [await fetcher.load_image(_data_url(3), param="p") for _ in range(2)]
        finally:
            await fetcher.aclose()

    first, again = asyncio.run(scenario())
    assert again is not first
    assert torch.equal(again.pixel_values, first.pixel_values)
    assert again.content_hash == first.content_hash

