"""Prometheus metrics of the server process, on a registry owned by one app.

The registry is built from `server.metric_names.METRICS` (the one list of names, types,
labels and buckets). Engine gauges and counters come from the EngineStats the engine sends
with every step (`EngineClient.add_stats_listener`), the prompt and generated token
counters among them (counted as the engine makes tokens, as vLLM counts); each engine
request's queue / prefill / decode phases and generated tokens from its last output
(`EngineClient.add_finish_listener`); and what a client saw of each choice (finish reason,
prompt size, TTFT, end-to-end latency, token gaps) when its request finishes. With n > 1 each
choice counts as one request, as vLLM's child requests do.

`tessera:http_requests_total` is labelled by the route TEMPLATE (`/v1/chat/completions`),
never the raw path, so a scan of random URLs cannot blow up the label set; /health,
/metrics and /version are not counted. The standard process and platform collectors
(`process_cpu_seconds_total`, `process_resident_memory_bytes`, `python_info`, ...) live on
the same registry.

With several API processes (server/api_servers.py) the launcher sets
PROMETHEUS_MULTIPROC_DIR before they start: prometheus_client then keeps each process's
values in files there, and whichever process answers /metrics reads all of them
(counters and histograms summed). Only API process 0 exports the engine's stats (it is the
one the engine sends every step to), so they are counted once, and its gauges are read
with the "mostrecent" mode. The process collectors are left out in that mode: they would
describe only the process that answered.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from engine.protocol import EngineStats, Ready, RequestOutput
from server.metric_names import KNOWN_LABEL_VALUES, METRICS, MODEL_LABEL, MULTIPROC_DIR_ENV

# No `_created` series: multiprocess mode (several API processes) never exports them, so a
# dashboard built on one process's would break when the process count changed.
prometheus_client.disable_created_metrics()

# With several API processes, the one answering a scrape cannot read the others' CPU: each
# counts its own this often.
API_CPU_COUNT_INTERVAL_S = 1.0
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}

# EngineStats delta fields -> counters, and gauge fields -> gauges.
_STATS_COUNTERS = {
    "num_preemptions_total": "tessera:num_preemptions_total",
    "encoder_cache_queries_total": "tessera:encoder_cache_queries_total",
    "encoder_cache_hits_total": "tessera:encoder_cache_hits_total",
    "vision_encoder_items_total": "tessera:vision_encoder_items_total",
    "vision_encoder_batches_total": "tessera:vision_encoder_batches_total",
    "prefix_cache_queries_total": "tessera:prefix_cache_queries_total",
    "prefix_cache_hits_total": "tessera:prefix_cache_hits_total",
    "feature_fetch_bytes_total": "tessera:feature_fetch_bytes_total",
    "prompt_tokens_total": "tessera:prompt_tokens_total",
    "prompt_tokens_cached_total": "tessera:prompt_tokens_cached_total",
    "generation_tokens_total": "tessera:generation_tokens_total",
}
# Probes and scrapes, not traffic: a Prometheus scrape and a liveness probe every few
# seconds outnumbered the API's requests on a quiet server (vLLM leaves them out too).
UNCOUNTED_ROUTES = frozenset({"/health", "/metrics", "/version"})
_STATS_GAUGES = {
    "num_running": "tessera:num_requests_running",
    "num_waiting": "tessera:num_requests_waiting",
    "num_fetching": "tessera:num_requests_fetching",
    "kv_cache_usage": "tessera:kv_cache_usage_perc",
    "encoder_cache_usage": "tessera:encoder_cache_usage_perc",
    "feature_fetch_in_flight": "tessera:feature_fetch_in_flight",
    "feature_fetch_bytes_reserved": "tessera:feature_fetch_bytes_reserved",
}


class ServerMetrics:
    """All metrics of one server app, keyed by their exported name.

    `exports_engine_stats` False: engine stats and start-up facts are ignored (an API
    process other than 0, see the module docstring)."""

    def __init__(self, model_name: str, *, exports_engine_stats: bool = True):
        self.registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV)
        if self.multiprocess_dir is None:
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                self.registry.register(collector)  # stateless readers of this process
        self.model_name = model_name
        self.exports_engine_stats = exports_engine_stats
        self._cpu_counted_s = 0.0  # this process's CPU time up to the last count
        self._metrics = {}
        for spec in METRICS:
            extra = {}
            if spec.type == "histogram":
                extra["buckets"] = spec.buckets
            elif spec.type == "gauge":  # engine gauges are set by one process
                extra["multiprocess_mode"] = "livesum" if spec.per_process else "mostrecent"
            self._metrics[spec.name] = _KINDS[spec.type](
                spec.client_name, spec.help, list(spec.labels), registry=self.registry, **extra
            )
        if exports_engine_stats:
            for name in _STATS_GAUGES.values():
                self._metrics[name].labels(model_name).set(0)
        # Counters and histograms start at 0, as vLLM's do: Prometheus takes a series' first
        # sample as its baseline, so the events that made a series appear were lost to
        # increase() and rate() (a fresh server's first burst of 503s raised no alert).
        for spec in METRICS:
            if (spec.type != "gauge" or spec.per_process) and spec.labels == (MODEL_LABEL,):
                self._labelled(spec.name)
            for value in KNOWN_LABEL_VALUES.get(spec.name, ()):
                self._labelled(spec.name, value)

    def _labelled(self, name: str, *labels: str):
        return self._metrics[name].labels(self.model_name, *labels)

    def on_engine_stats(self, stats: EngineStats) -> None:
        if not self.exports_engine_stats:
            return
        for field, name in _STATS_GAUGES.items():
            self._labelled(name).set(getattr(stats, field))
        for field, name in _STATS_COUNTERS.items():
            value = getattr(stats, field)
            if value:
                self._labelled(name).inc(value)
        if stats.num_scheduled_tokens:
            self._labelled("tessera:iteration_tokens").observe(stats.num_scheduled_tokens)
        if stats.step_seconds:
            self._labelled("tessera:engine_step_seconds").observe(stats.step_seconds)
        if stats.vision_encoder_seconds:
            self._labelled("tessera:vision_encoder_seconds").observe(stats.vision_encoder_seconds)
        for seconds in stats.feature_fetch_seconds:
            self._labelled("tessera:feature_fetch_seconds").observe(seconds)
        for reason, count in stats.feature_fetch_failures.items():
            self._labelled("tessera:feature_fetch_failures_total", reason).inc(count)

    def on_engine_ready(self, ready: Ready) -> None:
        """Facts fixed at start-up (the KV cache's size: on a GPU it depends on the memory
        the weights and the largest step left, engine/kv_cache_sizing.py)."""
        if not self.exports_engine_stats:
            return
        capacity = ready.num_kv_blocks * ready.block_size
        self._labelled("tessera:kv_cache_capacity_tokens").set(capacity)

    def on_media_preprocessed(self, modality: str, seconds: float) -> None:
        """One image_url / video_url part fetched, decoded and preprocessed."""
        self._labelled("tessera:media_preprocess_seconds", modality).observe(seconds)

    def on_image_cache_lookup(self, hit: bool) -> None:
        self._labelled("tessera:image_cache_queries_total").inc()
        if hit:
            self._labelled("tessera:image_cache_hits_total").inc()

    def on_image_cache_resize(self, cached_bytes: int) -> None:
        self._labelled("tessera:image_cache_bytes").set(cached_bytes)

    def on_http_request(self, route: str, status: int) -> None:
        if route not in UNCOUNTED_ROUTES:
            self._labelled("tessera:http_requests_total", route, str(status)).inc()

    def on_stream_error(self, code: str) -> None:
        """A stream that failed after its 200; `code` is an error code of ours."""
        self._labelled("tessera:stream_errors_total", code).inc()

    def on_request_rejected(self, reason: str) -> None:
        """A 503 before the engine; `reason` is an error code of ours, never request data."""
        self._labelled("tessera:requests_rejected_total", reason).inc()

    def on_choice_finished(
        self,
        *,
        finish_reason: str,
        num_prompt_tokens: int,
        ttft_s: float | None,
        latency_s: float,
    ) -> None:
        """One choice of a request (vLLM's unit: a child request of n > 1), as the client
        saw it: its finish reason, sizes, and latencies from the request's arrival."""
        self._labelled("tessera:request_success_total", finish_reason).inc()
        self._labelled("tessera:request_prompt_tokens").observe(num_prompt_tokens)
        if ttft_s is not None:
            self._labelled("tessera:time_to_first_token_seconds").observe(ttft_s)
        self._labelled("tessera:e2e_request_latency_seconds").observe(latency_s)

    def on_token_gaps(self, seconds: Iterable[float]) -> None:
        histogram = self._labelled("tessera:inter_token_latency_seconds")
        for value in seconds:
            histogram.observe(value)

    def on_engine_request_finished(self, output: RequestOutput) -> None:
        """The engine-side phases of a finished engine request (one choice), from its last
        output, which arrives whether or not the server still listens (a stop string, a
        client that left), and the tokens it generated in all: a non-streamed request
        whose client left had most of them unread in its collector, and counted 1 when
        the server counted what the client got (fuzz48). A phase it never reached is left
        out, and so is a request that failed (`num_output_tokens` None), as in every other
        per-request metric (fuzz106: its phases were counted)."""
        generated, prefill, decode = (
            output.num_output_tokens,
            output.prefill_seconds,
            output.decode_seconds,
        )
        if generated is None:
            return
        self._labelled("tessera:request_generation_tokens").observe(generated)
        inference = None if prefill is None or decode is None else prefill + decode
        per_token = decode / (generated - 1) if decode is not None and generated > 1 else None
        for name, value in (
            ("tessera:request_queue_time_seconds", output.queued_seconds),
            ("tessera:request_prefill_time_seconds", prefill),
            ("tessera:request_decode_time_seconds", decode),
            ("tessera:request_inference_time_seconds", inference),
            ("tessera:request_time_per_output_token_seconds", per_token),
        ):
            if value is not None:
                self._labelled(name).observe(value)

    def count_api_cpu(self) -> None:
        """Add this process's CPU time since the last call to
        `tessera:api_server_cpu_seconds_total` (the app calls it every
        API_CPU_COUNT_INTERVAL_S, and each scrape it answers does). Event loop only."""
        now = time.process_time()  # user + system, every thread of this process
        self._labelled("tessera:api_server_cpu_seconds_total").inc(now - self._cpu_counted_s)
        self._cpu_counted_s = now

    def render(self) -> tuple[bytes, str]:
        self.count_api_cpu()
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry), CONTENT_TYPE_LATEST
