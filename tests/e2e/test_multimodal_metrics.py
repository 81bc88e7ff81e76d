"""The image-cache, encoder-cache, vision-encoder and prefix-cache counters on /metrics move
as expected for a new image, the same request again, and the same image after other text;
the encoder cache's usage gauge shows the image held."""

from __future__ import annotations

import base64
import time

from bench.local_inputs import picture, png_bytes
from tests.e2e.conftest import MODEL_NAME

COUNTERS = [
    "tessera:encoder_cache_queries_total",
    "tessera:encoder_cache_hits_total",
    "tessera:vision_encoder_items_total",
    "tessera:vision_encoder_batches_total",
    "tessera:prefix_cache_queries_total",
    "tessera:prefix_cache_hits_total",
    # the API process's processed-image cache (fuzz58: its filling looked like a leak)
    "tessera:image_cache_queries_total",
    "tessera:image_cache_hits_total",
    "tessera:image_cache_bytes",
]


def counters(http) -> dict[str, float]:
    text = http.get("/metrics").text
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def gauge(http, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not on /metrics")


def chat(http, parts: list) -> dict:
    content = [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else {"type": "image_url", "image_url": {"url": part["url"]}}
        for part in parts
    ]
    response = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "temperature": 0.0,
        },
    )
    assert response.status_code == 200, response.text
    return response.json()


def delta(http, before: dict[str, float], expected_prompt_tokens: int) -> dict[str, float]:
    """Counter deltas once the engine's stats for the finished request have arrived."""
    deadline = time.monotonic() + 5
    while True:
        after = counters(http)
        moved = (
            after["tessera:prefix_cache_queries_total"]
            - before["tessera:prefix_cache_queries_total"]
        )
        if moved >= expected_prompt_tokens or time.monotonic() > deadline:
            return {name: after[name] - before[name] for name in COUNTERS}
        time.sleep(0.05)


def test_multimodal_counters_move(http):
    # An image no other test sends, so the first request is a miss everywhere.
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(150, 100, 97))).decode()
    image = {"url": url}

    before = counters(http)
    first = chat(http, [image, "What is in this picture, in a few words?"])
    num_prompt = first["usage"]["prompt_tokens"]
    moved = delta(http, before, num_prompt)
    assert moved["tessera:vision_encoder_items_total"] == 1
    assert moved["tessera:vision_encoder_batches_total"] == 1
    assert moved["tessera:encoder_cache_queries_total"] == 1
    assert moved["tessera:encoder_cache_hits_total"] == 0
    assert moved["tessera:image_cache_queries_total"] == 1
    assert moved["tessera:image_cache_hits_total"] == 0
    assert moved["tessera:image_cache_bytes"] >= 3 * 150 * 100  # its pixel levels, uint8
    assert moved["tessera:prefix_cache_queries_total"] == num_prompt
    assert moved["tessera:prefix_cache_hits_total"] < num_prompt - 20  # not past the image
    # its encoding stays in the encoder cache for reuse (the engine publishes idle stats)
    assert 0 < gauge(http, "tessera:encoder_cache_usage_perc") <= 1

    before = counters(http)
    chat(http, [image, "What is in this picture, in a few words?"])  # same text, same image
    moved = delta(http, before, num_prompt)
    assert moved["tessera:vision_encoder_items_total"] == 0
    assert moved["tessera:image_cache_queries_total"] == 1
    assert moved["tessera:image_cache_hits_total"] == 1
    assert moved["tessera:image_cache_bytes"] == 0
    assert moved["tessera:prefix_cache_queries_total"] == num_prompt
    assert moved["tessera:prefix_cache_hits_total"] >= num_prompt - 16  # all full blocks

    before = counters(http)
    third = chat(http, ["Other words first, then", image])  # same image after new text
    moved = delta(http, before, third["usage"]["prompt_tokens"])
    assert moved["tessera:vision_encoder_items_total"] == 0
    assert moved["tessera:encoder_cache_queries_total"] == 1
    assert moved["tessera:encoder_cache_hits_total"] == 1


def preprocess_counts(http) -> dict[str, float]:
    counts = {"image": 0.0, "video": 0.0}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tessera:media_preprocess_seconds_count{"):
            modality = line.split('modality="', 1)[1].split('"', 1)[0]
            counts[modality] = float(line.rsplit(" ", 1)[1])
    return counts


def test_media_preprocessing_is_timed_by_modality(http, image_server):
    before = preprocess_counts(http)
    content = [
        {"type": "image_url", "image_url": {"url": image_server + "/picture.png"}},
        {"type": "image_url", "image_url": {"url": image_server + "/picture.png"}},
        {"type": "video_url", "video_url": {"url": image_server + "/clip.mp4"}},
    ]
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
              "max_tokens": 1},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    after = preprocess_counts(http)  # recorded before the engine runs: no wait needed
    assert (after["image"] - before["image"], after["video"] - before["video"]) == (2, 1)
