"""EventStreamResponse closes its body iterator however the response ends, so a client that
hangs up mid-send never leaves engine requests running until the garbage collector runs."""

from __future__ import annotations

import asyncio

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


async def _stream_to(send, timeout_s: float, chunks: int = 5) -> tuple[bool, float]:
    """Runs an EventStreamResponse with `write_timeout_s` into `send`; returns whether its
    body was closed and the seconds it took."""
    closed = asyncio.Event()

    async def body():
        try:
            for i in range(chunks):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    loop = asyncio.get_running_loop()
    start = loop.time()
    await EventStreamResponse(body(), write_timeout_s=timeout_s).stream_response(send)
    return closed.is_set(), loop.time() - start


def test_a_client_that_stops_reading_ends_the_stream_after_the_write_timeout() -> None:
    """A send stuck on TCP's flow control (the client reads nothing, every buffer full) held
    the request and its admission for as long as the client kept the connection."""
    sent = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == 3:
            await asyncio.Event().wait()  # the client stopped reading

    closed, seconds = asyncio.run(_stream_to(send, timeout_s=0.4))
    assert closed  # its engine requests are aborted, its ticket given back
    assert 0.4 <= seconds < 0.4 * 1.25 + 0.3  # checked every quarter of the timeout
    assert len(sent) == 3  # no more chunks, and no end of the response: uvicorn closes it


def test_a_slow_reader_that_keeps_taking_chunks_gets_the_whole_stream() -> None:
    """Each send waits less than the timeout, the stream as a whole much longer."""
    sent = []

    async def send(message: dict) -> None:
        await asyncio.sleep(0.15)
        sent.append(message)

    closed, seconds = asyncio.run(_stream_to(send, timeout_s=0.3, chunks=6))
    assert closed and seconds > 0.3
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert len(sent) == 8  # start, six chunks, end


def test_a_disconnect_is_still_a_cancel_with_a_write_timeout() -> None:
    async def run() -> bool:
        sending = asyncio.Event()

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                sending.set()
                await asyncio.Event().wait()

        async def body():
            yield "data: 0\n\n"

        response = EventStreamResponse(body(), write_timeout_s=30)
        task = asyncio.create_task(response.stream_response(send))
        await sending.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return True

    assert asyncio.run(run())
