"""`tessera serve --api-server-count 2`: a launcher, one engine and two API processes on
one port (server/api_servers.py), against the real server.

Checked: each request gets its own answer (the same as a one-process server gives), both
processes serve, /metrics sums both and exports the engine's stats once, SIGTERM drains
and exits 0, and an engine that cannot start or a dead engine or API process stops the
whole server with exit code 1 and leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.servers import (
    cpu_seconds,
    free_port,
    process_name,
    repo_pythonpath,
    server_processes,
)
from tests.e2e.conftest import (
    MODEL_NAME,
    ServerHandle,
    run_server,
    stream_in_background,
    wait_all_gone,
)

API_SERVERS = ("--api-server-count", "2")


def _pids(log_path: Path) -> tuple[int, list[int]]:
    """(engine pid, API process pids) from the launcher's log (they may have exited)."""
    text = log_path.read_text()
    engine = int(re.search(r"engine process (\d+) starting", text).group(1))
    api = [int(pid) for pid in re.findall(r"API process (\d+) \(index \d\) starting", text)]
    assert len(api) == 2, text[-3000:]
    return engine, api


def _serving_processes(log_path: Path) -> set[str]:
    """The API processes that logged a chat completion."""
    return set(
        re.findall(r"(tessera-api-\d) tessera\.request: .*route=/v1/chat", log_path.read_text())
    )


def _chat(base_url: str, prompt: str, **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "temperature": 0, **fields}  # fmt: skip
    return httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)


def _streamed_text(base_url: str, prompt: str) -> str:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "temperature": 0, "stream": True}  # fmt: skip
    text = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def _samples(base_url: str) -> dict[tuple[str, tuple], float]:
    found = {}
    text = httpx.get(base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.fixture(scope="module")
def two_api_servers(model_dir, tmp_path_factory) -> Iterator[ServerHandle]:
    log_path = tmp_path_factory.mktemp("logs") / "api_servers.log"
    with run_server(model_dir, log_path, *API_SERVERS) as handle:
        yield handle


def test_every_request_gets_its_own_answer_from_both_processes(two_api_servers, server):
    prompts = [f"tell me about tile number {i}" for i in range(24)]
    expected = {
        p: _chat(server.base_url, p).json()["choices"][0]["message"]["content"] for p in prompts
    }

    def ask(i_prompt):
        i, prompt = i_prompt
        if i % 2:
            return prompt, _streamed_text(two_api_servers.base_url, prompt)
        response = _chat(two_api_servers.base_url, prompt)
        assert response.status_code == 200, response.text
        return prompt, response.json()["choices"][0]["message"]["content"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = dict(pool.map(ask, enumerate(prompts)))
    assert answers == expected  # no output went to another request, or was lost
    # The kernel picks the process for each connection: ask until both have served.
    for _ in range(25):
        if len(_serving_processes(two_api_servers.log_path)) == 2:
            break
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda j: _chat(two_api_servers.base_url, f"more {j}", max_tokens=1), range(8)
                )
            )
    assert _serving_processes(two_api_servers.log_path) == {"tessera-api-0", "tessera-api-1"}


def test_processes_are_named_for_ps_and_top(two_api_servers):
    engine, api = server_processes(two_api_servers.process.pid)
    logged_engine, logged_api = _pids(two_api_servers.log_path)
    assert (engine, set(api)) == (logged_engine, set(logged_api))
    assert process_name(engine) == "tessera-engine"
    assert {process_name(pid) for pid in api} == {"tessera-api-0", "tessera-api-1"}


def test_the_log_says_once_where_the_server_listens(two_api_servers, server):
    """uvicorn logs its address only when it binds the socket itself, which Tessera never
    lets it do: a user's log never said where to send requests (fuzz60)."""
    for handle in (two_api_servers, server):
        said = re.findall(r"serving on (http://\S+)", handle.log_path.read_text())
        assert said == [handle.base_url], said


def test_metrics_add_up_both_processes(two_api_servers):
    base = two_api_servers.base_url
    success = (
        "tessera:request_success_total",
        (("finished_reason", "length"), ("model_name", MODEL_NAME)),
    )
    samples = _samples(base)
    before = samples[success]
    # Series with known labels exist before their first event, summed over the processes
    # like the others (a series that appears with its first event hides it from rate()).
    for reason in ("server_overloaded", "feature_overloaded", "server_draining"):
        rejected = (("model_name", MODEL_NAME), ("reason", reason))
        assert samples[("tessera:requests_rejected_total", rejected)] == 0
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(
            pool.map(lambda i: _chat(base, f"metric {i}", max_tokens=3).status_code, range(16))
        )
    assert statuses == [200] * 16
    # Whichever process answers the scrape, it counts both processes' requests.
    for _ in range(6):
        samples = _samples(base)
        assert samples[success] - before == 16
        # The engine's gauges come from API process 0 alone: one series, no pid label.
        capacity = [k for k in samples if k[0] == "tessera:kv_cache_capacity_tokens"]
        assert capacity == [("tessera:kv_cache_capacity_tokens", (("model_name", MODEL_NAME),))]
        assert samples[capacity[0]] == 512 * 16
        running = [k for k in samples if k[0] == "tessera:num_requests_running"]
        assert len(running) == 1
    # Engine counters are counted once, not once per API process: the engine looked up in
    # its prefix cache exactly the prompt tokens that the API processes counted.
    totals = {}
    for (name, _), value in _samples(base).items():
        totals[name] = totals.get(name, 0.0) + value
    prompt_tokens = totals["tessera:prompt_tokens_total"]
    assert prompt_tokens > 0
    assert totals["tessera:prefix_cache_queries_total"] == prompt_tokens
    # The API processes' CPU, summed: as /proc counts it (each reports once a second).
    time.sleep(1.5)
    _, api = server_processes(two_api_servers.process.pid)
    reported = sum(
        v for k, v in _samples(base).items() if k[0] == "tessera:api_server_cpu_seconds_total"
    )
    used = sum(cpu_seconds(pid) for pid in api)
    assert used - 1.0 < reported <= used + 0.05


def test_clients_that_hang_up_free_the_engine_through_either_process(two_api_servers):
    base = two_api_servers.base_url
    running = ("tessera:num_requests_running", (("model_name", MODEL_NAME),))

    def hang_up_after_first_chunk(i: int) -> None:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"go {i}"}],
                "max_tokens": 1500, "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(hang_up_after_first_chunk, range(32)))
    deadline = time.monotonic() + 20
    while _samples(base)[running] > 0:  # every abort reached the engine
        assert time.monotonic() < deadline, "requests were not all aborted"
        time.sleep(0.05)
    kv = _samples(base)[("tessera:kv_cache_usage_perc", (("model_name", MODEL_NAME),))]
    assert kv == 0


def test_a_media_uuid_works_through_either_process(two_api_servers):
    """An image sent with a uuid through one API process, then named by its uuid alone on
    fresh connections, which the kernel spreads over both: each process must know the uuid
    (relayed through the engine). Before, the other process answered 400 unknown_media_uuid
    (4 of 12 such requests, 2026-11-27). Under a cache_salt, which the relay carries."""
    import base64

    from bench.local_inputs import picture, png_bytes

    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(56, 56, 3))).decode()
    text = {"type": "text", "text": "What is this?"}
    first = _chat(two_api_servers.base_url, "", max_tokens=4, cache_salt="t", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": "tile-1"}, text]}])  # fmt: skip
    assert first.status_code == 200, first.text
    answers = set()
    for _ in range(16):  # a new connection each time
        again = _chat(two_api_servers.base_url, "", max_tokens=4, cache_salt="t", messages=[{"role": "user",
                      "content": [{"type": "image_url", "uuid": "tile-1"}, text]}])  # fmt: skip
        assert again.status_code == 200, again.text
        answers.add(again.json()["choices"][0]["message"]["content"])
    assert answers == {first.json()["choices"][0]["message"]["content"]}


def test_a_stopped_api_process_does_not_keep_the_launcher_up(model_dir, tmp_path):
    """The launcher waited for ever on an API process that could not drain (SIGSTOP):
    60 s after three SIGTERMs it still ran, so its supervisor never restarted it."""
    log_path = tmp_path / "stopped.log"
    with run_server(model_dir, log_path, *API_SERVERS, "--shutdown-timeout-s", "1") as handle:
        engine, api = _pids(log_path)
        os.kill(api[1], signal.SIGSTOP)
        try:
            os.kill(handle.process.pid, signal.SIGTERM)
            started = time.monotonic()
            assert handle.process.wait(30) == 1, handle.log_tail()
            # drain, grace, slack: stopping the rest takes ~3.5 s on a quiet 2-core machine
            # and went past 5 beside other test workers (16.2 s in all)
            assert time.monotonic() - started < 1 + 10 + 10
            assert "did not exit after its drain; killed" in handle.log_tail(20000)
            wait_all_gone([engine, *api], timeout=10)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(api[1], signal.SIGKILL)


def test_sigterm_drains_both_processes_then_exits_zero(model_dir, tmp_path):
    log_path = tmp_path / "drain.log"
    with run_server(model_dir, log_path, *API_SERVERS, "--shutdown-timeout-s", "30") as handle:
        base = handle.base_url
        engine, api = _pids(log_path)
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        thread, result, started = stream_in_background(base, body)
        assert started.wait(60)
        # The whole process group, as systemd or a terminal would: each process must get
        # the drain once, through the launcher, and the engine must outlive the drain.
        os.killpg(handle.process.pid, signal.SIGTERM)
        thread.join(60)
        assert result["lines"][-1] == "data: [DONE]"
        assert any('"finish_reason":"length"' in line for line in result["lines"])
        assert handle.process.wait(30) == 0, handle.log_tail()
        wait_all_gone([engine, *api], timeout=5)
        assert "draining" in log_path.read_text()


def test_engine_death_stops_the_whole_server(model_dir, tmp_path):
    log_path = tmp_path / "engine_killed.log"
    with run_server(model_dir, log_path, *API_SERVERS) as handle:
        engine, api = _pids(log_path)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(_chat, handle.base_url, f"long {i}", max_tokens=1900,
                                   ignore_eos=True) for i in range(4)]  # fmt: skip
            running = ("tessera:num_requests_running", (("model_name", MODEL_NAME),))
            deadline = time.monotonic() + 30
            while _samples(handle.base_url)[running] < 4 and time.monotonic() < deadline:
                time.sleep(0.02)  # all four are in the engine
            os.kill(engine, signal.SIGKILL)
            responses = [future.result(30) for future in pending]
        for response in responses:  # an error, never a hang
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_dead"
        assert handle.process.wait(30) == 1, handle.log_tail()
        wait_all_gone(api, timeout=5)


def test_a_dead_api_process_stops_the_whole_server(model_dir, tmp_path):
    log_path = tmp_path / "api_killed.log"
    with run_server(model_dir, log_path, *API_SERVERS) as handle:
        engine, api = _pids(log_path)
        os.kill(api[1], signal.SIGKILL)
        assert handle.process.wait(30) == 1, handle.log_tail()  # a supervisor restarts it
        wait_all_gone([engine, api[0]], timeout=5)
        assert "exited with code -9" in log_path.read_text()


def _serve_to_exit(model: Path, log_path: Path) -> int:
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(free_port()), *API_SERVERS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    with open(log_path, "wb") as log:
        process = subprocess.run(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120
        )
    return process.returncode


def test_an_engine_that_cannot_start_fails_the_launcher(model_dir, tmp_path):
    # Weights the model-folder check does not read (it reads headers): the engine fails
    # loading them, for a tensor the model does not have.
    import torch
    from safetensors.torch import save_file

    model = tmp_path / "broken"
    shutil.copytree(model_dir, model)
    save_file({"not.a.weight": torch.zeros(2)}, str(model / "model.safetensors"))
    log_path = tmp_path / "broken.log"
    assert _serve_to_exit(model, log_path) == 1, log_path.read_text()[-3000:]
    engine, api = _pids(log_path)
    wait_all_gone([engine, *api], timeout=5)
    assert "engine failed to start" in log_path.read_text()
    # A folder the check refuses starts no process at all.
    (model / "config.json").write_text("{}")
    assert _serve_to_exit(model, log_path) == 1
    text = log_path.read_text()
    assert "unsupported architecture" in text and "engine process" not in text


def test_a_killed_launcher_takes_every_process_with_it(model_dir, tmp_path):
    log_path = tmp_path / "launcher_killed.log"
    with run_server(model_dir, log_path, *API_SERVERS) as handle:
        engine, api = _pids(log_path)
        handle.process.kill()  # SIGKILL: nothing passed on, nothing stopped
        handle.process.wait(10)
        wait_all_gone([engine, *api], timeout=10)  # each noticed its parent is gone
