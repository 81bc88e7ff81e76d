"""One streamed chat completion against an OpenAI-compatible server, timed chunk by chunk.

The request is `POST {base_url}/v1/chat/completions` with `stream: true` and
`stream_options.include_usage`; the answer is server-sent events, `data: {json}` lines
ending with `data: [DONE]`. A *content chunk* is an event whose choices carry generated
output: a non-empty `delta.content`, `delta.reasoning_content` (vLLM also spells it
`reasoning`) or `delta.tool_calls`; a reasoning model's first token is its first reasoning
token. The role-only first chunk of the OpenAI format is not one. Token counts come from
the `usage` object (OpenAI sends it in a last chunk with no choices; some servers put it on
the finishing chunk, some never send it: then the content chunks are counted).
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp
import httpx
import msgspec

from bench.servers import TINY_MODEL_NAME
from bench.stats import RequestRecord

CHAT_PATH = "/v1/chat/completions"
MAX_ERROR_CHARS = 300
# The delta fields that carry generated tokens; "reasoning" is vLLM's newer name.
OUTPUT_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


def chat_body(
    model: str,
    content: tuple[dict[str, Any], ...],
    *,
    max_tokens: int,
    ignore_eos: bool,
    temperature: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streaming chat request; `extra` fields (e.g. a structured output) are merged in
    last."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": list(content)}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM / Tessera extension; others ignore or reject it
    return {**body, **(extra or {})}


class _StreamState:
    """Accumulates what one SSE stream has told us so far."""

    def __init__(self, start: float):
        self.start = start
        self.chunk_times: list[float] = []
        self.finish_time: float | None = None
        self.usage: dict[str, Any] | None = None
        self.is_done = False
        self.error: str | None = None

    def on_event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.is_done = True
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            return
        if event.get("error"):
            self.error = _short(json.dumps(event["error"]))
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if _has_output(choice.get("delta") or {}):
                self.chunk_times.append(now)
            if choice.get("finish_reason") is not None and self.finish_time is None:
                self.finish_time = now

    def record(self, end: float) -> RequestRecord:
        if self.error is not None:
            return RequestRecord(False, error=self.error)
        if not (self.is_done or self.finish_time is not None):
            return RequestRecord(False, error="stream ended before the answer finished")
        first = self.chunk_times[0] if self.chunk_times else (self.finish_time or end)
        itl = tuple(b - a for a, b in zip(self.chunk_times[:-1], self.chunk_times[1:], strict=True))
        usage = self.usage or {}
        num_output = usage.get("completion_tokens")
        return RequestRecord(
            is_success=True,
            ttft_s=first - self.start,
            e2e_s=end - self.start,
            itl_s=itl,
            num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
            num_output_tokens=int(num_output if num_output is not None else len(self.chunk_times)),
            has_usage=self.usage is not None,
        )


def _has_output(delta: dict[str, Any]) -> bool:
    return any(delta.get(field) for field in OUTPUT_DELTA_FIELDS)


class _LineSplitter:
    """Splits a byte stream into lines of any length. aiohttp's own line reader stops at
    512 KiB (LineTooLong), and one `prompt_logprobs` event of a long prompt is megabytes."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # the unfinished line, kept in pieces: no re-copying

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines `chunk` completes (without their newline)."""
        if b"\n" not in chunk:
            self._parts.append(chunk)
            return []
        lines = chunk.split(b"\n")
        if self._parts:
            lines[0] = b"".join([*self._parts, lines[0]])
        rest = lines.pop()
        self._parts = [rest] if rest else []
        return lines


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> RequestRecord:
    """Send one request and time its stream. Never raises for a failed request (only for
    cancellation): the failure is in the record. The body is encoded before the clock
    starts (~1 ms for one with a 448x448 image): the client's JSON is not the server's
    time to first token. aiohttp, not httpx, reads the stream: 24-26 against 60-64 us of
    client CPU a chunk against the tiny server (docs/benchmarks.md), which at 128 streams
    is what a one-process client falls behind by."""
    payload = msgspec.json.encode(body)
    request_headers = {**headers, "Content-Type": "application/json"}
    start = time.perf_counter()
    state = _StreamState(start)
    try:
        async with session.post(url, data=payload, headers=request_headers) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                return RequestRecord(False, error=_short(f"HTTP {response.status}: {text}"))
            await _read_events(response, state)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return RequestRecord(False, error=_short(f"{type(exc).__name__}: {exc}"))
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
        return RequestRecord(False, error=_short(f"malformed stream: {exc}"))
    except Exception as exc:  # a request's failure ends in its record, never the whole run
        return RequestRecord(False, error=_short(f"client error: {type(exc).__name__}: {exc}"))
    return state.record(time.perf_counter())


async def _read_events(response: aiohttp.ClientResponse, state: _StreamState) -> None:
    """Feed the stream's `data:` lines to `state` until it is done or failed."""
    lines = _LineSplitter()
    async for chunk in response.content.iter_any():
        if _on_lines(state, lines.feed(chunk)):
            return
    _on_lines(state, lines.feed(b"\n"))  # a last line with no newline


def _on_lines(state: _StreamState, lines: list[bytes]) -> bool:
    """Feed the `data:` lines to `state`; True once the stream is done or failed. Each event
    is stamped when it is handled, as with aiohttp's line reader before: events that came
    in one network read get increasing times, not one shared time (zero ITL gaps)."""
    for line in lines:
        if line.startswith(b"data:"):
            state.on_event(line[5:].decode().strip(), time.perf_counter())
            if state.error is not None or state.is_done:
                return True
    return False


def stream_times(
    http: httpx.Client, content: list[dict[str, Any]], max_tokens: int, model: str = TINY_MODEL_NAME
) -> list[float]:
    """A greedy streamed chat request sent from a thread (the small benchmarks): the
    perf_counter at the send, then at each content chunk. Raises on an error status, an
    error event in the stream, or a stream that ends before the answer finished: a failed
    request must never pass for a fast one."""
    body = chat_body(model, tuple(content), max_tokens=max_tokens, ignore_eos=True,
                     temperature=0.0)  # fmt: skip
    state = _StreamState(time.perf_counter())
    with http.stream("POST", CHAT_PATH, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:"):
                state.on_event(line[5:].strip(), time.perf_counter())
    record = state.record(time.perf_counter())
    if not record.is_success:
        raise RuntimeError(f"streamed request failed: {record.error}")
    return [state.start, *state.chunk_times]
