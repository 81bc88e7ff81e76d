"""A request whose client may leave, or whose server may stop, while it works.

`unless_client_leaves` races a handler's work (preparing a prompt: fetching and decoding
media; collecting a non-streamed answer) against the client's disconnect and the drain's
end (`AdmissionController.stopping`). The work is cancelled when either comes first: a
client that left takes its fetches, queued decodes and engine request with it, and a
drain's deadline ends what is left with a 503 instead of uvicorn cutting it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

from server.admission import ServerDraining

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; `work` cancelled and ClientDisconnected raised if the client
    disconnects first, or ServerDraining if a drain ends what is left first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(wait_for_disconnect(request))
    stopping = request.app.state.admission.stopping()
    try:
        await asyncio.wait({task, watcher, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        if stopping.done():
            failure = request.app.state.admission.stop_failure
            raise failure or ServerDraining("the server shut down before this request finished")
        raise ClientDisconnected()
    return task.result()
