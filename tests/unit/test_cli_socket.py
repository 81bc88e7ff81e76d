"""The server's own socket (server/cli.py `bind_port`): accepted connections must get
TCP_NODELAY, as uvicorn's own sockets do."""

from __future__ import annotations

import asyncio
import socket

from server.cli import bind_port


def test_connections_accepted_on_the_bound_port_do_not_wait_for_nagle():
    """A socket made without naming IPPROTO_TCP has proto 0, and asyncio then leaves
    TCP_NODELAY off its connections: every small response waited ~40 ms for the client's
    delayed ACK (GET /health 44 ms against 0.5 ms)."""
    bound = bind_port("127.0.0.1", 0)
    port = bound.getsockname()[1]
    nodelay: list[int] = []

    async def scenario() -> None:
        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted = writer.get_extra_info("socket")
            nodelay.append(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=bound)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if nodelay:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(scenario())
    assert nodelay and nodelay[0] != 0
