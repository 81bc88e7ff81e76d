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


def test_a_remembered_verdict_never_waits_for_the_check_threads(monkeypatch):
    """The lookup ran on the check threads: a cached schema waited 6.2 s behind 12 big
    uncached ones (fuzz57). Now it answers from the event loop with both threads busy."""
    release = threading.Event()
    busy = ThreadPoolExecutor(sampling_params.GRAMMAR_CHECK_THREADS)
    monkeypatch.setattr(sampling_params, "_grammar_checks", busy)
    monkeypatch.setattr(sampling_params, "_grammar_verdicts", sampling_params._GrammarVerdicts(8))
    known = chat_with_schema('{"type": "object", "properties": {"d": {}}}')

    async def main():
        await sampling_params.check_structured_output(known)  # remembered from now on
        blockers = [busy.submit(release.wait) for _ in range(sampling_params.GRAMMAR_CHECK_THREADS)]
        try:
            await asyncio.wait_for(sampling_params.check_structured_output(known), 5)
        finally:
            release.set()
            for blocker in blockers:
                blocker.result()

    asyncio.run(main())


def test_requests_with_one_new_schema_share_its_check_and_only_its_reason_is_kept(monkeypatch):
    """Each kept llguidance's whole message, which quotes the schema: 40 refused 4 MB
    schemas held 190 MiB of the API process for good (fuzz57); 500 characters go out."""
    import engine.structured_output

    calls = []
    monkeypatch.setattr(engine.structured_output, "grammar_error",
                        lambda spec: calls.append(spec) or "x" * 100_000)  # fmt: skip
    verdicts = sampling_params._GrammarVerdicts(8)
    monkeypatch.setattr(sampling_params, "_grammar_verdicts", verdicts)
    request = chat_with_schema('{"type": "object", "properties": {"e": {}}}')

    async def main():
        checks = [sampling_params.check_structured_output(request) for _ in range(5)]
        return await asyncio.gather(*checks, return_exceptions=True)

    errors = asyncio.run(main())
    assert len(calls) == 1 and all(isinstance(e, InvalidRequest) for e in errors)
    assert {len(e.detail) for e in errors} == {sampling_params.GRAMMAR_ERROR_CHARS}
    assert [len(v[0]) for v in verdicts._verdicts.values()] == [
        sampling_params.GRAMMAR_ERROR_CHARS
    ]
