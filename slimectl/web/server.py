"""Plumbing shared by slimectl's aiohttp servers (embedded engine, agent harness, rollout buffer).

Each server keeps its own routes, error shapes and auth; what is the same everywhere lives here:
starting the site (port 0 picks a free port), the URL it answers on, reading a JSON body, and
checking a bearer token.
"""

from __future__ import annotations

import hmac
import json
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


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port``; returns the runner and the bound port (``port`` 0: a free one)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner, (runner.addresses[0][1] if port == 0 else port)


def http_url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def bearer_matches(request: web.Request, token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer TOKEN`` (compared in constant time)."""
    auth = request.headers.get("Authorization", "")
    return hmac.compare_digest(auth.encode(), f"Bearer {token}".encode())
