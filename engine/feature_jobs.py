"""What the feature fetcher (engine/feature_fetcher.py) is given and gives back: its limits
(`FetchConfig`, from EngineConfig's `feature_*` settings), the jobs of a request, each
validated feature, a request's result, and the figures the engine's metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.feature_validation import FeatureError, FeatureSpec
from engine.url_safety import http_prefixes


@dataclass(frozen=True)
class FetchConfig:
    """Limits of the fetcher: the `feature_*` settings of EngineConfig (`of`), whose
    defaults are its own."""

    parallel: int = EngineConfig.feature_fetch_parallel  # concurrent downloads per request
    timeout_s: float = EngineConfig.feature_fetch_timeout_s  # per URL, retries included
    max_bytes: int = EngineConfig.max_feature_bytes  # per file
    max_retries: int = EngineConfig.feature_fetch_retries
    backoff_s: float = 0.05  # first retry delay, doubled each time
    s3_endpoint_url: str | None = None
    allow_private_urls: bool = False  # http(s) URLs may point at loopback / private hosts
    max_redirects: int = 3  # each hop is re-checked by the SSRF guard
    # http(s) prefixes every hop must start with (`--allowed-feature-url-prefixes`, which the
    # server checks on the client's URL; a redirect is checked here); None = any
    allowed_url_prefixes: tuple[str, ...] | None = None
    # URLs whose version (strong ETag / Last-Modified) is remembered to skip a download, newest
    # used kept: a forgotten one is downloaded again. Presigned URLs are all distinct.
    max_known_versions: int = EngineConfig.feature_known_versions
    # Connections of all requests' downloads together, per storage kind (each request takes
    # up to `parallel` of them).
    max_connections: int = EngineConfig.feature_fetch_max_connections
    # Bytes of all downloads together, from the body's first byte until the file is checked.
    max_bytes_in_flight: int = EngineConfig.feature_fetch_max_bytes_in_flight

    @classmethod
    def of(cls, config: EngineConfig) -> FetchConfig:
        return cls(
            parallel=config.feature_fetch_parallel,
            timeout_s=config.feature_fetch_timeout_s,
            max_bytes=config.max_feature_bytes,
            max_retries=config.feature_fetch_retries,
            s3_endpoint_url=config.s3_endpoint_url,
            allow_private_urls=config.allow_private_feature_urls,
            allowed_url_prefixes=http_prefixes(config.allowed_feature_url_prefixes),
            max_known_versions=config.feature_known_versions,
            max_connections=config.feature_fetch_max_connections,
            max_bytes_in_flight=config.feature_fetch_max_bytes_in_flight,
        )


@dataclass(frozen=True)
class FeatureJob:
    """One URL to fetch and the span it must fill."""

    url: str
    spec: FeatureSpec


@dataclass(frozen=True)
class FetchedFeature:
    """One validated feature. `embeds` is None when the engine already holds
    `content_hash` (same URL, same ETag / Last-Modified); the engine checks and refetches
    with `force=True` if it was evicted meanwhile."""

    url: str
    content_hash: str  # blake3 hex of the file's bytes
    embeds: torch.Tensor | None  # [num_tokens, hidden], host, the file's dtype


@dataclass(frozen=True)
class FetchResult:
    request_id: str
    features: list[FetchedFeature] = field(default_factory=list)  # in job order
    error: FeatureError | None = None
    failed_job: int | None = None  # the index in `jobs` of the job whose error `error` is


@dataclass
class FetchStats:
    """Figures since the last `pop_stats()`, plus the current gauges."""

    seconds: list[float] = field(default_factory=list)  # one per finished download
    num_bytes: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count
    num_in_flight: int = 0
    num_bytes_reserved: int = 0  # held in the byte budget now
