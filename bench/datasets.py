"""Request generators for `tessera bench serve`: chat message contents, made before the clock.

Datasets (all seeded, so two runs with the same flags send the same requests):

    text      random words from a fixed list of common English words, about one token each
              on BPE tokenizers, `input_len` words per request
    image     one random-noise PNG of `image_size` (as a data: URL) + the random text; a
              share `image_repeat_ratio` of the requests reuse one shared image, the rest get
              distinct images (each PNG is encoded once, here, not while timing)
    features  one pre-encoded `image_features` part (URLs taken in turn from `feature_urls`,
              all with `feature_grid_thw`) + the random text
    mixed     text, image (and features when URLs are given) requests in turn
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

DATASETS: tuple[str, ...] = ("text", "image", "mixed", "features")

# Common English words: one token each (with the leading space) on typical BPE vocabularies.
WORDS: tuple[str, ...] = tuple(
    """the of and to a in is it you that he was for on are with as his they be at one have
    this from or had by hot word but what some we can out other were all there when up use
    your how said an each she which do their time if will way about many then them write
    would like so these her long make thing see him two has look more day could go come did
    number sound no most people my over know water than call first who may down side been
    now find any new work part take get place made live where after back little only round
    man year came show every good me give our under name very through just form great think
    say help low line differ turn cause much mean before move right boy old too same tell
    does set three want air well also play small end put home read hand port large spell add
    even land here must big high such follow act why ask men change went light kind off need
    house picture try us again animal point mother world near build self earth father head
    stand own page should country found answer school grow study still learn plant cover
    food sun four between state keep eye never last let thought city tree cross farm hard
    start might story saw far sea draw left late run while press close night real life few
    north open seem together next white children begin got walk example ease paper group""".split()
)


def parse_image_size(text: str) -> tuple[int, int]:
    """--image-size "WxH" -> (width, height)."""
    width, _, height = text.lower().partition("x")
    return int(width), int(height)


@dataclass(frozen=True)
class DatasetConfig:
    """What requests to make. Sizes are validated by the CLI before they get here."""

    dataset: str = "text"
    num_requests: int = 100
    input_len: int = 128  # words of random text per request (~tokens)
    image_size: tuple[int, int] = (448, 448)  # width, height
    image_repeat_ratio: float = 0.0  # share of image requests that reuse one shared image
    feature_urls: tuple[str, ...] = ()
    feature_grid_thw: tuple[int, int, int] = (1, 16, 16)
    seed: int = 0


@dataclass(frozen=True)
class BenchRequest:
    """One chat request's user content (OpenAI content parts) and what kind it is."""

    kind: str  # "text" | "image" | "features"
    content: tuple[dict[str, Any], ...]


def random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, num_words)))


def random_picture(seed: int, width: int, height: int) -> Image.Image:
    """An RGB picture of uniform random noise, the same for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def random_png(seed: int, width: int, height: int) -> bytes:
    """A PNG of uniform random noise (incompressible, so its size is honest)."""
    buffer = io.BytesIO()
    random_picture(seed, width, height).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def image_chat_prompt(seed: int, side: int, text: str) -> dict[str, Any]:
    """A prompt for the in-process `LLM`: one user message of a side x side random picture
    and `text` (the benchmarks' image request, without the HTTP API's data: URL)."""
    content = [{"type": "image", "image": random_picture(seed, side, side)},
               {"type": "text", "text": text}]  # fmt: skip
    return {"messages": [{"role": "user", "content": content}]}


def data_url(data: bytes, media_type: str = "application/octet-stream") -> str:
    """A base64 data: URL (images with their media type, feature files as octet-stream)."""
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def request_kinds(config: DatasetConfig) -> list[str]:
    """The kind of every request, in order."""
    if config.dataset == "mixed":
        cycle = ["text", "image"] + (["features"] if config.feature_urls else [])
        return [cycle[i % len(cycle)] for i in range(config.num_requests)]
    if config.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {config.dataset!r}; choose one of {DATASETS}")
    return [config.dataset] * config.num_requests


def image_urls(config: DatasetConfig, num_images: int) -> list[str]:
    """`num_images` data: URLs; a `image_repeat_ratio` share of them is one shared image."""
    rng = random.Random(config.seed + 1)
    num_repeats = round(config.image_repeat_ratio * num_images)
    repeated = set(rng.sample(range(num_images), num_repeats))
    width, height = config.image_size

    def png_url(seed: int) -> str:
        return data_url(random_png(seed, width, height), "image/png")

    shared = png_url(config.seed) if repeated else ""
    return [shared if i in repeated else png_url(config.seed + 1000 + i) for i in range(num_images)]


def make_requests(config: DatasetConfig) -> list[BenchRequest]:
    """All the requests of a run, images encoded up front."""
    kinds = request_kinds(config)
    if "features" in kinds and not config.feature_urls:
        raise ValueError("the features dataset needs at least one --feature-url")
    images = iter(image_urls(config, kinds.count("image")))
    rng = random.Random(config.seed)
    requests = []
    num_features = 0
    for kind in kinds:
        text = {"type": "text", "text": random_text(rng, config.input_len)}
        if kind == "text":
            parts: tuple[dict[str, Any], ...] = (text,)
        elif kind == "image":
            parts = ({"type": "image_url", "image_url": {"url": next(images)}}, text)
        else:
            url = config.feature_urls[num_features % len(config.feature_urls)]
            num_features += 1
            ref = {"url": url, "grid_thw": list(config.feature_grid_thw)}
            parts = ({"type": "image_features", "image_features": ref}, text)
        requests.append(BenchRequest(kind, parts))
    return requests
