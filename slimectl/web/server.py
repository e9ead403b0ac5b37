"""Plumbing shared by slimectl's aiohttp servers (embedded engine, agent harness, rollout buffer).

Each server keeps its own routes, error shapes and auth; what is the same everywhere lives here:
starting the site (port 0 picks a free port), the URL it answers on, reading a JSON body, and
checking a bearer token.
"""

from __future__ import annotations

import hmac
import json
import socket
from typing import Any

from aiohttp import web


class InvalidJSON(ValueError):
    """The request body is not JSON (the message says why, for a 400 reply)."""


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def request_json(request: web.Request, allow_nan: bool = True) -> Any:
    """The request body parsed as JSON; ``None`` when the body is empty. ``allow_nan=False``
    refuses the ``NaN``/``Infinity`` tokens Python's parser otherwise accepts."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw) if allow_nan else json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidJSON(f"request body is not valid JSON ({exc})") from None


async def start_site(app: web.Application, host: str, port: int,
                     sock: socket.socket | None = None) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns the runner and the bound port (``port`` 0: a free one).
    ``sock``: a socket :func:`reserve_port` bound to that address earlier, served as it is."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    if sock is not None:
        await web.SockSite(runner, sock).start()
        return runner, sock.getsockname()[1]
    await web.TCPSite(runner, host, port, reuse_address=True).start()
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


def bearer_matches(request: web.Request, token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer TOKEN`` (compared in constant time)."""
    auth = request.headers.get("Authorization", "")
    return hmac.compare_digest(auth.encode(), f"Bearer {token}".encode())
