"""A real Prometheus (Debian's `prometheus` package) scrapes a running Tessera every second;
what it stores matches what was sent: the target is up, and prompt tokens, generated tokens
and the TTFT count moved by exactly the requests of this test.

Prometheus listens on 127.0.0.1 only, keeps its data in a tmp dir and is killed at teardown.
Without the binary the test skips, except in CI (`CI` set), where it fails: .ci/run
installs the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import free_port
from tests.e2e.conftest import MODEL_NAME

DEADLINE_S = 60.0
NUM_REQUESTS = 3
COUNTERS = (
    "tessera:prompt_tokens_total",
    "tessera:generation_tokens_total",
    "tessera:time_to_first_token_seconds_count",
)


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        reason = "the prometheus binary is not installed (apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; .ci/run should have installed it")
        pytest.skip(reason)
    return binary


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory) -> Iterator[str]:
    """Prometheus scraping the shared server every second; yields its base URL."""
    binary = prometheus_binary()
    root = tmp_path_factory.mktemp("prometheus")
    target = urlsplit(server.base_url).netloc
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tessera\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log = open(root / "prometheus.log", "wb")  # noqa: SIM115 - closed at teardown
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=root,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base_url, process, root / "prometheus.log")
        yield base_url
    finally:
        process.kill()
        process.wait(timeout=10)
        log.close()


def _wait_ready(base_url: str, process: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"prometheus exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(base_url + "/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"prometheus not ready:\n{log_path.read_text(errors='replace')[-3000:]}")


def query(base_url: str, promql: str) -> float | None:
    """The single value of an instant query, or None while there is no sample."""
    response = httpx.get(base_url + "/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    results = body["data"]["result"]
    return float(results[0]["value"][1]) if results else None


def poll(base_url: str, promql: str, expected: float) -> float | None:
    """Query until the value equals `expected` or the deadline passes; the last value."""
    deadline = time.monotonic() + DEADLINE_S
    value = None
    while time.monotonic() < deadline:
        value = query(base_url, promql)
        if value == expected:
            return value
        time.sleep(0.5)
    return value


def served_totals(http: httpx.Client) -> dict[str, float]:
    values = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values


def test_prometheus_scrapes_what_was_sent(prometheus, http):
    assert poll(prometheus, 'up{job="tessera"}', 1.0) == 1.0, "the target never came up"
    before = served_totals(http)  # other tests of this session used the same server
    num_prompt = num_generated = 0
    for i in range(NUM_REQUESTS):
        body = {
            "model": MODEL_NAME,
            "prompt": f"prometheus request {i}",
            "max_tokens": 3 + i,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        num_prompt += response.json()["usage"]["prompt_tokens"]
        num_generated += response.json()["usage"]["completion_tokens"]
    assert num_generated == 3 + 4 + 5
    expected = {
        "tessera:prompt_tokens_total": before["tessera:prompt_tokens_total"] + num_prompt,
        "tessera:generation_tokens_total": (
            before["tessera:generation_tokens_total"] + num_generated
        ),
        "tessera:time_to_first_token_seconds_count": (
            before["tessera:time_to_first_token_seconds_count"] + NUM_REQUESTS
        ),
    }
    for name, value in expected.items():
        promql = f'sum({name}{{job="tessera",model_name="{MODEL_NAME}"}})'
        assert poll(prometheus, promql, value) == value, name
    assert query(prometheus, 'up{job="tessera"}') == 1.0
