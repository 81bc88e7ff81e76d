"""/tokenize on a chat (`messages`) as vLLM's: `add_special_tokens` defaults to false there
(true on a prompt) and true puts the tokenizer's specials (a Llama BOS) around what the
template wrote; a null field is its default; an empty chat is a clear 400, as on the chat
route. Against the scripted fake engine: /v1/chat/completions shows the tokens it feeds."""

from __future__ import annotations

import json

import pytest

from tests.unit.fake_engine import chat, client_for

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def served(request, tmp_path_factory):
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), size=request.param)
    client, engine = client_for(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    bos = config.get("bos_token")
    with client:
        yield client, engine, [] if bos is None else [engine.tokenizer.token_to_id(bos)]


def tokens(client, **body) -> list[int]:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_add_special_tokens_on_a_chat_defaults_to_false_and_true_adds_them(served):
    """Before, the field was ignored on a chat: true gave no BOS on tiny-llama."""
    client, engine, bos = served
    assert chat(client, messages=HI, max_tokens=1).status_code == 200
    fed = list(engine.requests[-1].prompt_token_ids)
    assert tokens(client, messages=HI, add_special_tokens=True) == [*bos, *fed]
    assert tokens(client, messages=HI) == fed
    assert tokens(client, messages=HI, add_special_tokens=False) == fed
    assert tokens(client, messages=HI, add_special_tokens=None) == fed
    # A prompt keeps vLLM's other default: the tokenizer's specials unless asked not to.
    plain = tokens(client, prompt="hi", add_special_tokens=False)
    assert tokens(client, prompt="hi") == [*bos, *plain]
    assert tokens(client, prompt="hi", add_special_tokens=None) == [*bos, *plain]
    assert tokens(client, prompt="hi", add_special_tokens=True) == [*bos, *plain]


def test_a_null_add_generation_prompt_is_its_default(served):
    """`add_generation_prompt` is `bool | None`, None meaning "unless continuing the last
    message": a null is the omitted field on /tokenize as on the chat (already so)."""
    client, _, _ = served
    prefilled = [*HI, {"role": "assistant", "content": "ok"}]
    for messages, extra in ((HI, {}), (prefilled, {"continue_final_message": True})):
        omitted = tokens(client, messages=messages, **extra)
        assert tokens(client, messages=messages, add_generation_prompt=None, **extra) == omitted
    assert tokens(client, messages=HI) == tokens(client, messages=HI, add_generation_prompt=True)
    continued = {"messages": prefilled, "continue_final_message": True}
    assert tokens(client, **continued) == tokens(client, **continued, add_generation_prompt=False)


def test_an_empty_chat_is_a_clear_400_on_tokenize_and_chat(served):
    """Before: pydantic's "List should have at least 1 item after validation, not 0"."""
    client, _, _ = served
    for response in (client.post("/tokenize", json={"messages": []}), chat(client, messages=[])):
        assert response.status_code == 400
        assert response.json() == {"error": {
            "message": "invalid value for 'messages': at least one message is needed",
            "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}}  # fmt: skip
