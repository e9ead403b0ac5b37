"""An engine binds its port before it loads its model (slimectl.web.server.reserve_port): from then on no
other socket can take the port its supervisor picked, and the server later serves on that very socket."""

from __future__ import annotations

import asyncio
import errno
import socket
import urllib.request

import pytest
from aiohttp import web

from slimectl.web.server import reserve_port, start_site


def test_a_reserved_port_cannot_be_taken_and_is_served_later():
    sock = reserve_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        other = socket.socket()
        with pytest.raises(OSError) as err:  # what an outgoing connection's autobind or another server would hit
            other.bind(("127.0.0.1", port))
        other.close()
        assert err.value.errno == errno.EADDRINUSE
        with pytest.raises(ConnectionRefusedError):  # bound, not listening: refused until the server starts
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

        async def main():
            app = web.Application()
            app.router.add_get("/health", lambda request: web.Response(text="ok"))
            runner, bound = await start_site(app, "127.0.0.1", port, sock=sock)
            try:
                body = await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read())
            finally:
                await runner.cleanup()
            return bound, body

        bound, body = asyncio.run(main())
        assert (bound, body) == (port, b"ok")
    finally:
        sock.close()


def test_reserving_a_port_in_use_fails():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(OSError):
            reserve_port("127.0.0.1", holder.getsockname()[1]).close()
    finally:
        holder.close()
