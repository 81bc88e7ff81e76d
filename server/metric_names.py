"""The one list of Tessera's Prometheus metrics: names, types, help text, labels, buckets.

`server/metrics.py` builds its registry from `METRICS`; the Grafana dashboard, the
HorizontalPodAutoscaler, the prometheus-adapter rules and docs/deploy.md are checked
against it by tests (tests/unit/test_deploy_manifests.py), so a renamed metric cannot
silently break a dashboard panel or the autoscaler.

`MetricSpec.name` is the name as Prometheus sees the family: counters end in `_total`
(prometheus_client adds that suffix itself, so pass `spec.client_name` to its
constructors), histograms export `<name>_bucket`, `<name>_sum` and `<name>_count`.
Every metric carries the `model_name` label first, then its own labels.

Building a registry from it::

    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    for spec in METRICS:
        extra = {"buckets": spec.buckets} if spec.type == "histogram" else {}
        kinds[spec.type](spec.client_name, spec.help, spec.labels, registry=r, **extra)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

MetricType = Literal["counter", "gauge", "histogram"]

MODEL_LABEL = "model_name"
# prometheus_client reads it at import: set by the --api-server-count launcher only
# (server/api_servers.py, server/cli.py)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# fmt: off
# Seconds, for latencies from ~1 ms (one decode step on a GPU) to minutes (long prefills).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
)
# Token counts per request or per engine step.
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
)
# fmt: on


class MetricSpec(NamedTuple):
    """One metric family: `(name, type, help)` plus its labels and histogram buckets."""

    name: str  # as exported: counters end in _total
    type: MetricType
    help: str
    labels: tuple[str, ...] = (MODEL_LABEL,)
    buckets: tuple[float, ...] = ()  # histograms only
    per_process: bool = False  # a gauge each API process sets: summed over the live ones

    @property
    def client_name(self) -> str:
        """The name to give prometheus_client (it appends `_total` to counters itself)."""
        if self.type == "counter":
            return self.name.removesuffix("_total")
        return self.name

    @property
    def series_names(self) -> tuple[str, ...]:
        """The sample names this family exports (what PromQL queries can reference)."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _counter(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, "counter", help, (MODEL_LABEL, *labels))


def _gauge(name: str, help: str) -> MetricSpec:
    return MetricSpec(name, "gauge", help)


def _histogram(name: str, help: str, buckets: tuple[float, ...], *labels: str) -> MetricSpec:
    return MetricSpec(name, "histogram", help, (MODEL_LABEL, *labels), buckets)


METRICS: tuple[MetricSpec, ...] = (
    # Scheduler state (gauges, from the EngineStats of every step).
    _gauge("tessera:num_requests_running", "Requests in the engine's running batch."),
    _gauge("tessera:num_requests_waiting", "Requests queued in the engine, not yet running."),
    _gauge(
        "tessera:num_requests_fetching",
        "Requests waiting for their pre-encoded features to download.",
    ),
    _gauge("tessera:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)."),
    _gauge(
        "tessera:encoder_cache_usage_perc",
        "Fraction of the encoder cache (--encoder-cache-tokens) that encoder outputs hold "
        "(0..1), those kept only for reuse included: they are evicted to make room.",
    ),
    _gauge(
        "tessera:kv_cache_capacity_tokens",
        "Tokens the KV cache holds (blocks x block size), sized at start-up.",
    ),
    _counter("tessera:num_preemptions_total", "Requests preempted (KV freed, recomputed later)."),
    # Tokens and finished requests.
    _counter(
        "tessera:prompt_tokens_total",
        "Prompt tokens processed (prefill), counted at each request's first token; "
        "with n > 1 once per choice.",
    ),
    _counter(
        "tessera:generation_tokens_total",
        "Tokens generated (decode), as the engine samples them: also those no client "
        "read (past a stop string, after the client left).",
    ),
    _counter(
        "tessera:request_success_total",
        "Requests finished, by finish reason (stop, length, abort).",
        "finished_reason",
    ),
    # Per-request latency histograms (seconds).
    _histogram(
        "tessera:time_to_first_token_seconds",
        "Time from the request's arrival at the HTTP server to its first generated token (media fetching and preprocessing included).",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:inter_token_latency_seconds",
        "Time between two consecutive generated tokens of one request.",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:e2e_request_latency_seconds",
        "Time from the request's arrival at the HTTP server to its last token.",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:request_queue_time_seconds",
        "Time a request waited before it was first scheduled.",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:request_prefill_time_seconds",
        "Time from first scheduling to the first token (prefill, all chunks).",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:request_decode_time_seconds",
        "Time from the first token to the last (decode).",
        LATENCY_BUCKETS,
    ),
    # Per-request and per-step sizes (tokens).
    _histogram(
        "tessera:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS
    ),
    _histogram(
        "tessera:request_generation_tokens",
        "Generated tokens of finished requests, as the engine made them (with n > 1 per "
        "choice): those no client read included, as in generation_tokens_total.",
        TOKEN_BUCKETS,
    ),
    _histogram("tessera:iteration_tokens", "Tokens scheduled in one engine step.", TOKEN_BUCKETS),
    _histogram(
        "tessera:engine_step_seconds",
        "Wall time of one engine step (a step launched ahead: from when the one before finished).",
        LATENCY_BUCKETS,
    ),
    # The API process(es): media preprocessing (before the engine sees the request), CPU.
    _counter(
        "tessera:api_server_cpu_seconds_total",
        "CPU time (user + system) of the API process(es): parsing requests, preprocessing "
        "media, detokenizing and streaming. A rate near --api-server-count means they bound "
        "time to first token.",
    ),
    _histogram(
        "tessera:media_preprocess_seconds",
        "Time to fetch, decode and preprocess one image_url or video_url part in the API "
        "process, by modality (image, video); repeats served from its cache included.",
        LATENCY_BUCKETS,
        "modality",
    ),
    # The API processes' cache of processed images (--image-cache-mb each).
    _counter(
        "tessera:image_cache_queries_total",
        "Processed-image cache lookups (image_url and video_url parts with bytes).",
    ),
    _counter("tessera:image_cache_hits_total", "Processed-image cache lookups that hit."),
    MetricSpec(
        "tessera:image_cache_bytes",
        "gauge",
        "Bytes of processed images and videos the API processes hold in their caches (up to "
        "--image-cache-mb each): it grows with new media until full, which is not a leak.",
        per_process=True,
    ),
    # Vision encoder and encoder cache.
    _histogram(
        "tessera:vision_encoder_seconds",
        "Wall time of one batched vision-encoder call.",
        LATENCY_BUCKETS,
    ),
    _counter("tessera:encoder_cache_queries_total", "Encoder-cache lookups (media items)."),
    _counter("tessera:encoder_cache_hits_total", "Encoder-cache lookups that hit."),
    _counter("tessera:vision_encoder_items_total", "Media items run through the vision encoder."),
    _counter("tessera:vision_encoder_batches_total", "Batched vision-encoder calls."),
    # Prefix cache (in tokens).
    _counter(
        "tessera:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache (none with `--no-enable-prefix-caching`, "
        "nor for a request with `prompt_logprobs`, which never reads it: as vLLM counts).",
    ),
    _counter("tessera:prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    # Pre-encoded feature fetching (S3 / HTTP).
    _histogram(
        "tessera:feature_fetch_seconds",
        "Time to fetch (download, or decode a data: URL) and validate one pre-encoded "
        "feature tensor.",
        LATENCY_BUCKETS,
    ),
    _counter(
        "tessera:feature_fetch_bytes_total",
        "Bytes of pre-encoded features fetched (data: URLs included, which the request carried).",
    ),
    _counter(
        "tessera:feature_fetch_failures_total",
        "Failed feature fetches, by reason (not_found, access_denied, timeout, server_error, "
        "network, bad_format, ...; `store_auth`: the S3 store refused the server's own "
        "credentials or it has none, and `store_region`: the bucket is in another region, the "
        "operator's to fix; `saturated`: no connection, or no room "
        "for its bytes, came free in time (--feature-fetch-max-connections, "
        "--feature-fetch-max-bytes-in-flight); `cancelled`: its request ended "
        "first, a client that left or another feature that failed, no fault of the store: "
        "leave it out of alerts).",
        "reason",
    ),
    _gauge(
        "tessera:feature_fetch_in_flight",
        "Feature downloads in progress, each holding a connection (one waiting for a "
        "connection, --feature-fetch-max-connections, is not counted).",
    ),
    _gauge(
        "tessera:feature_fetch_bytes_reserved",
        "Bytes of feature downloads held now, from the body's first byte until the file is "
        "checked (at most --feature-fetch-max-bytes-in-flight; near it, downloads wait).",
    ),
    # HTTP.
    _counter(
        "tessera:http_requests_total",
        "HTTP requests by route template (never the raw path) and status code; probes and "
        "scrapes (/health, /metrics, /version) are left out.",
        "route",
        "status",
    ),
    _counter(
        "tessera:stream_errors_total",
        "Streams that failed after their 200 (an error event ends them; http_requests_total "
        "counts them as 200s), by error code.",
        "code",
    ),
    _counter(
        "tessera:requests_rejected_total",
        "Requests refused with 503 before reaching the engine, by reason: server_overloaded "
        "(the request budget is full), feature_overloaded (the budget of requests "
        "downloading features), server_draining.",
        "reason",
    ),
)

METRICS_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}

# The values of a family's own label known before any event: each of these series is
# exported from start-up at 0, as every series with the model label alone is.
KNOWN_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "tessera:request_success_total": ("stop", "length", "abort"),
    "tessera:requests_rejected_total": (
        "server_overloaded",
        "feature_overloaded",
        "server_draining",
    ),
    "tessera:media_preprocess_seconds": ("image", "video"),
}

# Every sample name a PromQL query may reference.
SERIES_NAMES: frozenset[str] = frozenset(s for spec in METRICS for s in spec.series_names)


def markdown_table() -> str:
    """The metrics table of docs/deploy.md (a test keeps the checked-in copy in sync)."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        lines.append(f"| `{spec.name}` | {spec.type} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"
