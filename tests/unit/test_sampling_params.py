"""server/sampling_params.py: the grammar check of a request's structured output."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.errors import InvalidRequest
from server import sampling_params
from server.openai_models import ChatCompletionRequest


def chat_with_schema(schema: str) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "s", "schema": json.loads(schema)}},
    })  # fmt: skip


def test_grammar_checks_never_wait_for_the_default_pool():
    """The checks ran in asyncio's default pool, which also renders every chat prompt: a
    burst of large schemas held plain chats for seconds (fuzz53). With that pool's only
    thread busy, a check still answers."""

    async def main():
        loop = asyncio.get_running_loop()
        default = ThreadPoolExecutor(1)
        loop.set_default_executor(default)
        release = threading.Event()
        blocker = loop.run_in_executor(None, release.wait)
        try:
            request = chat_with_schema('{"type": "object", "properties": {"a": {}}}')
            await asyncio.wait_for(sampling_params.check_structured_output(request), 10)
        finally:
            release.set()
            await blocker

    asyncio.run(main())


def test_a_schema_checked_once_is_not_checked_again(monkeypatch):
    import engine.structured_output

    calls = []
    real = engine.structured_output.grammar_error
    monkeypatch.setattr(engine.structured_output, "grammar_error",
                        lambda spec: calls.append(spec) or real(spec))  # fmt: skip
    monkeypatch.setattr(sampling_params, "_grammar_verdicts", sampling_params._GrammarVerdicts(2))
    good = chat_with_schema('{"type": "object", "properties": {"b": {"type": "string"}}}')
    bad = chat_with_schema('{"type": "object", "properties": {"c": {"$ref": "#/nowhere"}}}')
    for _ in range(3):
        asyncio.run(sampling_params.check_structured_output(good))
        with pytest.raises(InvalidRequest, match="invalid response_format"):
            asyncio.run(sampling_params.check_structured_output(bad))
    assert len(calls) == 2  # one check each, the verdicts remembered, refusals included
    other = chat_with_schema('{"type": "array"}')
    asyncio.run(sampling_params.check_structured_output(other))  # evicts the oldest: good
    asyncio.run(sampling_params.check_structured_output(good))
    assert len(calls) == 4
