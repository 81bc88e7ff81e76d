"""Sampling defaults from the model's generation_config.json, over HTTP (vLLM's
`--generation-config`): a request that leaves a field out gets the file's value, with
transformers' generate() on the same folder (which reads the same file) as the oracle."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from bench.servers import REPO_ROOT, repo_pythonpath
from tests.e2e.conftest import MODEL_NAME, run_server

pytest.importorskip("transformers")
from tests.hf_reference import hf_text_tokens  # noqa: E402

PROMPT = "the cat sat on the mat and the cat sat on the"
RECOMMENDED = {"top_k": 1, "repetition_penalty": 1.3, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def recommending_model(model_dir, tmp_path_factory):
    """The tiny checkpoint with sampling recommendations in its generation_config.json."""
    folder = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(model_dir, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **RECOMMENDED}))
    return folder


def serve(model, tmp_path_factory, *flags):
    log = tmp_path_factory.mktemp("logs") / "generation_config.log"
    return run_server(model, log, *flags)


def complete(base_url: str, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, **fields}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def decoded(model_dir, token_ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def test_left_out_fields_take_the_models_recommendations(recommending_model, tmp_path_factory):
    # transformers reads the same file: greedy, repetition penalty 1.3, 8 new tokens.
    expected = hf_text_tokens(recommending_model, PROMPT)
    plain = hf_text_tokens(recommending_model, PROMPT, repetition_penalty=1.0)
    assert expected != plain, "the penalty must change this prompt's answer"
    # Two API processes: each applies the defaults, and only the first one logs them.
    with serve(recommending_model, tmp_path_factory, "--api-server-count", "2") as server:
        answer = complete(server.base_url)  # temperature 1 (OpenAI's), top_k 1: the argmax
        assert answer["choices"][0]["text"] == decoded(recommending_model, expected)
        assert answer["usage"]["completion_tokens"] == len(expected)
        # max_new_tokens caps a request's own max_tokens; its own fields win
        capped = complete(server.base_url, max_tokens=20, ignore_eos=True)
        assert capped["usage"]["completion_tokens"] == RECOMMENDED["max_new_tokens"]
        own = complete(server.base_url, temperature=0, repetition_penalty=1.0, max_tokens=8)
        assert own["choices"][0]["text"] == decoded(recommending_model, plain)
        assert server.log_tail().count("sampling defaults from the generation config") == 1


def test_none_keeps_openai_defaults_under_an_override(recommending_model, tmp_path_factory):
    plain = hf_text_tokens(recommending_model, PROMPT, repetition_penalty=1.0)
    flags = ("--generation-config", "none", "--override-generation-config", '{"top_k": 1}')
    with serve(recommending_model, tmp_path_factory, *flags) as server:
        answer = complete(server.base_url, max_tokens=8)
        assert answer["choices"][0]["text"] == decoded(recommending_model, plain)
        uncapped = complete(server.base_url, max_tokens=20, ignore_eos=True)
        assert uncapped["usage"]["completion_tokens"] == 20


def test_a_bad_generation_config_stops_the_start(recommending_model):
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(recommending_model),
               "--override-generation-config", '{"temperature": -1}']  # fmt: skip
    env = {"PYTHONPATH": repo_pythonpath(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "temperature must be a number in [0.0, 2.0], got -1" in done.stderr
