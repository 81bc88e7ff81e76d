"""server/media_fetch.py: per-request processing settings and the decode thread pools."""

from __future__ import annotations

import asyncio
import base64
import threading

import pytest

from bench.local_inputs import moving_pictures, picture, png_bytes, video_bytes
from engine.errors import InvalidRequest
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.video import VideoConfig
from server import media_fetch
from server.media_fetch import MediaFetchConfig, MediaFetcher
from server.media_options import MediaProcessingOptions


def test_request_processing_narrows_the_server_bounds():

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


def test_an_image_does_not_wait_behind_decoding_videos(monkeypatch):
    """Videos decode on their own threads: with every video thread busy (held here until
    the image is done), an image is still processed. With one shared pool it waited."""
    release = threading.Event()
    real_load_video = media_fetch.load_video

    def held_load_video(*args, **kwargs):
        release.wait(timeout=30)
        return real_load_video(*args, **kwargs)

    monkeypatch.setattr(media_fetch, "load_video", held_load_video)
    video = (
        "data:video/mp4;base64,"
        + base64.b64encode(video_bytes(moving_pictures(64, 48, 8), fps=4)).decode()
    )
    image = "data:image/png;base64," + base64.b64encode(png_bytes(picture(56, 56, 1))).decode()

    async def scenario() -> None:
        config = MediaFetchConfig(num_image_decode_threads=1, num_video_decode_threads=2)
        fetcher = MediaFetcher(config, ImageProcessorConfig())
        try:
            videos = [
                asyncio.create_task(fetcher.load(video, "video", param=f"v{i}")) for i in range(3)
            ]
            await asyncio.sleep(0.05)  # the video threads are taken
            processed = await asyncio.wait_for(fetcher.load(image, "image", param="i"), 10)
            assert processed.grid_thw == (1, 4, 4)
            assert not any(task.done() for task in videos)
            release.set()
            assert len({(await task).content_hash for task in videos}) == 1
        finally:
            release.set()
            await fetcher.aclose()

    asyncio.run(scenario())


def test_a_data_url_scheme_in_capitals_is_a_data_url():
    """URL schemes are case-insensitive: "DATA:" was refused as "only http and https URLs
    can be fetched" while "HTTP://" and "FILE://" worked."""
    payload = base64.b64encode(png_bytes(picture(56, 56, 1))).decode()

    async def scenario() -> list:
        fetcher = MediaFetcher(MediaFetchConfig(), ImageProcessorConfig())
        try:
            return [await fetcher.load(f"{scheme}:image/png;base64,{payload}", "image", param="i")
                    for scheme in ("data", "DATA", "Data")]  # fmt: skip
        finally:
            await fetcher.aclose()

    assert len({processed.content_hash for processed in asyncio.run(scenario())}) == 1


def test_another_requests_image_does_not_wait_behind_a_whole_request():
    """Two decode threads. Request a sends three slow images, request b one image just
    after: the first thread to come free takes b's, where b waited behind all three (an
    8000x8000 16-bit PNG decodes in seconds; fuzz69); a alone used both threads (capping a
    request at half of them slowed a lone request; fuzz73)."""
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a0", "a1", "a2", "b0")}

    class Slow(MediaFetcher):
        def _decode_and_process(self, data, kind, param, processing):
            started.append(param)
            gates[param].wait(5)
            return super()._decode_and_process(data, kind, param, processing)

    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(56, 56, 1))).decode()

    async def until(count: int) -> None:
        for _ in range(500):
            if len(started) >= count:
                return
            await asyncio.sleep(0.01)

    async def scenario():
        fetcher = Slow(MediaFetchConfig(num_image_decode_threads=2), ImageProcessorConfig())
        a, b = object(), object()
        try:
            loads = [asyncio.create_task(fetcher.load(url, "image", param=f"a{i}", owner=a))
                     for i in range(3)]  # fmt: skip
            await until(2)
            assert started == ["a0", "a1"]  # alone: both threads
            loads.append(asyncio.create_task(fetcher.load(url, "image", param="b0", owner=b)))
            await asyncio.sleep(0.05)
            gates["a0"].set()  # one thread comes free: b's turn, not a's third
            await until(3)
            assert started == ["a0", "a1", "b0"]
            for gate in gates.values():
                gate.set()
            await asyncio.gather(*loads)
        finally:
            for gate in gates.values():
                gate.set()
            await fetcher.aclose()

    asyncio.run(scenario())
    assert started == ["a0", "a1", "b0", "a2"]
