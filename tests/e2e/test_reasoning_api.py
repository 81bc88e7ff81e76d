"""Reasoning over HTTP (server/reasoning.py): with a chat template that writes <think>
("auto" picks the qwen3 parser), the thinking comes as `reasoning_content` and the answer
as `content`, streamed or not, tool calls parsed from the answer only; a template that
opens the thinking itself makes the whole answer reasoning until </think>, and a grammar
waits for that </think>; with the model's
own template (no <think>) nothing changes. /v1/responses puts the thinking in a
`reasoning` item. The tiny model's weights are random, so a regex
makes it write the shapes."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

openai = pytest.importorskip("openai")

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n{% if open_thinking %}<think>\n{% endif %}"
    "{# a template for models that may <think> #}"
)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "server.log"
    with run_server(model_dir, log, "--trust-request-chat-template") as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http_base(server):
    return server.base_url


def ask(client, regex: str, *, stream: bool = False, opened: bool = False, template=True,
        messages=MESSAGES, extra_fields=None, **kw):  # fmt: skip
    extra = {"structured_outputs": {"regex": regex}, "chat_template_kwargs":
             {"open_thinking": opened}, **(extra_fields or {})}  # fmt: skip
    if template:
        extra["chat_template"] = THINKING_TEMPLATE
    kw = {"max_tokens": 80, **kw}
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                          stream=stream, extra_body=extra, **kw)  # fmt: skip


def collect(stream) -> tuple[str, str, list]:
    reasoning = content = ""
    calls = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
    return reasoning, content, calls


def test_thinking_and_answer_come_apart(client):
    regex = r"<think>\nfirst [a-z]{2,6}\n</think>\n\nthe answer [a-z]{2,6}"
    message = ask(client, regex).choices[0].message
    assert message.reasoning_content.startswith("\nfirst ") and "</think>" not in message.content
    assert message.content.startswith("the answer ")
    assert collect(ask(client, regex, stream=True))[:2] == (message.reasoning_content,
                                                            message.content)  # fmt: skip


def test_the_thinking_is_under_both_names_and_left_out_when_declined(client):
    """vLLM renamed `reasoning_content` to `reasoning`: clients written for either find it
    (only the first was sent). `include_reasoning: false` (vLLM's) was ignored; an empty
    thinking was "" whole and absent streamed (fuzz70)."""
    regex = r"<think>\nfirst [a-z]{2,6}\n</think>\n\nthe answer [a-z]{2,6}"
    message = ask(client, regex).choices[0].message
    assert message.reasoning == message.reasoning_content and message.reasoning
    streamed = list(ask(client, regex, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in streamed) == (
        message.reasoning)  # fmt: skip
    declined = {"include_reasoning": False}
    quiet = ask(client, regex, extra_fields=declined).choices[0].message
    assert quiet.content == message.content
    assert getattr(quiet, "reasoning_content", None) is getattr(quiet, "reasoning", None) is None
    chunks = list(ask(client, regex, stream=True, extra_fields=declined))
    assert collect(chunks)[:2] == ("", message.content)
    empty = [c for c in chunks if not c.choices[0].delta.content and not c.choices[0].delta.role
             and c.choices[0].finish_reason is None]  # fmt: skip
    assert empty == []  # an empty chunk for every thinking piece (fuzz74)
    empty = ask(client, r"<think></think>\n\nhello").choices[0].message
    assert empty.content == "hello" and getattr(empty, "reasoning_content", None) is None


def test_chat_usage_counts_the_thinking_tokens(client):
    """usage.completion_tokens_details.reasoning_tokens (OpenAI's field, which vLLM fills
    with a reasoning parser): the /v1/responses usage had it, chat's did not (fuzz70)."""
    regex = r"<think>\nfirst [a-z]{2,6}\n</think>\n\nthe answer [a-z]{2,6}"
    response = ask(client, regex, n=2)
    reasoning = response.usage.completion_tokens_details.reasoning_tokens
    assert 0 < reasoning < response.usage.completion_tokens
    chunks = list(ask(client, regex, n=2, stream=True,
                      stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning
    plain = ask(client, r"plain [a-z]{2,6}", template=False)  # no <think>: no parser
    assert plain.usage.completion_tokens_details is None


def test_a_template_that_opens_the_thinking(client):
    """The answer starts as reasoning, and a grammar waits for its </think>: this random
    model never writes one, so the whole answer is free reasoning cut short by
    max_tokens. Without the opened <think> the same grammar holds from the first token."""
    regex = r"said [a-z]{2,6}"
    choice = ask(client, regex, opened=True, max_tokens=12).choices[0]
    # All thinking: no answer, null as vLLM's parsers give it ("" before; fuzz34)
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content and not choice.message.reasoning_content.startswith(
        "said "
    )
    plain = ask(client, regex).choices[0].message
    assert plain.content.startswith("said ") and getattr(plain, "reasoning_content", None) is None


def test_a_prefilled_answer_that_opened_its_thinking(client):
    """`continue_final_message` on "<think>\nLet me": what the model writes next is
    reasoning up to its </think> (vLLM's split), and a grammar waits for that. The prompt
    did not end with <think>, so the answer was all content, the grammar holding at once."""
    prefilled = [*MESSAGES, {"role": "assistant", "content": "<think>\nLet me"}]
    choice = ask(client, r"said [a-z]{2,6}", messages=prefilled, max_tokens=12,
                 extra_fields={"continue_final_message": True,
                               "add_generation_prompt": False}).choices[0]  # fmt: skip
    # All thinking: no answer, null as vLLM's parsers give it ("" before; fuzz34)
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning_content and "said " not in choice.message.reasoning_content


def test_tool_calls_come_from_the_answer_only(client):
    regex = (r'<think>\nmaybe <tool_call>\n</think>\n\n<tool_call>\n'
             r'\{"name": "get_time", "arguments": \{\}\}\n</tool_call>')  # fmt: skip
    choice = ask(client, regex, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "\nmaybe <tool_call>\n"
    assert [call.function.name for call in choice.message.tool_calls] == ["get_time"]
    reasoning, content, calls = collect(ask(client, regex, stream=True, tools=TOOLS))
    assert reasoning == "\nmaybe <tool_call>\n" and content == ""
    assert [call.function.name for call in calls] == ["get_time"]


def test_without_think_in_the_template_nothing_is_split(client):
    regex = r"<think>\nraw [a-z]{2,6}\n</think>\n\nkept"
    message = ask(client, regex, template=False).choices[0].message
    assert message.content.startswith("<think>\nraw ")
    assert getattr(message, "reasoning_content", None) is None


def test_responses_put_the_thinking_in_a_reasoning_item(client, http_base):
    """Streamed or not, every event and response validates against openai's types."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    regex = r"<think>\nponder [a-z]{2,6}\n</think>\n\nreply [a-z]{2,6}"
    body = {"model": MODEL_NAME, "input": "Weather in Paris?", "max_output_tokens": 60,
            "temperature": 0, "chat_template": THINKING_TEMPLATE,
            "structured_outputs": {"regex": regex}}  # fmt: skip
    response = httpx.post(http_base + "/v1/responses", json=body, timeout=60).json()
    Response.model_validate(response, strict=False)
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    thought = reasoning["content"][0]["text"]
    assert thought.startswith("\nponder ")
    assert message["content"][0]["text"].startswith("reply ")
    adapter = TypeAdapter(ResponseStreamEvent)
    deltas, done = "", None
    with httpx.stream("POST", http_base + "/v1/responses", json={**body, "stream": True},
                      timeout=60) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                adapter.validate_python(event)
                if event["type"] == "response.reasoning_text.delta":
                    deltas += event["delta"]
                elif event["type"] == "response.completed":
                    done = event["response"]
    assert deltas == thought
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == message["content"][0]["text"]
    # The tokens up to the one that ends </think> are the reasoning's (they were 0).
    usage = response["usage"]
    reasoning_tokens = usage["output_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens < usage["output_tokens"]
    assert done["usage"] == usage


# Qwen3's hybrid templates close an empty thinking when `enable_thinking` is false.
HYBRID_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
    "{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}"
)


def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off(http_base):
    """fuzz112: `reasoning_effort` (chat) and `reasoning.effort` (Responses) were ignored;
    vLLM renders the effort as a template variable and "none" as `enable_thinking: false`."""
    from openai.types.responses import Response

    def tokens(**fields) -> list[int]:
        body = {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": HYBRID_TEMPLATE,
                **fields}  # fmt: skip
        return httpx.post(http_base + "/tokenize", json=body, timeout=60).json()["tokens"]

    def prompt(**fields) -> str:
        detokenize = {"model": MODEL_NAME, "tokens": tokens(**fields)}
        return httpx.post(http_base + "/detokenize", json=detokenize, timeout=60).json()["prompt"]

    assert prompt().endswith("<|im_start|>assistant\n")
    assert prompt(reasoning_effort="none").endswith("assistant\n[none]<think>\n\n</think>\n\n")
    assert prompt(reasoning_effort="high").endswith("assistant\n[high]")
    kept = prompt(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert kept.endswith("assistant\n[none]")  # the request's own enable_thinking wins
    # the field over a template variable of its name, as vLLM merges them (fuzz115)
    both = prompt(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert both.endswith("assistant\n[low]")

    body = {"model": MODEL_NAME, "input": MESSAGES, "max_output_tokens": 4,
            "chat_template": HYBRID_TEMPLATE}  # fmt: skip
    for effort in ("none", "low"):
        reasoning = {"effort": effort, "summary": "auto"}
        answer = httpx.post(http_base + "/v1/responses", timeout=60,
                            json={**body, "reasoning": reasoning}).json()  # fmt: skip
        assert answer["usage"]["input_tokens"] == len(tokens(reasoning_effort=effort)), answer
        assert answer["reasoning"] == reasoning  # echoed, as OpenAI and vLLM do (fuzz115)
        Response.model_validate(answer, strict=False)
    for path, field, param in (("/v1/chat/completions", "reasoning_effort", "reasoning_effort"),
                               ("/v1/responses", "reasoning", "reasoning.effort"),
                               ("/v1/responses", "reasoning", "reasoning.summary")):  # fmt: skip
        value = {param.removeprefix("reasoning."): "extreme"} if "." in param else "extreme"
        refused = httpx.post(http_base + path, timeout=60, json={
            "model": MODEL_NAME, "messages": MESSAGES, "input": "hi", field: value})  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
