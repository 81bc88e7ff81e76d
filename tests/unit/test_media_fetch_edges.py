"""server/media_fetch.py's caps, statuses and settings, each pinned (mutation testing found
them untested)."""

from __future__ import annotations

import asyncio
import base64

import pytest

from bench.local_inputs import moving_pictures, picture, png_bytes, video_bytes
from engine.errors import MediaError
from engine.multimodal.image_processor import ImageProcessorConfig
from server.media_fetch import MediaFetchConfig, MediaFetcher
from server.media_options import MediaProcessingOptions


def run(config, body):
    async def scenario():
        fetcher = MediaFetcher(config, ImageProcessorConfig(min_pixels=3136, max_pixels=1_000_000))
        try:
            return await body(fetcher)
        finally:
            await fetcher.aclose()

    return asyncio.run(scenario())


def test_a_local_file_over_the_image_cap_is_refused(tmp_path):
    # file:// reads stop at the cap
    data = png_bytes(picture(200, 200, 3))
    (tmp_path / "big.png").write_bytes(data)
    config = MediaFetchConfig(allowed_local_path=str(tmp_path), max_image_bytes=len(data) - 1)
    with pytest.raises(MediaError, match="over"):
        run(config, lambda f: f.load(f"file://{tmp_path}/big.png", "image", param="p"))
    config = MediaFetchConfig(allowed_local_path=str(tmp_path), max_image_bytes=len(data))
    assert run(config, lambda f: f.load(f"file://{tmp_path}/big.png", "image", param="p"))


def test_a_video_is_held_to_the_video_cap_not_the_image_cap():
    data = video_bytes(moving_pictures(64, 48, 8), fps=4)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    config = MediaFetchConfig(max_image_bytes=len(data) // 2, max_video_bytes=len(data) * 2)
    assert run(config, lambda f: f.load(url, "video", param="v"))


def test_the_processed_cache_keys_by_kind_and_settings():
    # the same bytes under other mm_processor_kwargs, or as a video, are
    # processed again, not served from the image cache
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(448, 448, 1))).decode()

    async def body(fetcher):
        default = await fetcher.load(url, "image", param="i")
        narrowed = fetcher.processing_for(MediaProcessingOptions(max_pixels=50_000))
        small = await fetcher.load(url, "image", param="i", processing=narrowed)
        try:
            as_video = await fetcher.load(url, "video", param="v")
        except MediaError:
            as_video = None
        return default, small, as_video

    default, small, as_video = run(MediaFetchConfig(), body)
    assert small.grid_thw != default.grid_thw
    assert as_video is not default


def test_media_fetch_config_takes_every_setting(tmp_path):
    # a setting MediaFetchConfig.of() forgets is silently its default
    from engine.config import EngineConfig
    from server.settings import ServerSettings

    settings = ServerSettings(
        engine=EngineConfig(model="unused"),
        media_fetch_max_redirects=1,
        allowed_local_media_path=str(tmp_path),
        max_video_bytes=12345,
    )
    config = MediaFetchConfig.of(settings)
    assert (config.max_redirects, config.allowed_local_path, config.max_video_bytes) == (
        1,
        str(tmp_path),
        12345,
    )


def _serve(handler_body, port):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            handler_body(self)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_fetch_past_the_deadline_is_a_media_error():
    # a 400 naming the part, not a 500
    import time

    def slow(handler):
        time.sleep(2)
        handler.send_response(200)
        handler.end_headers()

    httpd = _serve(slow, 26391)
    try:
        config = MediaFetchConfig(allow_private_urls=True, timeout_s=0.3)
        with pytest.raises(MediaError, match="took longer") as err:
            run(config, lambda f: f.load("http://127.0.0.1:26391/x.png", "image", param="p"))
        assert err.value.param == "p"
    finally:
        httpd.shutdown()


def test_a_non_200_success_status_is_refused():
    # only 200 carries the whole image (a 203/206 is refused)
    data = png_bytes(picture(56, 56, 1))

    def partial(handler):
        handler.send_response(206)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    httpd = _serve(partial, 26392)
    try:
        with pytest.raises(MediaError, match="HTTP 206"):
            run(
                MediaFetchConfig(allow_private_urls=True),
                lambda f: f.load("http://127.0.0.1:26392/x.png", "image", param="p"),
            )
    finally:
        httpd.shutdown()


def test_a_preprocessing_error_names_the_part():
    # the processor's own error (aspect ratio over 200:1) carries no param: the
    # fetcher adds the part's, so the 400 says which image
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(1000, 2, 1))).decode()
    with pytest.raises(MediaError, match="aspect ratio") as err:
        run(MediaFetchConfig(), lambda f: f.load(url, "image", param="messages[0].content[1]"))
    assert err.value.param == "messages[0].content[1]"


def test_a_file_url_scheme_in_capitals_reads_the_local_file(tmp_path):
    # schemes are case-insensitive ("FILE://" was sent to the http fetcher)
    (tmp_path / "a.png").write_bytes(png_bytes(picture(56, 56, 1)))
    config = MediaFetchConfig(allowed_local_path=str(tmp_path))
    assert run(config, lambda f: f.load(f"FILE://{tmp_path}/a.png", "image", param="p"))


@pytest.mark.parametrize("local", [False, True])
def test_a_url_of_no_supported_scheme_says_which_are(tmp_path, local):
    """Bare base64 or a relative path got "only http and https URLs can be fetched", though
    data: and file:// URLs work too (fuzz69)."""
    config = MediaFetchConfig(allowed_local_path=str(tmp_path) if local else None)
    for url in ("iVBORw0KGgoAAAANSUhEUgAA", "images/cat.png"):
        with pytest.raises(MediaError) as error:
            run(config, lambda f, url=url: f.load(url, "image", param="p"))
        assert str(error.value).startswith("the image URL must be an http(s):// or data: URL")
        assert ("file://" in str(error.value)) is local and error.value.param == "p"
