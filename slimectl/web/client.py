"""The synchronous JSON-over-HTTP helper (stdlib, never through a proxy): requests and status probes."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

from slimectl.web.errors import HttpError, refusal_message

# Engines, buffers and harnesses are on our own network: http_proxy & co would only break
# loopback and cluster-internal URLs (the aiohttp clients ignore them too).
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request_json(method: str, url: str, body: Any = None, *, path: str = "", token: str | None = None, timeout: float = 30.0,
                 what: str = "server", hint: str = "", error: type[HttpError] = HttpError,
                 expect_json: bool = True) -> Any:
    """``METHOD url+path`` with ``body`` as JSON (and ``Authorization: Bearer token``); the answer parsed
    as JSON (None when empty), or its text with ``expect_json=False``.

    Every failure raises ``error`` (an :class:`HttpError`) with a one-line message naming ``what``
    and ``url``: an error status (``.status`` set); no answer (``hint`` is appended, e.g. "is it
    running?"), a timeout, or a body that is not JSON (``.status`` None for these three).
    """
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode("utf-8") if body is not None else None
    try:
        req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    except ValueError as exc:  # not a URL at all
        raise error(f"{what} URL {url!r} is not valid ({exc})", url=url) from None
    try:
        with _NO_PROXY_OPENER.open(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise error(refusal_message(what, url, method, path, exc.code, exc.read()), status=exc.code, url=url) from None
    except (TimeoutError, socket.timeout):
        raise error(f"{what} {url}: {method} {path}".rstrip() + f" timed out after {timeout:g} s", url=url) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise error(f"{what} {url}: {method} {path}".rstrip() + f" timed out after {timeout:g} s", url=url) from None
        raise error(f"cannot reach the {what} at {url} ({reason}){'; ' + hint if hint else ''}", url=url) from None
    return decode_body(raw, expect_json, what=what, url=url, method=method, path=path, error=error)


def decode_body(raw: bytes, expect_json: bool, *, what: str, url: str, method: str, path: str,
                error: type[HttpError] = HttpError, status: int | None = None) -> Any:
    """A successful answer's body: parsed JSON (None when empty), or its text with ``expect_json=False``;
    a body that is not JSON raises ``error`` naming ``what``, ``url`` and the request (both HTTP clients)."""
    if not expect_json:
        return raw.decode("utf-8", errors="replace")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise error(f"{what} {url}: {method} {path}".rstrip() + f" returned non-JSON: {raw[:200]!r}",
                    status=status, url=url) from None


def http_status(url: str, timeout: float) -> int | None:
    """GET ``url`` (never through a proxy); the HTTP status, or None when nothing answered."""
    try:
        with _NO_PROXY_OPENER.open(urllib.request.Request(url, method="GET"), timeout=timeout) as r:
            r.read(1 << 16)
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def probe_url(url: str, timeout: float) -> str:
    """``ok`` when GET ``url`` answers 200, else a short reason (``http 503``, ``unreachable (...)``)."""
    try:
        with _NO_PROXY_OPENER.open(urllib.request.Request(url, method="GET"), timeout=timeout) as resp:
            return "ok" if resp.status == 200 else f"http {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"http {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"unreachable ({reason})"
