"""bench.datasets, the SSE accounting of bench.client, the loopback guard and flag checks."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from bench.client import _StreamState
from bench.datasets import DatasetConfig, make_requests
from bench.safety import BenchConfigError, check_loopback
from bench.serve import build_parser, config_from_args, main, shard_config


def image_urls(requests):
    return [p["image_url"]["url"] for r in requests for p in r.content if p["type"] == "image_url"]


def test_text_requests_are_seeded_and_sized():
    config = DatasetConfig(dataset="text", num_requests=5, input_len=40, seed=3)
    first, again = make_requests(config), make_requests(config)
    assert first == again
    texts = [r.content[0]["text"] for r in first]
    assert all(len(t.split()) == 40 for t in texts)
    assert len(set(texts)) == 5
    assert make_requests(DatasetConfig(num_requests=5, input_len=40, seed=4)) != first


def test_image_repeat_ratio_and_size():
    config = DatasetConfig(
        dataset="image", num_requests=8, input_len=4, image_size=(40, 24), image_repeat_ratio=0.5
    )
    urls = image_urls(make_requests(config))
    assert len(urls) == 8
    assert len(set(urls)) == 5  # 4 requests share one image, 4 have their own
    png = base64.b64decode(urls[0].split(",", 1)[1])
    assert Image.open(io.BytesIO(png)).size == (40, 24)
    distinct = image_urls(
        make_requests(
            DatasetConfig(dataset="image", num_requests=4, input_len=4, image_size=(8, 8))
        )
    )
    assert len(set(distinct)) == 4


def test_mixed_and_features():
    config = DatasetConfig(
        dataset="mixed",
        num_requests=6,
        input_len=4,
        image_size=(8, 8),
        feature_urls=("s3://b/a.safetensors", "s3://b/b.safetensors"),
        feature_grid_thw=(1, 4, 6),
    )
    requests = make_requests(config)
    assert [r.kind for r in requests] == ["text", "image", "features"] * 2
    feature = requests[2].content[0]
    assert feature == {
        "type": "image_features",
        "image_features": {"url": "s3://b/a.safetensors", "grid_thw": [1, 4, 6]},
    }
    assert requests[5].content[0]["image_features"]["url"] == "s3://b/b.safetensors"
    with pytest.raises(ValueError):
        make_requests(DatasetConfig(dataset="features", num_requests=1))


def event(**fields):
    return json.dumps({"id": "x", "object": "chat.completion.chunk", **fields})


def delta(text, finish=None):
    return event(choices=[{"index": 0, "delta": {"content": text}, "finish_reason": finish}])


def test_stream_timing_and_usage():
    state = _StreamState(start=10.0)
    state.on_event(
        event(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}]), 10.1
    )
    state.on_event(delta("Hello"), 10.5)
    state.on_event(delta(" world"), 10.7)
    state.on_event(delta("!", finish="length"), 11.0)
    state.on_event(event(choices=[], usage={"prompt_tokens": 7, "completion_tokens": 4}), 11.1)
    state.on_event("[DONE]", 11.1)
    record = state.record(end=11.2)
    assert record.is_success and record.has_usage
    assert record.ttft_s == pytest.approx(0.5)  # the role-only chunk is not a token
    assert record.itl_s == pytest.approx((0.2, 0.3))
    assert record.e2e_s == pytest.approx(1.2)
    assert (record.num_prompt_tokens, record.num_output_tokens) == (7, 4)
    assert record.tpot_s == pytest.approx((1.2 - 0.5) / 3)


def test_stream_without_usage_counts_chunks_and_errors_fail():
    state = _StreamState(start=0.0)
    for i, text in enumerate(["a", "b", "c"]):
        state.on_event(delta(text, finish="stop" if i == 2 else None), 1.0 + i)
    record = state.record(end=3.5)  # no [DONE], but the answer finished
    assert record.is_success and not record.has_usage
    assert record.num_output_tokens == 3 and record.num_prompt_tokens == 0

    broken = _StreamState(start=0.0)
    broken.on_event(delta("a"), 1.0)
    assert not broken.record(end=2.0).is_success  # cut off mid-answer
    failed = _StreamState(start=0.0)
    failed.on_event(json.dumps({"error": {"message": "engine died"}}), 1.0)
    record = failed.record(end=1.0)
    assert not record.is_success and "engine died" in record.error


def test_reasoning_and_tool_call_deltas_are_tokens():
    """A reasoning model's first token is its first reasoning token: every delta field that
    carries output (reasoning_content, vLLM's `reasoning`, tool_calls) times a token."""
    state = _StreamState(start=10.0)
    role_only = {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": []}
    state.on_event(event(choices=[{"index": 0, "delta": role_only}]), 10.1)
    state.on_event(event(choices=[{"index": 0, "delta": {"reasoning_content": "Hm"}}]), 10.2)
    state.on_event(event(choices=[{"index": 0, "delta": {"reasoning": ", so"}}]), 10.4)
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
    state.on_event(event(choices=[{"index": 0, "delta": {"tool_calls": [call]}}]), 10.6)
    state.on_event(delta("ok", finish="stop"), 10.8)
    record = state.record(end=10.9)
    assert record.is_success
    assert record.ttft_s == pytest.approx(0.2)
    assert record.itl_s == pytest.approx((0.2, 0.2, 0.2))
    assert record.num_output_tokens == 4  # no usage: the chunks with output are counted


def test_loopback_guard():
    check_loopback("http://127.0.0.1:8000", allow_remote=False)
    check_loopback("http://[::1]:8000", allow_remote=False)
    check_loopback("http://localhost:8000", allow_remote=False)
    for url in ("http://8.8.8.8:8000", "http://192.168.1.10", "http://[2001:db8::1]:80"):
        with pytest.raises(BenchConfigError, match="--allow-remote"):
            check_loopback(url, allow_remote=False)
        check_loopback(url, allow_remote=True)
    with pytest.raises(BenchConfigError):
        check_loopback("ftp://127.0.0.1/", allow_remote=True)


def test_flags_are_validated(capsys):
    parse = build_parser().parse_args
    config = config_from_args(
        parse(
            [
                "--base-url",
                "http://127.0.0.1:9/v1/",
                "--slo-ttft",
                "250",
                "--image-size",
                "64x32",
                "--feature-grid-thw",
                "1,2,2",
            ]
        )
    )
    assert config.base_url == "http://127.0.0.1:9"
    assert config.slo_ttft_s == pytest.approx(0.25) and config.slo_tpot_s is None
    assert config.dataset.image_size == (64, 32) and config.dataset.feature_grid_thw == (1, 2, 2)
    for bad in (
        ["--num-requests", "0"],
        ["--concurrency", "0"],
        ["--request-rate", "0"],
        ["--max-duration", "inf"],
        ["--image-repeat-ratio", "1.5"],
        ["--dataset", "features"],
    ):
        with pytest.raises(BenchConfigError):
            config_from_args(parse(bad))
    assert main(["--base-url", "http://8.8.8.8:1", "--no-progress"]) == 2
    assert "non-loopback" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:8x"])
def test_a_bad_port_is_a_one_line_error(capsys, url):
    for allow_remote in (False, True):
        with pytest.raises(BenchConfigError, match="bad port"):
            check_loopback(url, allow_remote=allow_remote)
    assert main(["--base-url", url, "--model", "m", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"tessera bench serve: --base-url has a bad port: {url!r}"


def test_extra_body_is_merged_into_every_request():
    from bench.client import chat_body

    parse = build_parser().parse_args
    extra = '{"structured_outputs": {"regex": "[a-z]*"}, "min_tokens": 8}'
    config = config_from_args(parse(["--extra-body", extra]))
    body = chat_body("m", ({"type": "text", "text": "hi"},), max_tokens=8, ignore_eos=True,
                     temperature=0.0, extra=config.extra_body)  # fmt: skip
    assert body["structured_outputs"] == {"regex": "[a-z]*"} and body["min_tokens"] == 8
    assert body["ignore_eos"] and body["stream"]
    with pytest.raises(SystemExit):
        parse(["--extra-body", "[1]"])


def test_client_processes_share_the_concurrency_and_the_rate():
    """--client-processes N: process k sends every N-th request with its share of the
    concurrency (the shares add up to it) and of the rate, and its own arrival seed."""
    parse = build_parser().parse_args
    config = config_from_args(
        parse(["--client-processes", "3", "--concurrency", "8", "--request-rate", "6",
               "--seed", "5"])
    )  # fmt: skip
    shards = [shard_config(config, index) for index in range(3)]
    assert [shard.concurrency for shard in shards] == [3, 3, 2]
    assert all(shard.request_rate == 2 and shard.client_processes == 1 for shard in shards)
    assert [shard.dataset.seed for shard in shards] == [5, 6, 7]
    unbounded = config_from_args(parse(["--client-processes", "2", "--num-requests", "5"]))
    assert [shard_config(unbounded, index).concurrency for index in range(2)] == [3, 2]
    for bad in (
        ["--client-processes", "0"],
        ["--client-processes", "5", "--concurrency", "4"],
        ["--client-processes", "3", "--num-requests", "2"],
    ):
        with pytest.raises(BenchConfigError):
            config_from_args(parse(bad))


def test_a_busy_client_is_reported():
    """The client's CPU over the run is printed; past 80% of the run per client process
    a warning says its lag counts in the latencies it reports."""
    from bench.report import client_cpu_report

    quiet = client_cpu_report(3.0, duration_s=10.0, client_processes=1)
    assert quiet.split() == ["Client", "CPU", "during", "the", "run", "(s):", "3.00"]
    busy = client_cpu_report(9.0, duration_s=10.0, client_processes=1)
    assert "warning: the client was busy 90% of the run" in busy
    assert "warning" not in client_cpu_report(9.0, duration_s=10.0, client_processes=2)


def test_tessera_bench_help_lists_its_subcommand(capsys):
    """`tessera --help` says `COMMAND --help` gives a command's flags; `tessera bench --help`
    was a usage error, exit 2 (fuzz86)."""
    from server.cli import main as tessera

    assert tessera(["bench", "--help"]) == 0
    assert "tessera bench serve" in capsys.readouterr().out
    assert tessera(["bench"]) == 2
