"""Every metric of server/metric_names.py moves on a real server when it should.

Moved here: the per-request counters and histograms (tokens, finish reasons, TTFT, ITL,
e2e, queue / prefill / decode time), the per-step histograms, the vision-encoder time, the
scheduler gauges and preemptions (on a server with a tiny KV cache), and the standard
process metrics. Elsewhere: the encoder/prefix cache counters (test_multimodal_metrics),
the feature_fetch_* family (test_features), http_requests_total (test_chat_api),
requests_rejected_total (test_security).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.local_inputs import picture, png_bytes
from bench.servers import cpu_seconds
from tests.e2e.conftest import MODEL_NAME, run_server

Samples = dict[str, float]  # sample name -> value summed over label sets


def scrape(http: httpx.Client) -> tuple[Samples, dict[str, dict[str, float]]]:
    """/metrics as {sample name: total} and {sample name: {finished_reason: value}}."""
    totals: Samples = defaultdict(float)
    by_reason: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            totals[sample.name] += sample.value
            if "finished_reason" in sample.labels:
                by_reason[sample.name][sample.labels["finished_reason"]] = sample.value
    return totals, by_reason


def wait_for(http, predicate, timeout_s: float = 10.0):
    """Scrape until `predicate(samples, by_reason)` holds (engine stats arrive per step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples, by_reason = scrape(http)
        if predicate(samples, by_reason) or time.monotonic() > deadline:
            return samples, by_reason
        time.sleep(0.05)


def completion(http, max_tokens: int, prompt: str = "count the tiles of the floor") -> dict:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def streamed_chat(http, max_tokens: int) -> dict:
    body = {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "name three colours"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


def test_request_counters_and_latency_histograms_move(http):
    before, reasons_before = scrape(http)
    usages = [completion(http, max_tokens=5), streamed_chat(http, max_tokens=4)]
    num_prompt = sum(u["prompt_tokens"] for u in usages)
    num_generated = sum(u["completion_tokens"] for u in usages)
    assert num_generated == 9

    def done(samples, _):
        return samples["tessera:request_decode_time_seconds_count"] >= (
            before["tessera:request_decode_time_seconds_count"] + 2
        )

    after, reasons_after = wait_for(http, done)

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("tessera:prompt_tokens_total") == num_prompt
    assert moved("tessera:generation_tokens_total") == num_generated
    length = "tessera:request_success_total"
    assert reasons_after[length]["length"] - reasons_before[length].get("length", 0) == 2
    for histogram in (
        "tessera:time_to_first_token_seconds",
        "tessera:e2e_request_latency_seconds",
        "tessera:request_queue_time_seconds",
        "tessera:request_prefill_time_seconds",
        "tessera:request_decode_time_seconds",
        "tessera:request_prompt_tokens",
        "tessera:request_generation_tokens",
    ):
        assert moved(f"{histogram}_count") == 2, histogram
    assert moved("tessera:request_prompt_tokens_sum") == num_prompt
    assert moved("tessera:request_generation_tokens_sum") == num_generated
    # one gap per token after the first of each request
    assert moved("tessera:inter_token_latency_seconds_count") == (5 - 1) + (4 - 1)
    # Gaps inside one output are 0 (tokens the server read together), so a fast tiny model
    # whose tokens all arrive in one output each leaves a sum of 0: only its bounds hold.
    gaps = moved("tessera:inter_token_latency_seconds_sum")
    assert 0 <= gaps <= moved("tessera:e2e_request_latency_seconds_sum")
    assert moved("tessera:request_prefill_time_seconds_sum") > 0
    assert moved("tessera:request_decode_time_seconds_sum") > 0
    # the decode phase fits inside the end-to-end latency the server measured
    assert moved("tessera:request_decode_time_seconds_sum") < moved(
        "tessera:e2e_request_latency_seconds_sum"
    )
    # every decode token went through a step (prefills may be partly prefix-cache hits)
    assert moved("tessera:iteration_tokens_sum") >= num_generated - 2 + 2
    assert moved("tessera:engine_step_seconds_count") >= 1 + 4


def test_requests_the_client_leaves_count_as_aborted(http, server):
    """A stream closed midway and a non-streamed request whose client gave up: each
    counts in request_success_total{finished_reason="abort"}, its prompt and the tokens it
    got so far in the token counters, and its latency (they counted nowhere before)."""
    before, reasons_before = scrape(http)
    body = {"model": MODEL_NAME, "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "count forever"}]}  # fmt: skip
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 6:
                break  # closing the response hangs up mid-stream
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=1.0)
    abort = "tessera:request_success_total"

    def counted(_, by_reason):
        return by_reason[abort].get("abort", 0) - reasons_before[abort].get("abort", 0) >= 2

    after, reasons_after = wait_for(http, counted, timeout_s=30)
    assert reasons_after[abort].get("abort", 0) - reasons_before[abort].get("abort", 0) == 2
    generated = after["tessera:generation_tokens_total"] - before["tessera:generation_tokens_total"]
    assert generated >= 5  # the stream's tokens at least
    assert after["tessera:prompt_tokens_total"] > before["tessera:prompt_tokens_total"]
    latency = "tessera:e2e_request_latency_seconds_count"
    assert after[latency] - before[latency] == 2
    # The engine's phases of both: it reports them on its abort output, which reached no
    # one once the server had stopped listening (count +0 for a request left queued).
    settled = wait_for(http, lambda s, _: s["tessera:request_queue_time_seconds_count"]
                       - before["tessera:request_queue_time_seconds_count"] >= 2)[0]  # fmt: skip
    assert settled["tessera:request_queue_time_seconds_count"] - before[
        "tessera:request_queue_time_seconds_count"] == 2  # fmt: skip
    # Counted as the engine generates them: the non-streamed request's backlog, which no
    # one read, counted +0 (a second of the tiny model is hundreds of tokens).
    generated = settled["tessera:generation_tokens_total"] - before["tessera:generation_tokens_total"]
    assert generated >= 6 + 20
    # Each request's generated tokens are the engine's too: the non-streamed one's unread
    # backlog counted 1 (the first output, all its client got) before (fuzz48).
    sizes = "tessera:request_generation_tokens_sum"

    def agree(samples, _):
        return samples[sizes] - before[sizes] == (
            samples["tessera:generation_tokens_total"] - before["tessera:generation_tokens_total"])

    final, _ = wait_for(http, agree)
    assert agree(final, None), (final[sizes] - before[sizes], final["tessera:generation_tokens_total"]
                                - before["tessera:generation_tokens_total"])  # fmt: skip


def test_a_client_that_hangs_up_while_uploading_counts_as_499(http, server):
    """FastAPI made a failure to read the body a 400, so a client that left mid-upload
    was counted as a bad request."""
    import socket

    def chat_counts() -> dict[str, float]:
        counts: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                if (sample.name == "tessera:http_requests_total"
                        and sample.labels["route"] == "/v1/chat/completions"):  # fmt: skip
                    counts[sample.labels["status"]] += sample.value
        return counts

    before = chat_counts()
    host, port = server.base_url.removeprefix("http://").split(":")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 4000000\r\n\r\n")  # fmt: skip
    for _ in range(2):
        with socket.create_connection((host, int(port))) as hanging_up:
            hanging_up.sendall(head + b'{"model": "' + b"a" * 200_000)
            time.sleep(0.2)
    deadline = time.monotonic() + 10
    while chat_counts()["499"] - before["499"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = chat_counts()
    assert (after["499"] - before["499"], after["400"] - before["400"]) == (2, 0)


def test_every_choice_counts_once_in_every_per_request_metric(http):
    """vLLM's unit for n > 1 is the choice (a child request). Before, success and phases
    counted per choice but latencies and sizes per HTTP request, with the choices' tokens
    added together (one 15-token request for three 5-token choices)."""
    before, _ = scrape(http)
    body = {"model": MODEL_NAME, "prompt": "count the tiles", "max_tokens": 5, "n": 3,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    after, _ = wait_for(http, lambda s, _: s["tessera:request_decode_time_seconds_count"]
                        - before["tessera:request_decode_time_seconds_count"] >= 3)  # fmt: skip

    def moved(name: str) -> float:
        return after[name] - before[name]

    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_prompt_tokens", "request_generation_tokens",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds"):  # fmt: skip
        assert moved(f"tessera:{histogram}_count") == 3, histogram
    assert moved("tessera:request_generation_tokens_sum") == 15
    assert moved("tessera:request_prompt_tokens_sum") == 3 * prompt_tokens
    assert moved("tessera:request_success_total") == 3
    assert moved("tessera:inter_token_latency_seconds_count") == 3 * (5 - 1)
    assert moved("tessera:generation_tokens_total") == 15


def test_a_request_a_stop_string_ends_has_its_engine_phases(http):
    """The server aborts a choice its stop string ends; the engine's last output, with the
    phases, came after the server had stopped listening: counted nowhere."""
    text = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "count the tiles",
                     "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}).json()  # fmt: skip
    stop = text["choices"][0]["text"][4:7]
    before, _ = scrape(http)
    body = {"model": MODEL_NAME, "prompt": "count the tiles", "max_tokens": 12, "stop": [stop],
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    assert http.post("/v1/completions", json=body).json()["choices"][0]["finish_reason"] == "stop"
    after, _ = wait_for(http, lambda s, _: s["tessera:request_decode_time_seconds_count"]
                        > before["tessera:request_decode_time_seconds_count"])  # fmt: skip
    for phase in ("queue", "prefill", "decode"):
        name = f"tessera:request_{phase}_time_seconds_count"
        assert after[name] - before[name] == 1, phase


def test_vision_encoder_time_moves(http):
    before, _ = scrape(http)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(90, 60, 211))).decode()
    content = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is it"},
    ]
    body = {
        "model": MODEL_NAME,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    name = "tessera:vision_encoder_seconds_count"
    after, _ = wait_for(http, lambda samples, _: samples[name] > before[name])
    assert after[name] - before[name] == 1
    assert (
        after["tessera:vision_encoder_seconds_sum"] > before["tessera:vision_encoder_seconds_sum"]
    )


IMAGE_DELAY_S = 0.6


class _SlowImageHandler(BaseHTTPRequestHandler):
    """Serves one PNG after IMAGE_DELAY_S, like a slow image host."""

    def do_GET(self) -> None:
        time.sleep(IMAGE_DELAY_S)
        body = png_bytes(picture(64, 48, 5))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def slow_image_url():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SlowImageHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/slow.png"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_latencies_count_from_arrival_including_media_fetching(http, slow_image_url, stream):
    """TTFT and e2e latency start when the request reaches the HTTP server, so the API
    process's own work (here an image that takes IMAGE_DELAY_S to fetch) is in them, as a
    client sees it. They used to start after the prompt was ready, media included."""
    before, _ = scrape(http)
    content = [
        {"type": "image_url", "image_url": {"url": slow_image_url}},
        {"type": "text", "text": "what is it"},
    ]
    body = {"model": MODEL_NAME, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip
    sent = time.monotonic()
    response = http.post("/v1/chat/completions", json=body)
    seen_by_client = time.monotonic() - sent
    assert response.status_code == 200, response.text
    name = "tessera:e2e_request_latency_seconds_count"
    after, _ = wait_for(http, lambda samples, _: samples[name] > before[name])
    for histogram in ("tessera:time_to_first_token_seconds", "tessera:e2e_request_latency_seconds"):
        assert after[f"{histogram}_count"] - before[f"{histogram}_count"] == 1
        moved = after[f"{histogram}_sum"] - before[f"{histogram}_sum"]
        assert IMAGE_DELAY_S <= moved <= seen_by_client, histogram


def test_process_metrics_are_exported(http):
    samples, _ = scrape(http)
    assert samples["process_cpu_seconds_total"] > 0
    assert samples["process_resident_memory_bytes"] > 1e6
    assert samples["python_info"] == 1


def test_no_created_series_that_only_one_api_process_would_export(http):
    """prometheus_client adds a `_created` gauge per counter and histogram, but not in
    multiprocess mode: a rule on them broke when `--api-server-count` changed (vLLM
    turns them off too)."""
    text = http.get("/metrics").text
    assert "tessera:request_success_total" in text and "_created" not in text


def test_api_server_cpu_tracks_the_process(http, server):
    """tessera:api_server_cpu_seconds_total counts the API process's CPU as /proc does."""
    name = "tessera:api_server_cpu_seconds_total"
    completion(http, max_tokens=8)
    samples, _ = scrape(http)
    proc = cpu_seconds(server.process.pid)
    # /proc counts in 10 ms ticks; the scrape itself costs a little
    assert 0 < samples[name] <= proc + 0.05
    assert samples[name] > proc - 0.5


@pytest.fixture(scope="module")
def small_kv_server(model_dir, tmp_path_factory):
    """6 KV blocks of 16 tokens and 2 running sequences: requests queue and get preempted."""
    log_path = tmp_path_factory.mktemp("logs") / "small_kv_server.log"
    extra = ("--num-kv-blocks", "6", "--max-model-len", "96", "--max-num-seqs", "2")
    with run_server(model_dir, log_path, *extra) as handle:
        with httpx.Client(base_url=handle.base_url, timeout=120) as session:
            yield session


def test_scheduler_gauges_and_preemptions_move(small_kv_server):
    http = small_kv_server
    before, _ = scrape(http)
    assert before["tessera:kv_cache_capacity_tokens"] == 6 * 16  # --num-kv-blocks 6
    peaks: dict[str, float] = defaultdict(float)
    gauges = (
        "tessera:num_requests_running",
        "tessera:num_requests_waiting",
        "tessera:kv_cache_usage_perc",
    )
    stop = threading.Event()

    def watch() -> None:
        # The gauges alone, read with a regex: the two-running phase lasts ~0.4 s, and a
        # full parse of /metrics on a loaded CI machine sampled too slowly to see it.
        pattern = re.compile(rf"^({'|'.join(gauges)}){{[^}}]*}} (\S+)$", re.M)
        with httpx.Client(base_url=str(http.base_url), timeout=10) as watcher:
            while not stop.is_set():
                for name, value in pattern.findall(watcher.get("/metrics").text):
                    peaks[name] = max(peaks[name], float(value))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(12) as pool:  # long enough for a loaded machine to sample
            prompts = [f"request number {i} says hello" for i in range(12)]
            usages = list(pool.map(lambda p: completion(http, 70, prompt=p), prompts))
    finally:
        stop.set()
        watcher.join(timeout=20)
    assert all(u["completion_tokens"] == 70 for u in usages)
    assert peaks["tessera:num_requests_running"] == 2
    assert peaks["tessera:num_requests_waiting"] >= 1
    assert 0 < peaks["tessera:kv_cache_usage_perc"] <= 1
    after, _ = scrape(http)
    assert after["tessera:num_preemptions_total"] > before["tessera:num_preemptions_total"]
    assert after["tessera:request_queue_time_seconds_sum"] > 0
    # idle again: the gauges come back down
    idle, _ = wait_for(http, lambda samples, _: samples["tessera:num_requests_running"] == 0)
    assert idle["tessera:num_requests_waiting"] == 0


def test_an_inherited_multiprocess_dir_is_ignored_by_one_api_process(
    model_dir, tmp_path, monkeypatch
):
    """PROMETHEUS_MULTIPROC_DIR left in the environment (images built for gunicorn set it)
    switched a single-process server to prometheus_client's files: the process metrics
    vanished, and an earlier run's files were summed into its counters."""
    inherited = tmp_path / "multiproc"
    inherited.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(inherited))
    with run_server(model_dir, tmp_path / "server.log") as handle:
        with httpx.Client(base_url=handle.base_url, timeout=60) as http:
            completion(http, max_tokens=2)
            samples, _ = scrape(http)
    assert samples["process_resident_memory_bytes"] > 0
    assert samples["tessera:request_success_total"] == 1
    assert list(inherited.iterdir()) == []
    assert "PROMETHEUS_MULTIPROC_DIR" in (tmp_path / "server.log").read_text()
