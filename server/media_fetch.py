"""Fetch `image_url`s (http, https, data) and turn them into processed images.

One pooled `httpx.AsyncClient` per app. Every fetch runs under a TOTAL deadline
(`asyncio.timeout` around the whole fetch, redirects included, not only httpx's idle
timeout), the byte cap is enforced while the body streams in, redirects are bounded, and
only http/https/data schemes are accepted. Decoding and preprocessing (CPU work) run in a
small thread pool, off the event loop. `fetch_url_bytes` is the ONE network fetch
function: guards against private addresses belong there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from engine.errors import MediaError
from engine.multimodal.image_processor import ImageProcessorConfig, ProcessedImage, process_image
from engine.multimodal.media import decode_data_url, decode_image


@dataclass(frozen=True)
class MediaFetchConfig:
    """Limits for fetching media; resolved from ServerSettings at start-up."""

    max_image_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0
    allow_private_urls: bool = False
    max_image_pixels: int = 64_000_000
    max_redirects: int = 3
    num_decode_threads: int = 2


class MediaFetcher:
    """Fetches and preprocesses images for the server. Call `aclose()` at shutdown."""

    def __init__(self, config: MediaFetchConfig, image_config: ImageProcessorConfig):
        self.config = config
        self.image_config = image_config
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            timeout=httpx.Timeout(config.timeout_s),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
        )
        self._pool = ThreadPoolExecutor(
            max_workers=config.num_decode_threads, thread_name_prefix="media-decode"
        )

    async def aclose(self) -> None:
        await self._client.aclose()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def load_image(self, url: str, *, param: str) -> ProcessedImage:
        """Fetch (or decode a data: URL), decode and preprocess one image."""
        if url.startswith("data:"):
            data = decode_data_url(url, max_bytes=self.config.max_image_bytes, param=param)
        else:
            data = await self.fetch_url_bytes(url, param=param)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._decode_and_process, data, param)

    def _decode_and_process(self, data: bytes, param: str) -> ProcessedImage:
        image = decode_image(data, max_pixels=self.config.max_image_pixels, param=param)
        return process_image(image, self.image_config)

    async def fetch_url_bytes(self, url: str, *, param: str) -> bytes:
        """GET an http(s) URL under a total deadline and a byte cap, following at most
        `max_redirects` redirects (each hop re-checked)."""
        max_redirects = self.config.max_redirects
        try:
            async with asyncio.timeout(self.config.timeout_s):
                for _ in range(max_redirects + 1):
                    await self._check_url(url, param=param)
                    request = self._client.build_request("GET", url)
                    response = await self._client.send(request, stream=True)
                    try:
                        if response.is_redirect:
                            location = response.headers.get("location")
                            if not location:
                                raise MediaError("redirect without a location", param=param)
                            url = str(response.url.join(location))
                            continue
                        if response.status_code != 200:
                            raise MediaError(
                                f"fetching the image returned HTTP {response.status_code}",
                                param=param,
                            )
                        return await self._read_capped(response, param=param)
                    finally:
                        await response.aclose()
                raise MediaError(f"more than {max_redirects} redirects", param=param)
        except TimeoutError as exc:
            raise MediaError(
                f"fetching the image took longer than {self.config.timeout_s:g} s", param=param
            ) from exc
        except httpx.HTTPError as exc:
            raise MediaError("the image URL could not be fetched", param=param) from exc

    async def _read_capped(self, response: httpx.Response, *, param: str) -> bytes:
        cap = self.config.max_image_bytes
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise MediaError(f"the image is over {cap} bytes", param=param)
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > cap:
                raise MediaError(f"the image is over {cap} bytes", param=param)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _check_url(self, url: str, *, param: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise MediaError("image URLs must use http, https or data", param=param)
        if not parts.hostname:
            raise MediaError("the image URL has no host", param=param)
        if self.config.allow_private_urls:
            return
        if await _resolves_to_private(parts.hostname, parts.port or 443):
            raise MediaError("the image URL points to a private address", param=param)


async def _resolves_to_private(host: str, port: int) -> bool:
    """A basic guard (the full SSRF guard, pinned to the connection, comes later)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return False  # let the fetch fail with its own error
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            return True
    return False
