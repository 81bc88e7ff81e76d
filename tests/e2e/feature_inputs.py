"""What the pre-encoded feature tests (tests/e2e/test_features.py) send and read: the
moto store's bucket and credentials, a chat with feature parts, its text and metrics,
and feature files made by `tessera encode-features` or from random rows."""

from __future__ import annotations

import json

import httpx
import torch
from safetensors.torch import save

from bench.datasets import data_url
from bench.local_inputs import TINY_HIDDEN
from tests.e2e.conftest import MODEL_NAME

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "features"
MAX_FEATURE_BYTES = 64 * 1024


def chat(http: httpx.Client, parts: list[dict], max_tokens: int = 6) -> httpx.Response:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return http.post("/v1/chat/completions", json=body)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    text = http.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def encode_to_s3(model_dir, path, prefix: str, s3_endpoint: str, capsys) -> dict:
    """`tessera encode-features` of one file to s3://BUCKET/prefix: the JSON line it
    prints."""
    from engine.encode_features import main as encode_main

    argv = ["--model", str(model_dir), "--output", f"s3://{BUCKET}/{prefix}",
            "--s3-endpoint-url", s3_endpoint, str(path)]  # fmt: skip
    assert encode_main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def grid_free_features(seed: int, rows: int, copy: int = 0) -> str:
    """A data: URL of a feature file without a grid_thw tensor (the part's grid rules);
    another `copy` has the same rows in other bytes (a metadata entry)."""
    generator = torch.Generator().manual_seed(seed)
    embeds = torch.randn(rows, TINY_HIDDEN, generator=generator) * 5
    return data_url(save({"embeds": embeds}, metadata={"copy": str(copy)}),
                    "application/octet-stream")  # fmt: skip
