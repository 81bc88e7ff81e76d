"""A reduced load soak (bench/load_soak.py) in CI: text, image and feature requests at
concurrency 16 against a KV pool small enough to force preemption; every response must equal
its concurrency-1 greedy reference, with no 5xx, KV usage back to zero and bounded RSS."""

from __future__ import annotations

import pytest

from bench.load_soak import SoakConfig, metric_value, process_tree_rss_kib, run_soak
from tests.e2e.conftest import run_server


@pytest.fixture(scope="module")
def small_kv_server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("logs") / "load_server.log"
    with run_server(
        model_dir, log_path, "--enable-feature-inputs",
        "--num-kv-blocks", "32", "--max-model-len", "512",
    ) as handle:  # fmt: skip
        yield handle


def test_soak_under_preemption_is_correct_and_leak_free(small_kv_server):
    config = SoakConfig(num_requests=60, concurrency=16, max_tokens=48, num_distinct=24)
    report = run_soak(small_kv_server.base_url, small_kv_server.process.pid, config)
    assert report.passed, f"{report.failures}\n{small_kv_server.log_tail()}"
    assert report.completed == 60
    assert report.num_5xx == 0
    assert report.preemptions > 0, "the KV pool was not small enough to force preemption"
    assert metric_value(small_kv_server.base_url, "tessera:num_preemptions_total") > 0
    assert report.kv_usage_end == 0
    assert 0 < report.rss_end_kib <= 1.2 * report.rss_warm_kib


def test_rss_counts_the_engine_child(small_kv_server):
    import os

    own = process_tree_rss_kib(os.getpid())
    assert own > 0
    assert process_tree_rss_kib(small_kv_server.process.pid) > 100_000  # server + engine
