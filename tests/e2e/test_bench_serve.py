"""`tessera bench serve` against the real server on the tiny checkpoint: what the client
reports (completed requests, prompt and output tokens, latencies) agrees with the deltas
of the server's own /metrics over the run."""

from __future__ import annotations

import base64
import json
import time

import httpx
import pytest
import torch
from safetensors.torch import save

from bench.serve import main as bench_main
from tests.e2e.conftest import MODEL_NAME, run_server

NUM_REQUESTS = 12
MAX_TOKENS = 6


def scrape(http) -> dict[str, float]:
    """Every sample of /metrics summed over its labels, by sample name."""
    values: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def idle(http) -> None:
    """Wait until the engine runs nothing (aborted requests of an earlier run are gone)."""
    deadline = time.monotonic() + 30
    while scrape(http).get("tessera:num_requests_running", 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def moved_since(http, before: dict[str, float]) -> dict[str, float]:
    after = scrape(http)
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def run_bench(server, tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = bench_main([
        "--base-url", server.base_url, "--model", MODEL_NAME, "--no-progress",
        "--out", str(out), *flags,
    ])  # fmt: skip
    return code, json.loads(out.read_text())


@pytest.mark.parametrize(
    "dataset_flags",
    [
        ["--dataset", "text", "--input-len", "24"],
        [
            "--dataset",
            "image",
            "--input-len",
            "8",
            "--image-size",
            "64x56",
            "--image-repeat-ratio",
            "0.5",
        ],
    ],  # fmt: skip
    ids=["text", "image"],
)
def test_bench_numbers_match_server_metrics(server, http, tmp_path, capsys, dataset_flags):
    idle(http)
    before = scrape(http)
    code, result = run_bench(
        server, tmp_path, "--num-requests", str(NUM_REQUESTS), "--concurrency", "4",
        "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--slo-ttft", "60000",
        *dataset_flags,
    )  # fmt: skip
    moved = moved_since(http, before)
    summary = result["summary"]

    assert code == 0, result["errors"]
    assert summary["completed"] == NUM_REQUESTS and summary["failed"] == 0
    assert all(r["has_usage"] for r in result["requests"])
    assert moved["tessera:request_success_total"] == NUM_REQUESTS
    assert summary["total_output_tokens"] == NUM_REQUESTS * MAX_TOKENS  # ignore_eos
    assert moved["tessera:generation_tokens_total"] == summary["total_output_tokens"]
    assert moved["tessera:prompt_tokens_total"] == summary["total_input_tokens"] > 0
    assert moved["tessera:time_to_first_token_seconds_count"] == NUM_REQUESTS

    # The client's clock starts before the server sees the request and stops after it is
    # done, so the server's latencies are never longer than the client's.
    client_e2e_sum = summary["mean_e2e_ms"] / 1000 * NUM_REQUESTS
    assert moved["tessera:e2e_request_latency_seconds_sum"] <= client_e2e_sum + 1e-3
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert 0 < summary[f"p50_{key}_ms"] <= summary[f"p99_{key}_ms"]
    assert summary["p99_e2e_ms"] <= summary["duration_s"] * 1000
    assert summary["output_throughput"] == pytest.approx(
        summary["total_output_tokens"] / summary["duration_s"]
    )
    assert summary["num_good"] == NUM_REQUESTS  # a 60 s TTFT SLO: every request meets it
    assert 0 < summary["client_cpu_s"] < 10 * summary["duration_s"]
    assert result["config"]["dataset"]["num_requests"] == NUM_REQUESTS
    report = capsys.readouterr().out
    assert f"{'Successful requests:':<38}{NUM_REQUESTS:>12}" in report


def test_max_duration_cancels_and_counts_failed(server, http, tmp_path):
    idle(http)
    start = time.monotonic()
    code, result = run_bench(
        server, tmp_path, "--num-requests", "3", "--concurrency", "3", "--input-len", "4",
        "--max-tokens", "1500", "--ignore-eos", "--max-duration", "0.5",
    )  # fmt: skip
    assert time.monotonic() - start < 10
    assert code == 1
    assert result["summary"]["failed"] == 3 and result["summary"]["completed"] == 0
    assert all("max-duration" in r["error"] for r in result["requests"])
    idle(http)  # the server aborted them: nothing left running for the next test
    assert scrape(http).get("tessera:num_requests_running", 0) == 0


def feature_url(seed: int, hidden: int = 128, grid=(1, 4, 4)) -> str:
    """A data: URL of a pre-encoded feature file: 4 rows of the tiny model's hidden size."""
    embeds = torch.randn(4, hidden, generator=torch.Generator().manual_seed(seed))  # [rows, D]
    blob = save({"embeds": embeds, "grid_thw": torch.tensor(grid)})
    return "data:application/octet-stream;base64," + base64.b64encode(blob).decode()


def test_mixed_with_features(model_dir, tmp_path):
    with run_server(model_dir, tmp_path / "server.log", "--enable-feature-inputs") as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            before = scrape(http)
            code, result = run_bench(
                server, tmp_path, "--dataset", "mixed", "--num-requests", "6",
                "--concurrency", "3", "--request-rate", "50", "--input-len", "8",
                "--image-size", "56x56", "--max-tokens", "3", "--ignore-eos",
                "--feature-url", feature_url(1), "--feature-url", feature_url(2),
                "--feature-grid-thw", "1,4,4",
            )  # fmt: skip
            moved = moved_since(http, before)
    summary = result["summary"]
    assert code == 0, result["errors"]
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 18
    assert moved["tessera:request_success_total"] == 6
    assert moved["tessera:generation_tokens_total"] == 18
    assert moved["tessera:prompt_tokens_total"] == summary["total_input_tokens"]
    assert moved["tessera:feature_fetch_seconds_count"] == 2  # two feature requests


def test_client_processes_send_every_request_once_in_order(server, http, tmp_path):
    """Two client processes send the same requests as one: the records come back in
    request order (the text prompts differ in length), and the server saw each once."""
    idle(http)
    flags = ["--num-requests", "7", "--concurrency", "3", "--dataset", "text",
             "--input-len", "24", "--max-tokens", "3", "--ignore-eos"]  # fmt: skip
    code, one = run_bench(server, tmp_path, *flags)
    before = scrape(http)
    code_split, split = run_bench(server, tmp_path, *flags, "--client-processes", "2")
    moved = moved_since(http, before)
    assert code == code_split == 0, split["errors"]
    prompt_lengths = [record["num_prompt_tokens"] for record in one["requests"]]
    assert len(set(prompt_lengths)) > 1
    assert [record["num_prompt_tokens"] for record in split["requests"]] == prompt_lengths
    assert split["summary"]["completed"] == 7 and split["summary"]["total_output_tokens"] == 21
    assert moved["tessera:request_success_total"] == 7
    assert split["config"]["client_processes"] == 2
