"""Each event of server/metrics.py reaching its series (mutation testing found most of them
untested beyond their zero values)."""

from __future__ import annotations

import pytest

from engine.protocol import EngineStats
from server.metric_names import MODEL_LABEL
from server.metrics import ServerMetrics
from tests.unit.test_server_metrics import _samples

MODEL = ((MODEL_LABEL, "m"),)


def test_engine_gauges_and_per_process_gauges_start_at_zero():
    # a dashboard reads 0, not "no data", before the first step
    samples = _samples(ServerMetrics("m"))
    for name in (
        "tessera:num_requests_running",
        "tessera:num_requests_waiting",
        "tessera:kv_cache_usage_perc",
        "tessera:image_cache_bytes",
    ):
        assert samples[(name, MODEL)] == 0, name


def test_engine_stats_reach_their_series():
    # each EngineStats field lands in its metric
    metrics = ServerMetrics("m")
    metrics.on_engine_stats(
        EngineStats(
            num_running=2,
            num_waiting=3,
            prompt_tokens_total=7,
            prompt_tokens_cached_total=4,
            generation_tokens_total=5,
            num_scheduled_tokens=9,
            feature_fetch_failures={"timeout": 2},
        )
    )
    samples = _samples(metrics)
    assert samples[("tessera:num_requests_running", MODEL)] == 2
    assert samples[("tessera:num_requests_waiting", MODEL)] == 3
    assert samples[("tessera:prompt_tokens_total", MODEL)] == 7
    assert samples[("tessera:prompt_tokens_cached_total", MODEL)] == 4
    assert samples[("tessera:generation_tokens_total", MODEL)] == 5
    assert samples[("tessera:iteration_tokens_count", MODEL)] == 1
    assert samples[("tessera:iteration_tokens_sum", MODEL)] == 9
    key = tuple(sorted(MODEL + (("reason", "timeout"),)))
    assert samples[("tessera:feature_fetch_failures_total", key)] == 2


def test_an_api_process_other_than_0_exports_no_engine_stats():
    # engine stats counted once, by process 0
    metrics = ServerMetrics("m", exports_engine_stats=False)
    metrics.on_engine_stats(EngineStats(num_running=2, prompt_tokens_total=7))
    samples = _samples(metrics)
    assert samples.get(("tessera:num_requests_running", MODEL), 0) == 0
    assert samples[("tessera:prompt_tokens_total", MODEL)] == 0


def test_choice_and_cache_events_reach_their_series():
    # a miss is no hit, no TTFT for a choice without tokens, engine-side phases
    metrics = ServerMetrics("m")
    metrics.on_image_cache_lookup(False)
    metrics.on_image_cache_lookup(True)
    metrics.on_choice_finished(
        finish_reason="length", num_prompt_tokens=3, ttft_s=None, latency_s=0.5
    )
    from engine.protocol import RequestOutput

    output = RequestOutput(request_id="r", num_output_tokens=4, queued_seconds=0.1,
                           prefill_seconds=0.2, decode_seconds=0.3)  # fmt: skip
    metrics.on_engine_request_finished(output)
    one_token = RequestOutput(request_id="s", num_output_tokens=1, prefill_seconds=0.2,
                              decode_seconds=0.0)  # fmt: skip
    metrics.on_engine_request_finished(one_token)
    # a failed request counts in no per-request metric, its phases too (fuzz106)
    failed = RequestOutput(request_id="f", finish_reason="error", queued_seconds=9.0,
                           prefill_seconds=9.0, decode_seconds=9.0)  # fmt: skip
    metrics.on_engine_request_finished(failed)
    samples = _samples(metrics)
    assert samples[("tessera:image_cache_queries_total", MODEL)] == 2
    assert samples[("tessera:image_cache_hits_total", MODEL)] == 1
    assert samples[("tessera:time_to_first_token_seconds_count", MODEL)] == 0
    assert samples[("tessera:e2e_request_latency_seconds_count", MODEL)] == 1
    assert samples[("tessera:request_generation_tokens_sum", MODEL)] == 4 + 1
    assert samples[("tessera:request_decode_time_seconds_sum", MODEL)] == 0.3
    # vLLM's per-request families (fuzz105: a dashboard ported from vLLM found none)
    assert samples[("tessera:request_inference_time_seconds_sum", MODEL)] == pytest.approx(0.7)
    assert samples[("tessera:request_time_per_output_token_seconds_count", MODEL)] == 1
    assert samples[("tessera:request_time_per_output_token_seconds_sum", MODEL)] == (
        pytest.approx(0.1)
    )
    assert samples[("tessera:request_queue_time_seconds_count", MODEL)] == 1


def test_api_cpu_is_counted_once():
    # each call adds only the CPU time since the last one
    import time

    metrics = ServerMetrics("m")
    metrics.count_api_cpu()
    metrics.count_api_cpu()
    total = _samples(metrics)[("tessera:api_server_cpu_seconds_total", MODEL)]
    assert total <= time.process_time() + 1e-6
