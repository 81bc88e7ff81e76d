"""Repeated image bytes are decoded and preprocessed once (server/image_cache.py)."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
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


def test_request_processing_narrows_the_server_bounds():
    from engine.errors import InvalidRequest
    from engine.multimodal.video import VideoConfig
    from server.openai_models import MediaProcessingOptions

    image = ImageProcessorConfig(min_pixels=3136, max_pixels=1_000_000)
    frame = ImageProcessorConfig(min_pixels=3136, max_pixels=200_000)  # a lower video bound
    fetcher = MediaFetcher(MediaFetchConfig(), image, VideoConfig(frame, max_frames=16))
    assert fetcher.processing_for(None) is fetcher.default_processing
    options = MediaProcessingOptions(fps=0.5, max_frames=2, min_pixels=300_000)
    chosen = fetcher.processing_for(options)
    assert (chosen.image.min_pixels, chosen.image.max_pixels) == (300_000, 1_000_000)
    # Video frames keep the model's video bound; min_frames follows max_frames down.
    video = chosen.video
    assert (video.frame.min_pixels, video.frame.max_pixels) == (200_000, 200_000)
    assert (video.fps, video.max_frames, video.min_frames) == (0.5, 2, 2)
    assert chosen.cache_tag("image") != fetcher.default_processing.cache_tag("image")
    assert fetcher.processing_for(MediaProcessingOptions(fps=1.0)).image == image
    for too_much in ({"max_frames": 17}, {"max_pixels": 1_000_001}, {"min_pixels": 2_000_000}):
        with pytest.raises(InvalidRequest) as error:
            fetcher.processing_for(MediaProcessingOptions(**too_much))
        assert error.value.param == "mm_processor_kwargs." + next(iter(too_much))
