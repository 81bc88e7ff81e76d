"""EventStreamResponse closes its body iterator however the response ends, so a client that
hangs up mid-send never leaves engine requests running until the garbage collector runs."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from fastapi.responses import StreamingResponse

from server.streaming import EventStreamResponse


async def _cancel_while_sending(response_class: type[StreamingResponse]) -> bool:
    """Cancel `stream_response` while a chunk is being sent; returns whether the body
    generator was closed by the time the cancelled task finished."""
    closed = asyncio.Event()
    sending = asyncio.Event()

    async def body():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sending.set()
            await asyncio.Event().wait()  # a slow client: this send never completes

    response = response_class(body())
    task = asyncio.create_task(response.stream_response(send))
    await sending.wait()
    task.cancel()  # what Starlette does when the client disconnects
    with pytest.raises(asyncio.CancelledError):
        await task
    return closed.is_set()


def test_body_closed_when_cancelled_mid_send() -> None:
    assert asyncio.run(_cancel_while_sending(EventStreamResponse))
    # Starlette's own response leaves it suspended: the case this class exists for.
    assert not asyncio.run(_cancel_while_sending(StreamingResponse))


def test_media_type_is_event_stream() -> None:
    async def body():
        yield "data: [DONE]\n\n"

    headers = dict(EventStreamResponse(body()).raw_headers)
    assert headers[b"content-type"].startswith(b"text/event-stream")


def test_closing_a_batch_stream_mid_way_logs_no_error() -> None:
    """A batch's stream (its prompts interleaved) closed while they still ran: the loop's
    finalizer closed `guarded` as a task while `releasing` closed the stream under it,
    and asyncio logged "aclose(): asynchronous generator is already running" (fuzz44)."""
    from server.generation import interleave
    from server.request_lifecycle import releasing
    from server.streaming import guarded

    class Ticket:
        released = False

        def release(self) -> None:
            self.released = True

    async def job(i: int):
        while True:
            await asyncio.sleep(0.001)
            yield i

    async def stream():  # the shape of stream_completion over a batch
        jobs = interleave([guarded(job(0)), guarded(job(1))])
        async with contextlib.aclosing(jobs) as pieces:
            async for _ in pieces:
                yield b"data: x\n\n"

    async def run() -> list[dict]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(context)
        )
        ticket = Ticket()
        body = releasing(stream(), ticket)
        for _ in range(3):
            await anext(body)
        await body.aclose()  # what EventStreamResponse does when the client leaves
        await asyncio.sleep(0.1)
        assert ticket.released
        return errors

    assert asyncio.run(run()) == []
