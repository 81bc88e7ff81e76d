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
# Seconds, for latencies from ~1 ms (one decode step on a GPU) to hours (batch requests):
# Tessera's own boundaries and every one of vLLM's latency histograms (time to first token,
# inter-token, request phases), so that an alert ported from vLLM on `le="0.25"` or
# `le="60"` finds its series (fuzz105: they matched none, and 160 s was the last bucket).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.025, 0.04, 0.05, 0.06, 0.075, 0.08, 0.1, 0.15, 0.2,
    0.25, 0.3, 0.4, 0.5, 0.75, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 80.0, 120.0, 160.0, 240.0, 480.0, 640.0, 960.0, 1920.0, 2560.0,
    7680.0,
)
# Token counts per request or per engine step: powers of two and vLLM's 1-2-5 series.
TOKEN_BUCKETS: tuple[float, ...] = (
    1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024, 2000,
    2048, 4096, 5000, 8192, 10000, 16384, 20000, 32768, 50000, 65536, 100000, 131072,
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
        "tessera:prompt_tokens_cached_total",
        "Of prompt_tokens_total, those the prefix cache served: counted with them, at each "
        "request's first token.",
    ),
    _counter(
        "tessera:request_success_total",
        "Requests finished, by finish reason (stop, length, abort). Unlike vLLM 0.32, a "
        "stream or request the client left counts as abort, here and in the per-request "
        "histograms; a stream that failed after its 200 counts in stream_errors_total.",
        "finished_reason",
    ),
    # Per-request latency histograms (seconds).
    _histogram(
        "tessera:time_to_first_token_seconds",
        "Time from the request's arrival at the HTTP server until its first generated token reaches the answer (media fetching and preprocessing included); a choice aborted before that has no sample.",
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
    _histogram(
        "tessera:request_inference_time_seconds",
        "Time from first scheduling to the last token (prefill and decode).",
        LATENCY_BUCKETS,
    ),
    _histogram(
        "tessera:request_time_per_output_token_seconds",
        "A finished request's decode time over its generated tokens after the first (its "
        "mean inter-token time; requests of one token are left out).",
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

# vLLM 0.32's metric families that Tessera names otherwise or lacks: what a dashboard ported
# from vLLM by renaming `vllm:` to `tessera:` must change (fuzz105). Every other vLLM family
# has a `tessera:` one of the same name, type and meaning (tests/unit/test_deploy_manifests.py).
VLLM_COUNTERPARTS: dict[str, str] = {
    "vllm:iteration_tokens_total": "`tessera:iteration_tokens` (a histogram in both)",
    "vllm:mm_cache_queries_total": "`tessera:image_cache_queries_total` (the API processes' "
    "processed-media cache); `tessera:encoder_cache_queries_total` for encoder outputs",
    "vllm:mm_cache_hits_total": "`tessera:image_cache_hits_total`; "
    "`tessera:encoder_cache_hits_total`",
    "vllm:admission_rejections_total": "`tessera:requests_rejected_total` (by reason)",
    "vllm:cache_config_info": "`tessera:kv_cache_capacity_tokens`; the start-up log has the rest",
    "vllm:num_requests_waiting_by_reason": "`tessera:num_requests_waiting`; "
    "`tessera:num_requests_fetching` for requests downloading features",
    "vllm:prompt_tokens_by_source_total": "`tessera:prompt_tokens_total` and "
    "`tessera:prompt_tokens_cached_total`",
    "vllm:request_prefill_kv_computed_tokens": "none: `tessera:prompt_tokens_total` minus "
    "`tessera:prompt_tokens_cached_total` counts the same tokens in all",
    "vllm:request_max_num_generation_tokens": "`tessera:request_generation_tokens` (each "
    "choice of n > 1 counts as a request)",
    "vllm:request_num_preemptions": "none: `tessera:num_preemptions_total`",
    "vllm:request_params_n": "none",
    "vllm:request_params_max_tokens": "none",
    "vllm:engine_sleep_state": "none: Tessera has no sleep mode",
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


def vllm_porting_table() -> str:
    """docs/deploy.md's table of the vLLM families a ported dashboard must rename."""
    lines = ["| vLLM 0.32 | Tessera |", "|---|---|"]
    lines += [f"| `{name}` | {where} |" for name, where in VLLM_COUNTERPARTS.items()]
    return "\n".join(lines) + "\n"
