"""`--chat-template` (vLLM's flag): a server-wide chat template in place of the
checkpoint's, from a file or given inline. The oracle is transformers'
`apply_chat_template` with the same template."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from bench.servers import REPO_ROOT, repo_pythonpath
from tests.e2e.conftest import MODEL_NAME, run_server

transformers = pytest.importorskip("transformers")

TEMPLATE = (
    "{% for message in messages %}<|im_start|>[{{ message['role'] | upper }}] "
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>[ASSISTANT] {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name three colours."},
]


def hf_ids(model_dir, template: str | None) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("given_as", ["file", "inline"])
def test_the_servers_template_replaces_the_models(model_dir, tmp_path, given_as):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    value = str(path) if given_as == "file" else TEMPLATE
    expected = hf_ids(model_dir, TEMPLATE)
    assert expected != hf_ids(model_dir, None)
    with run_server(model_dir, tmp_path / "server.log", "--chat-template", value) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            tokenized = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES})
            assert tokenized.json()["tokens"] == expected
            body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
            answer = http.post("/v1/chat/completions", json=body).json()
            assert answer["usage"]["prompt_tokens"] == len(expected)


@pytest.mark.parametrize(
    "value, message",
    [
        ("/no/such/template.jinja", "chat_template: no file /no/such/template.jinja"),
        ("{% for m in messages %}", "chat_template has a syntax error"),
    ],
)
def test_a_missing_or_broken_template_stops_the_start(model_dir, value, message):
    command = [sys.executable, "-m", "server.cli", "serve", "--model", str(model_dir),
               "--chat-template", value]  # fmt: skip
    env = {"PYTHONPATH": repo_pythonpath(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
