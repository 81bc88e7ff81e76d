"""Pre-encoded features end to end: a real server, a real S3-compatible store (moto in
server mode on 127.0.0.1) and a local HTTP server with per-object latency and failures."""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save

from bench.datasets import data_url
from bench.local_inputs import (
    FEATURE_GRID,
    TINY_HIDDEN,
    ObjectServer,
    feature_part,
    features,
    moving_pictures,
    picture,
    png_bytes,
    video_bytes,
)
from bench.servers import free_port
from tests.e2e.conftest import MODEL_NAME, run_server
from tests.e2e.feature_inputs import (
    AWS_ENV,
    BUCKET,
    MAX_FEATURE_BYTES,
    chat,
    encode_to_s3,
    grid_free_features,
    metric,
    text_of,
)

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")


@pytest.fixture(scope="module")
def aws_env():
    saved = {key: os.environ.get(key) for key in AWS_ENV}
    os.environ.update(AWS_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def s3_endpoint(aws_env):
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    client.create_bucket(Bucket="elsewhere")
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture(scope="module")
def objects():
    with ObjectServer() as store:
        yield store


@pytest.fixture(scope="module")
def feature_server(model_dir, tmp_path_factory, s3_endpoint):
    # A 4 s fetch timeout: a first S3 fetch (client set-up included) took over 1.5 s on a
    # loaded 2-core CI machine; the timeout case's object is delayed 8 s.
    log_path = tmp_path_factory.mktemp("logs") / "feature_server.log"
    with run_server(
        model_dir, log_path,
        "--enable-feature-inputs", "--s3-endpoint-url", s3_endpoint,
        "--allow-private-feature-urls",
        "--allowed-feature-buckets", BUCKET,
        "--feature-fetch-timeout-s", "4", "--max-feature-bytes", str(MAX_FEATURE_BYTES),
    ) as handle:  # fmt: skip
        yield handle


@pytest.fixture(scope="module")
def fhttp(feature_server):
    with httpx.Client(base_url=feature_server.base_url, timeout=60) as session:
        yield session


def test_encode_features_gives_the_same_completion_as_the_image(
    fhttp, model_dir, tmp_path, s3_endpoint, monkeypatch
):
    """Its files go up through one S3 client a run: one a file cost 327 against 14 ms a
    file."""
    import aioboto3

    from engine.encode_features import main as encode_main

    clients = []
    open_client = aioboto3.Session.client
    monkeypatch.setattr(aioboto3.Session, "client",
                        lambda *a, **k: clients.append(a) or open_client(*a, **k))  # fmt: skip
    image_path, other = tmp_path / "scene.png", tmp_path / "other.png"
    image_path.write_bytes(png_bytes(picture(112, 84, 5)))
    other.write_bytes(png_bytes(picture(56, 56, 6)))
    output = f"s3://{BUCKET}/encoded"
    argv = ["--model", str(model_dir), "--output", output, "--s3-endpoint-url", s3_endpoint]
    assert encode_main([*argv, str(image_path), str(other)]) == 0
    assert len(clients) == 1
    image_part = {"type": "image_url", "image_url": {"url": data_url(image_path.read_bytes())}}
    with_image = text_of(chat(fhttp, [image_part], max_tokens=8))
    part = feature_part(f"s3://{BUCKET}/encoded/scene.safetensors", grid=(1, 6, 8))
    assert text_of(chat(fhttp, [part], max_tokens=8)) == with_image
    mixed = text_of(chat(fhttp, [image_part, part], max_tokens=8))
    assert mixed  # features and an image in one request


def test_encode_features_of_a_video_give_the_same_completion_as_the_video(
    fhttp, model_dir, tmp_path, s3_endpoint, capsys
):
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes(moving_pictures(160, 120, 12, salt=4), fps=4))
    line = encode_to_s3(model_dir, clip, "encoded", s3_endpoint, capsys)
    assert (line["video"], line["grid_thw"], line["num_tokens"]) == (str(clip), [3, 8, 12], 72)
    assert line["second_per_grid_t"] == 1.0  # 6 of 12 frames at 4 fps: sampled at 2 fps
    video_part = {"type": "video_url", "video_url": {"url": data_url(clip.read_bytes())}}
    with_video = text_of(chat(fhttp, [video_part], max_tokens=8))
    part = feature_part(line["url"], grid=(3, 8, 12), kind="video_features")
    assert text_of(chat(fhttp, [part], max_tokens=8)) == with_video


def test_order_holds_under_random_latency(fhttp, objects):
    rng = random.Random(7)
    blobs = [features(seed) for seed in range(6)]
    urls = [
        objects.put(f"order/{i}.safetensors", blob, delay=rng.uniform(0.0, 0.4))
        for i, blob in enumerate(blobs)
    ]
    urls[0] = objects.put("order/first-slowest.safetensors", blobs[0], delay=0.6)
    expected = text_of(chat(fhttp, [feature_part(data_url(b)) for b in blobs]))
    assert text_of(chat(fhttp, [feature_part(u) for u in urls])) == expected


def test_one_failure_fails_its_request_and_cancels_the_rest(fhttp, objects):
    slow = [objects.put(f"fail/slow{i}", features(10 + i), delay=1.0) for i in range(4)]
    broken = objects.put("fail/missing", b"", status=404)
    cancelled_before = metric(fhttp, "tessera:feature_fetch_failures_total", reason="cancelled")
    other = [objects.put("fail/other", features(20), delay=0.2)]
    with ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        failing = pool.submit(chat, fhttp, [feature_part(u) for u in [*slow, broken]])
        healthy = pool.submit(chat, fhttp, [feature_part(u) for u in other])
        response = failing.result()
        elapsed = time.monotonic() - started
        assert text_of(healthy.result())
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert broken in message and "not found" in message
    assert elapsed < 0.9  # did not wait for the slow objects
    cancelled = metric(fhttp, "tessera:feature_fetch_failures_total", reason="cancelled")
    assert cancelled - cancelled_before >= 4


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("too_large", "too large"),
        ("s3_too_large", "too large"),
        ("wrong_hidden", "hidden size"),
        ("wrong_tokens", "implies 4 tokens"),
        ("bad_dtype", "dtype"),
        ("pickle", "safetensors"),
        ("nan", "NaN"),
        ("bucket", "allowed feature buckets"),
        ("s3_missing", "not found"),
        ("bad_grid", "grid_thw"),
        ("huge_grid", "context length"),  # a 500 (MemoryError) and gigabytes before
        ("absurd_grid", "context length"),  # a 500 (OverflowError) before
    ],
)
def test_bad_features_are_clear_4xx(fhttp, objects, s3, case, words):
    """Each names the part: its url or grid_thw field where the server's checks refuse it,
    the part itself where the download or the file does (it was null)."""
    nan = torch.randn(4, TINY_HIDDEN)
    nan[1, 2] = float("nan")
    blobs = {
        "too_large": save({"embeds": torch.zeros(200, TINY_HIDDEN)}),
        "wrong_hidden": features(1, hidden=TINY_HIDDEN // 2),
        "wrong_tokens": features(1, rows=5),
        "bad_dtype": features(1, dtype=torch.float64),
        "pickle": pickle.dumps({"embeds": [[0.0] * TINY_HIDDEN] * 4}),
        "nan": save({"embeds": nan}),
    }
    grid = FEATURE_GRID
    if case in blobs:
        url = objects.put(f"bad/{case}", blobs[case])
    elif case == "bucket":
        s3.put_object(Bucket="elsewhere", Key="x.safetensors", Body=features(1))
        url = "s3://elsewhere/x.safetensors"
    elif case == "s3_too_large":
        s3.put_object(Bucket=BUCKET, Key="big.safetensors", Body=blobs["too_large"])
        url = f"s3://{BUCKET}/big.safetensors"
    elif case == "s3_missing":
        url = f"s3://{BUCKET}/does/not/exist.safetensors"
    else:
        grids = {
            "bad_grid": (1, 3, 4),
            "huge_grid": (1, 2**20, 2**20),
            "absurd_grid": (10**30, 2, 2),
        }
        url, grid = objects.put("bad/grid", features(1)), grids[case]
    response = chat(fhttp, [feature_part(url, grid=grid)])
    assert 400 <= response.status_code < 500, response.text
    assert words in response.json()["error"]["message"]
    field = {"bucket": ".url"}.get(case, ".grid_thw" if "grid" in case else "")
    assert response.json()["error"]["param"] == "messages[0].content[0].image_features" + field
    assert text_of(chat(fhttp, [feature_part(data_url(features(3)))]))  # engine unharmed


@pytest.mark.parametrize(
    ("case", "status", "code"),
    [("down", 502, "feature_server_error"), ("slow", 504, "feature_timeout")],
)
def test_a_store_that_fails_is_a_5xx_not_the_requests_fault(fhttp, objects, case, status, code):
    """A store answering 5xx through every retry, or not in time, was a 400: clients and
    load balancers take that for a bad request and never retry it."""
    if case == "down":
        url = objects.put("store/down", b"", status=503)
    else:
        url = objects.put("store/slow", features(1), delay=8.0)  # the timeout is 4 s
    response = chat(fhttp, [feature_part(url)])
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "server_error"
    assert url in error["message"]
    assert error["param"] == "messages[0].content[0].image_features"
    assert text_of(chat(fhttp, [feature_part(data_url(features(3)))]))  # engine unharmed


def test_changed_s3_object_is_fetched_again_unchanged_is_not(fhttp, s3):
    key, url = "cache/obj.safetensors", f"s3://{BUCKET}/cache/obj.safetensors"
    first, second = features(100), features(101)
    s3.put_object(Bucket=BUCKET, Key=key, Body=first)
    before = metric(fhttp, "tessera:feature_fetch_bytes_total")
    text_first = text_of(chat(fhttp, [feature_part(url)]))
    after_first = metric(fhttp, "tessera:feature_fetch_bytes_total")
    assert after_first - before == len(first)
    assert text_of(chat(fhttp, [feature_part(url)])) == text_first
    assert metric(fhttp, "tessera:feature_fetch_bytes_total") == after_first  # not downloaded
    s3.put_object(Bucket=BUCKET, Key=key, Body=second)
    text_of(chat(fhttp, [feature_part(url)]))
    assert metric(fhttp, "tessera:feature_fetch_bytes_total") - after_first == len(second)


def test_an_unchanged_object_sent_with_another_grid_is_checked_again(fhttp, s3):
    # The unchanged object's cached 4 rows were once reused for an 8-token grid: the model
    # step failed (500, and for every request in that step).
    key, url = "regrid/obj.safetensors", f"s3://{BUCKET}/regrid/obj.safetensors"
    s3.put_object(Bucket=BUCKET, Key=key, Body=features(7))  # grid_thw (1, 4, 4)
    assert text_of(chat(fhttp, [feature_part(url)]))
    other_grid = chat(fhttp, [feature_part(url, grid=(1, 4, 8))])
    assert other_grid.status_code == 400, other_grid.text
    assert "grid_thw" in other_grid.json()["error"]["message"]
    assert text_of(chat(fhttp, [feature_part(url)]))  # the first grid still works


def test_num_requests_fetching_rises_while_features_are_delayed(fhttp, objects):
    def fetching() -> float:
        return metric(fhttp, "tessera:num_requests_fetching")

    assert fetching() == 0
    url = objects.put("gauge/slow.safetensors", features(40), delay=1.0)
    with ThreadPoolExecutor(1) as pool:
        response = pool.submit(chat, fhttp, [feature_part(url)])
        deadline, peak = time.monotonic() + 0.9, 0.0
        while peak < 1 and time.monotonic() < deadline:
            peak = max(peak, fetching())
            time.sleep(0.05)
        assert peak >= 1
        assert text_of(response.result())
    deadline = time.monotonic() + 5
    while fetching() != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fetching() == 0


def test_downloads_cancelled_by_a_client_that_left_settle_in_the_metrics(
    fhttp, feature_server, objects
):
    """The client gives up on a request whose two downloads hang; with no other request
    after it, the in-flight gauge still goes back to 0 and the cancellations count (the
    engine published stats only on steps: the gauge stayed at 2 until the next request)."""
    urls = [objects.put(f"settle/slow{i}", features(50 + i), delay=20.0) for i in range(2)]
    cancelled_before = metric(fhttp, "tessera:feature_fetch_failures_total", reason="cancelled")
    body = {"model": MODEL_NAME, "max_tokens": 2,
            "messages": [{"role": "user", "content": [feature_part(u) for u in urls]}]}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(feature_server.base_url + "/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        in_flight = metric(fhttp, "tessera:feature_fetch_in_flight")
        cancelled = metric(fhttp, "tessera:feature_fetch_failures_total", reason="cancelled")
        if in_flight == 0 and cancelled - cancelled_before == 2:
            break
        time.sleep(0.1)
    assert (in_flight, cancelled - cancelled_before) == (0, 2)


def test_video_features_and_metrics(fhttp):
    blob = save({"embeds": torch.randn(8, TINY_HIDDEN), "grid_thw": torch.tensor([2, 4, 4])})
    part = feature_part(data_url(blob), grid=(2, 4, 4), kind="video_features")
    assert text_of(chat(fhttp, [part]))
    text = fhttp.get("/metrics").text
    assert re.search(r"tessera:feature_fetch_seconds_count\{[^}]*\} [1-9]", text)
    assert "tessera:feature_fetch_in_flight" in text


def test_client_uuid_reuses_the_cached_image(fhttp):
    image = data_url(png_bytes(picture(56, 56, 9)))
    with_bytes = {"type": "image_url", "image_url": {"url": image}, "uuid": "client-img-1"}
    first = text_of(chat(fhttp, [with_bytes]))
    by_uuid = {"type": "image_url", "uuid": "client-img-1"}
    assert text_of(chat(fhttp, [by_uuid])) == first
    response = chat(fhttp, [{"type": "image_url", "image_url": {"url": ""}, "uuid": "nope"}])
    assert response.status_code == 400
    assert "unknown media uuid" in response.json()["error"]["message"]


def test_a_uuid_resent_with_another_size_is_encoded_again(fhttp):
    # Rows cached for a uuid's 56x56 picture were once spliced into the placeholders of
    # its 112x168 picture: the step failed (500, and for every request in that step).
    def part(width, height, uuid=None):
        url = data_url(png_bytes(picture(width, height, 9)))
        return {"type": "image_url", "image_url": {"url": url}, **({"uuid": uuid} if uuid else {})}

    assert text_of(chat(fhttp, [part(56, 56, "client-img-2")]))
    plain = chat(fhttp, [part(112, 168)])
    resent = chat(fhttp, [part(112, 168, "client-img-2")])
    assert resent.status_code == 200, resent.text
    assert text_of(resent) == text_of(plain)
    by_uuid = chat(fhttp, [{"type": "image_url", "uuid": "client-img-2"}])  # the latest size
    assert text_of(by_uuid) == text_of(plain)


def test_feature_parts_are_refused_when_disabled(http):
    response = chat(http, [feature_part(data_url(features(1)))])
    assert response.status_code == 400
    assert "--enable-feature-inputs" in response.json()["error"]["message"]


def test_bench_stream_times_raises_when_the_stream_fails(fhttp, objects):
    # bench/feature_fetch.py once measured decoding "with fetches in flight" while every
    # background fetch failed inside its stream (a refused URL): the failures passed for
    # requests, and the fetch thread died. A failure in the stream must raise.
    from bench.client import stream_times

    good = objects.put("bench/good", features(11))
    times = stream_times(fhttp, [feature_part(good), {"type": "text", "text": "hi"}], 2)
    assert len(times) >= 2  # the send, then at least one content chunk
    missing = objects.put("bench/missing", b"", status=404)
    with pytest.raises(RuntimeError, match="streamed request failed"):
        stream_times(fhttp, [feature_part(missing), {"type": "text", "text": "hi"}], 2)


@pytest.fixture(scope="module")
def qwen3_vl_features(tmp_path_factory, s3_endpoint):
    """A tiny Qwen3-VL server fetching features from the moto S3 store; yields (client,
    model folder)."""
    from engine.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("q3vl_features"), size="tiny-qwen3-vl")
    log_path = tmp_path_factory.mktemp("logs") / "q3vl_feature_server.log"
    flags = ("--enable-feature-inputs", "--s3-endpoint-url", s3_endpoint,
             "--allow-private-feature-urls", "--feature-fetch-timeout-s", "4")  # fmt: skip
    with run_server(model, log_path, *flags) as handle:
        with httpx.Client(base_url=handle.base_url, timeout=60) as session:
            yield session, model


def test_qwen3_vl_video_features_from_s3_are_fetched_once_and_reused(
    qwen3_vl_features, tmp_path, s3_endpoint, capsys
):
    """A Qwen3-VL video's features take one download for all its temporal patches, and a
    repeat of the unchanged object takes none: its patches' rows come from the cache."""
    http, model = qwen3_vl_features
    clip = tmp_path / "q3clip.mp4"
    clip.write_bytes(video_bytes(moving_pictures(96, 64, 19, salt=6), fps=4))
    line = encode_to_s3(model, clip, "q3", s3_endpoint, capsys)
    assert line["grid_thw"][0] == len(line["frame_seconds"]) == 5
    video_part = {"type": "video_url", "video_url": {"url": data_url(clip.read_bytes())}}
    with_video = text_of(chat(http, [video_part], max_tokens=8))
    part = {
        "type": "video_features",
        "video_features": {
            "url": line["url"],
            "grid_thw": line["grid_thw"],
            "frame_seconds": line["frame_seconds"],
        },
    }
    size = len(boto3.client("s3", endpoint_url=s3_endpoint).get_object(
        Bucket=BUCKET, Key="q3/q3clip.safetensors")["Body"].read())  # fmt: skip
    before = metric(http, "tessera:feature_fetch_bytes_total")
    assert text_of(chat(http, [part], max_tokens=8)) == with_video
    downloaded = metric(http, "tessera:feature_fetch_bytes_total")
    assert downloaded - before == size  # one download for five patches
    assert text_of(chat(http, [part], max_tokens=8)) == with_video
    assert metric(http, "tessera:feature_fetch_bytes_total") == downloaded  # reused


def test_one_feature_file_under_two_grids_shares_no_prefix_kv(fhttp):
    """The rows' positions follow the part's grid (M-RoPE): the prefix cache keyed the
    item by the file's hash alone, so the file sent again under [1, 8, 6] reused the KV
    computed under [1, 6, 8] and answered exactly as that grid did."""

    def scores(url: str, grid: tuple[int, int, int]) -> list[float]:
        body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
                "logprobs": True, "messages": [{"role": "user", "content": [
                    feature_part(url, grid), {"type": "text", "text": "describe " * 40}]}]}  # fmt: skip
        response = fhttp.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return [t["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"]]

    first = scores(grid_free_features(11, 12), (1, 6, 8))
    again = scores(grid_free_features(11, 12), (1, 8, 6))
    fresh = scores(grid_free_features(11, 12, copy=1), (1, 8, 6))
    assert again == pytest.approx(fresh, abs=1e-4) and again != pytest.approx(first, abs=1e-4)


@pytest.fixture(scope="module")
def small_encoder_cache_server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("logs") / "small_encoder_cache_server.log"
    with run_server(model_dir, log_path, "--enable-feature-inputs",
                    "--encoder-cache-tokens", "8", "--max-num-batched-tokens", "16") as handle:  # fmt: skip
        yield handle


def test_features_beside_images_never_wait_on_room_they_hold(small_encoder_cache_server):
    """Feature requests held encoder-cache room from their admission: with requests that
    also carry an image, each running request waited for room the others held, and a third
    of them never answered."""
    images = [data_url(png_bytes(picture(112, 84, 30 + i)), "image/png") for i in range(3)]
    urls = [grid_free_features(40 + i, 12) for i in range(6)]

    def ask(i: int) -> int:
        parts = [feature_part(urls[i % 6], (1, 6, 8)), feature_part(urls[(i + 1) % 6], (1, 6, 8))]
        if i % 3 == 0:
            parts.insert(1, {"type": "image_url", "image_url": {"url": images[i % 3]}})
        with httpx.Client(base_url=small_encoder_cache_server.base_url, timeout=60) as client:
            return chat(client, parts, max_tokens=8).status_code

    with ThreadPoolExecutor(12) as pool:
        assert list(pool.map(ask, range(12))) == [200] * 12


def test_a_stream_that_fails_after_its_200_counts_as_a_stream_error(fhttp, objects):
    """The feature is fetched once the stream is open: its failure is an error event in a
    200. It counted in no metric (http_requests_total says 200; fuzz35)."""
    missing = objects.put("streamfail/missing", b"", status=404)
    name, code = "tessera:stream_errors_total", "feature_not_found"
    before = metric(fhttp, name, code=code)
    body = {"model": MODEL_NAME, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": [feature_part(missing)]}]}  # fmt: skip
    with fhttp.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[-2])["error"]["code"] == code and events[-1] == "[DONE]"
    assert metric(fhttp, name, code=code) == before + 1
