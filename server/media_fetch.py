"""Fetch `image_url`s and `video_url`s (http, https, data, file) and turn them into
processed images and videos (sampled frames as one item, engine/multimodal/video.py).

One pooled, SSRF-guarded aiohttp session per app (engine/url_safety.py: every
connection resolves, checks and dials the checked address; env proxies are ignored; no
cookie jar). It is created on the first fetch, on the event loop that uses it.
Every fetch runs under a TOTAL deadline (`asyncio.timeout` around the whole fetch,
redirects included), the byte cap is enforced while the body streams in, every redirect
hop is re-checked and their number bounded. `file://` reads only under
`--allowed-local-media-path`. Images and videos have their own byte caps. Decoding and
preprocessing (CPU work) run in small thread pools off the event loop, one for images and
one for videos (decoding a long video takes hundreds of milliseconds: an image must not
queue behind it), and repeats of the same bytes come from a `ProcessedImageCache`. A
request's `mm_processor_kwargs` narrow the preprocessing (`MediaFetcher.processing_for`);
the cache keys by the settings used.
`fetch_url_bytes` is the ONE network fetch function.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from engine.errors import MediaError
from engine.multimodal.image_processor import ImageProcessorConfig, ProcessedImage, process_image
from engine.multimodal.media import (
    allow_image_pixels,
    decode_data_url,
    decode_image,
    is_data_url,
)
from engine.multimodal.processing import MediaKind, MediaProcessing
from engine.multimodal.video import VideoConfig
from engine.multimodal.video_decode import VideoLimits, load_video
from engine.url_safety import (
    BodyTooLargeError,
    RedirectError,
    UnsafeUrlError,
    UrlPolicy,
    guarded_session,
    open_checked,
    read_capped,
)
from server.fair_pool import FairPool
from server.image_cache import ProcessedImageCache, bytes_key
from server.settings import ServerSettings

if TYPE_CHECKING:
    from server.media_options import MediaProcessingOptions


@dataclass(frozen=True)
class MediaFetchConfig:
    """Limits for fetching media: ServerSettings' (`of`), whose defaults are its own."""

    max_image_bytes: int = ServerSettings.max_image_bytes
    timeout_s: float = ServerSettings.media_fetch_timeout_s
    allow_private_urls: bool = False
    max_image_pixels: int = ServerSettings.max_image_pixels
    max_redirects: int = ServerSettings.media_fetch_max_redirects
    num_image_decode_threads: int = 2
    num_video_decode_threads: int = ServerSettings.video_decode_threads
    processed_image_cache_bytes: int = ServerSettings.image_cache_mb * 1024 * 1024  # 0 = off
    allowed_domains: str | None = None  # comma-separated host allowlist; None = any
    allowed_local_path: str | None = None  # file:// only under this folder; None = off
    max_video_bytes: int = ServerSettings.max_video_bytes
    max_video_decode_seconds: float = ServerSettings.max_video_decode_seconds
    max_connections: int = ServerSettings.media_fetch_max_connections  # per API process
    max_connections_per_host: int = ServerSettings.media_fetch_max_connections_per_host

    @classmethod
    def of(cls, settings: ServerSettings) -> MediaFetchConfig:
        return cls(
            max_image_bytes=settings.max_image_bytes,
            timeout_s=settings.media_fetch_timeout_s,
            allow_private_urls=settings.allow_private_media_urls,
            max_image_pixels=settings.max_image_pixels,
            processed_image_cache_bytes=settings.image_cache_mb * 1024 * 1024,
            max_redirects=settings.media_fetch_max_redirects,
            max_connections=settings.media_fetch_max_connections,
            max_connections_per_host=settings.media_fetch_max_connections_per_host,
            allowed_domains=settings.allowed_media_domains,
            allowed_local_path=settings.allowed_local_media_path,
            max_video_bytes=settings.max_video_bytes,
            max_video_decode_seconds=settings.max_video_decode_seconds,
            num_image_decode_threads=settings.image_decode_thread_count(),
            num_video_decode_threads=settings.video_decode_threads,
        )

    @property
    def url_policy(self) -> UrlPolicy:
        return UrlPolicy.from_strings(
            allow_private=self.allow_private_urls,
            allowed_domains=self.allowed_domains,
            allowed_local_path=self.allowed_local_path,
        )


class MediaFetcher:
    """Fetches and preprocesses images and videos for the server. Call `aclose()` at
    shutdown."""

    def __init__(
        self,
        config: MediaFetchConfig,
        image_config: ImageProcessorConfig,
        video_config: VideoConfig | None = None,
        *,
        on_processed: Callable[[MediaKind, float], None] | None = None,
        on_cache_lookup: Callable[[bool], None] | None = None,
        on_cache_resize: Callable[[int], None] | None = None,
    ):
        """`on_processed(kind, seconds)` hears of every successful `load`, the other two of
        the processed-image cache's lookups and size (metrics)."""
        self.config = config
        self.on_processed = on_processed
        self.image_config = image_config
        self.video_config = video_config or VideoConfig(image_config)
        allow_image_pixels(config.max_image_pixels)
        self.video_limits = VideoLimits(
            max_frame_pixels=config.max_image_pixels,
            max_decode_seconds=config.max_video_decode_seconds,
        )
        self.policy = config.url_policy
        self._session: aiohttp.ClientSession | None = None
        # Requests take turns on them (server/fair_pool.py): a request of many large
        # images no longer holds every thread while another's small one waits (fuzz69).
        self._pools = {
            "image": FairPool(config.num_image_decode_threads, "image-decode"),
            "video": FairPool(config.num_video_decode_threads, "video-decode"),
        }
        self.processed = ProcessedImageCache(
            config.processed_image_cache_bytes,
            on_lookup=on_cache_lookup,
            on_resize=on_cache_resize,
        )
        self.default_processing = MediaProcessing(image_config, self.video_config)

    def processing_for(self, options: MediaProcessingOptions | None) -> MediaProcessing:
        """The preprocessing a request's `mm_processor_kwargs` ask for (they may narrow the
        server's settings, never widen them: engine/multimodal/processing.py)."""
        if options is None:
            return self.default_processing
        return self.default_processing.narrowed(options.model_dump(exclude_none=True))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
        for pool in self._pools.values():
            pool.shutdown()

    async def load_image(self, url: str, *, param: str) -> ProcessedImage:
        """Fetch (or decode a data: URL), decode and preprocess one image."""
        return await self.load(url, "image", param=param)

    async def load(
        self,
        url: str,
        kind: MediaKind,
        *,
        param: str,
        processing: MediaProcessing | None = None,
        owner: Hashable | None = None,
    ) -> ProcessedImage:
        """Fetch (or decode a data: URL), decode and preprocess one image or video (its
        frames sampled) under `processing` (default: the server's settings). The loads of
        one `owner` (a request) take turns with other owners' for the decode threads;
        None: a turn of its own."""
        started = time.perf_counter()
        processing = processing or self.default_processing
        owner = object() if owner is None else owner
        processed = await self._load(url, kind, param, processing, owner)
        if self.on_processed is not None:
            self.on_processed(kind, time.perf_counter() - started)
        return processed

    async def _load(
        self, url: str, kind: MediaKind, param: str, processing: MediaProcessing, owner: Hashable
    ) -> ProcessedImage:
        pool = self._pools[kind]
        if is_data_url(url):
            # base64 of a large image is milliseconds of CPU: off the event loop too.
            return await pool.run(owner, self._process_data_url, url, kind, param, processing)
        if url[:7].lower() == "file://":
            data = await asyncio.to_thread(self._read_local, url, kind, param)
        elif url.partition(":")[0].lower() in ("http", "https"):
            data = await self.fetch_url_bytes(url, param=param, kind=kind)
        else:  # bare base64 or a relative path: "only http and https" misled (fuzz69)
            local = (
                ", or file:// under --allowed-local-media-path"
                if self.policy.allowed_local_path
                else ""
            )
            raise MediaError(
                f"the {kind} URL must be an http(s):// or data: URL{local}", param=param
            )
        return await pool.run(owner, self._decode_and_process, data, kind, param, processing)

    def _max_bytes(self, kind: MediaKind) -> int:
        return self.config.max_image_bytes if kind == "image" else self.config.max_video_bytes

    def _process_data_url(
        self, url: str, kind: MediaKind, param: str, processing: MediaProcessing
    ) -> ProcessedImage:
        data = decode_data_url(url, max_bytes=self._max_bytes(kind), param=param)
        return self._decode_and_process(data, kind, param, processing)

    def _decode_and_process(
        self, data: bytes, kind: MediaKind, param: str, processing: MediaProcessing
    ) -> ProcessedImage:
        # The same bytes as image_url and as video_url, or under other settings, differ.
        key = f"{bytes_key(data)}:{kind}:{processing.cache_tag(kind)}"
        processed = self.processed.get(key)
        if processed is None:
            try:
                if kind == "image":
                    image = decode_image(data, max_pixels=self.config.max_image_pixels, param=param)
                    processed = process_image(image, processing.image)
                else:
                    processed = load_video(data, processing.video, self.video_limits, param=param)
            except MediaError as exc:  # the processors' own errors name no part
                exc.param = exc.param or param
                raise
            self.processed.put(key, processed)
        return processed

    def _read_local(self, url: str, kind: MediaKind, param: str) -> bytes:
        try:
            path = self.policy.resolve_local_path(url)
        except UnsafeUrlError as exc:
            raise MediaError(str(exc), param=param) from None
        cap = self._max_bytes(kind)
        with path.open("rb") as file:
            data = file.read(cap + 1)
        if len(data) > cap:
            raise MediaError(f"the {kind} is over {cap} bytes", param=param)
        return data

    async def fetch_url_bytes(self, url: str, *, param: str, kind: MediaKind = "image") -> bytes:
        """GET an http(s) URL under a total deadline and the byte cap of `kind`, following
        at most `max_redirects` redirects (each hop re-checked)."""
        if self._session is None:
            self._session = guarded_session(
                self.policy,
                timeout_s=self.config.timeout_s,
                max_connections=self.config.max_connections,
                max_connections_per_host=self.config.max_connections_per_host,
            )
        cap = self._max_bytes(kind)
        try:
            async with (
                asyncio.timeout(self.config.timeout_s),
                open_checked(
                    self._session,
                    self.policy,
                    "GET",
                    url,
                    max_redirects=self.config.max_redirects,
                ) as response,
            ):
                if response.status != 200:
                    raise MediaError(
                        f"fetching the {kind} returned HTTP {response.status}", param=param
                    )
                return await read_capped(
                    response.content.iter_any(), cap, declared_length=response.content_length
                )
        except BodyTooLargeError:
            raise MediaError(f"the {kind} is over {cap} bytes", param=param) from None
        except TimeoutError as exc:
            raise MediaError(
                f"fetching the {kind} took longer than {self.config.timeout_s:g} s", param=param
            ) from exc
        except (UnsafeUrlError, RedirectError) as exc:
            raise MediaError(str(exc), param=param) from None
        except aiohttp.ClientError as exc:
            raise MediaError(f"the {kind} URL could not be fetched", param=param) from exc
