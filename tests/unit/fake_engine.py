"""A scripted fake engine behind the real HTTP app, for the tests of the app's own behaviour
(tests/unit/test_app_fake_engine.py, test_app_settings.py and others)."""

from __future__ import annotations

import asyncio
import json

from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.protocol import ErrorInfo, FinishReason, Modality, Ready, RequestOutput, TokenLogprob
from server.app import build_app
from server.openai_replies import ChatCompletionChunk
from server.openai_replies import CompletionResponse as Completion
from server.settings import ServerSettings

SCRIPT = "The cat sat on the mat. 🎉 Done and done again and again."


class FakeEngine:
    """Emits the tokens of SCRIPT one per step; records requests and aborts."""

    def __init__(self, tokenizer_path: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.script = self.tokenizer.encode(SCRIPT, add_special_tokens=False).ids
        self.ready = Ready(
            model_name="tiny",
            max_model_len=256,
            vocab_size=1600,
            hidden_size=128,
            block_size=16,
            num_kv_blocks=64,
            eos_token_ids=[],
            modalities=[Modality.IMAGE],
            dtype="float32",
            device="cpu",
        )
        self.is_alive = True
        self.requests = []
        self.tensors = []
        self.aborted = []
        self.die_after: int | None = None
        self.fail_with: ErrorInfo | None = None  # refuse every request, as the engine does

    def add_stats_listener(self, callback) -> None:
        pass

    async def abort(self, request_ids) -> None:
        self.aborted.extend(request_ids)

    async def generate(self, request, tensors=(), *, tokens_per_wake=1):
        self.requests.append(request)
        self.tensors.append(list(tensors))
        if self.fail_with is not None:
            yield RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR,
                                error=self.fail_with)  # fmt: skip
            return
        finished = False
        try:
            for step in range(request.sampling.max_tokens):
                await asyncio.sleep(0)
                if self.die_after is not None and step >= self.die_after:
                    raise EngineDeadError("the engine died")
                token_id = self.script[step % len(self.script)]
                is_last = step == request.sampling.max_tokens - 1
                logprobs = None
                if request.sampling.logprobs is not None:
                    top = [(token_id, -0.5)] * request.sampling.logprobs
                    logprobs = [TokenLogprob(token_id, -0.5, top)]
                finished = is_last
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    logprobs=logprobs,
                    finish_reason=FinishReason.LENGTH if is_last else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                )
        finally:
            if not finished:
                self.aborted.append(request.request_id)


def client_for(model_dir, **settings):
    engine = FakeEngine(str(model_dir / "tokenizer.json"))
    config = ServerSettings(
        engine=EngineConfig(model=str(model_dir), served_model_name="tiny"),
        allow_private_media_urls=True,
        **settings,
    )
    return TestClient(build_app(config, engine)), engine


def chat(client, **body):
    payload = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return client.post("/v1/chat/completions", json=payload)


def sse_events(response):
    """The JSON events of an SSE response; each one must also be a valid instance of its
    OpenAI model (the chunks are encoded from plain dicts, so this keeps them honest)."""
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    for event in parsed:
        model = {"chat.completion.chunk": ChatCompletionChunk, "text_completion": Completion}
        if "error" not in event:
            model[event["object"]].model_validate(event)
    return parsed
