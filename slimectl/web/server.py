"""Binding and running slimectl's aiohttp servers (embedded engine, agent harness, rollout buffer).

Starting the site (port 0 picks a free port; a port bound earlier, :func:`reserve_port`), the URL it
answers on, and serving until SIGINT/SIGTERM (:func:`serving`, :func:`until_stopped`). The application
itself (token, body limit, error replies, bodies) is :mod:`slimectl.web.app`.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator

from aiohttp import web

from slimectl.contract.errors import UsageError
from slimectl.contract.signals import set_on_signals


async def start_site(app: web.Application, host: str, port: int,
                     sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns the runner and the bound port (``port`` 0: a free one).
    ``sock``: a socket :func:`reserve_port` bound to that address earlier, served as it is."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        if sock is not None:
            await web.SockSite(runner, sock).start()
            return runner, sock.getsockname()[1]
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, (runner.addresses[0][1] if port == 0 else port)


def reserve_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not yet listening, for a server that starts seconds later (an
    engine loading its model): from now on no other socket — an outgoing connection's ephemeral port
    included — can take the port its supervisor picked. Connections are refused until the server
    listens on it (:func:`start_site` with ``sock``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def http_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


@asynccontextmanager
async def serving(app: web.Application, host: str, port: int,
                  sock: socket.socket | None = None) -> AsyncIterator[int]:
    """Serve ``app`` (:func:`start_site`) inside the block, which gets the bound port; a port that cannot be
    bound is a :class:`~slimectl.contract.errors.UsageError` naming ``--port``."""
    try:
        runner, bound = await start_site(app, host, port, sock)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); pick another --port") from None
    try:
        yield bound
    finally:
        await runner.cleanup()


async def until_stopped(stop: asyncio.Event | None = None) -> None:
    """Return on SIGINT/SIGTERM, or once ``stop`` is set."""
    stop = stop or asyncio.Event()
    with set_on_signals(stop):
        await stop.wait()
