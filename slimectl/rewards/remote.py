"""A reward model behind HTTP (``rm_type="remote"``, alias slime's ``remote_rm``).

Protocol (the same as slime's ``rm_hub.remote_rm``)::

    POST <url>
    Content-Type: application/json
    {"prompt": <sample.prompt>, "response": <sample.response>, "label": <sample.label>}

    200 -> a JSON number (the reward) or a JSON object (pick the scalar with ``reward_key``)

``prompt`` is whatever the sample holds (a string or a list of chat messages); ``label`` is any
JSON value (null when the sample has none).

Failures: connection errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff
(``backoff_base * 2**(attempt-1)`` seconds, capped at ``backoff_max``, plus up to 10 % jitter) up to
``max_retries`` attempts in all; any other HTTP error, a body that is not JSON, or JSON that is
neither a number nor an object fails at once. Every failure is a :class:`RemoteRewardError` whose
one-line message names the URL. At most ``concurrency`` requests are in flight per client
(an ``asyncio.Semaphore`` plus the connection pool limit); waiting for backoff holds no slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from slimectl.web.retry import exponential_backoff, retry_call_async

from .errors import RemoteRewardError, RewardConfigError, one_line

log = logging.getLogger("slimectl.rewards.remote")

_RETRY_STATUS = frozenset({429}) | frozenset(range(500, 600))


class _Retryable(Exception):
    """A failure worth another attempt (already described)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteRewardModel:
    """``async with RemoteRewardModel(url) as rm: reward = await rm.score(prompt, response, label)``.

    The aiohttp session is created lazily on the running event loop (and re-created if the client
    is used from a new loop); call :meth:`close` (or use ``async with``) when done.
    """

    def __init__(self, url: str, *, timeout: float = 120.0, max_retries: int = 10, backoff_base: float = 1.0,
                 backoff_max: float = 30.0, concurrency: int = 64, headers: dict[str, str] | None = None):
        if not url or not str(url).startswith(("http://", "https://")):
            raise RewardConfigError(f"remote reward model URL {url!r} must start with http:// or https://")
        if max_retries < 1 or concurrency < 1:
            raise ValueError("max_retries and concurrency must be >= 1")
        self.url = str(url)
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff_base = float(backoff_base)
        self.backoff_max = float(backoff_max)
        self.concurrency = int(concurrency)
        self.headers = dict(headers or {})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None

    async def __aenter__(self) -> "RemoteRewardModel":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        session, self._session, self._loop, self._slots = self._session, None, None, None
        if session is not None and not session.closed:
            await session.close()

    def _ensure(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._loop = loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self.headers,
            )
            self._slots = asyncio.Semaphore(self.concurrency)
        assert self._slots is not None
        return self._session, self._slots

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return exponential_backoff(self.backoff_base, self.backoff_max, jitter=0.1)(attempt)

    async def _attempt(self, session: aiohttp.ClientSession, payload: dict) -> Any:
        try:
            async with session.post(self.url, json=payload) as resp:
                if resp.status >= 400:
                    body = one_line(await resp.text(errors="replace"), 200)
                    if resp.status in _RETRY_STATUS:
                        raise _Retryable(f"HTTP {resp.status}: {body}", resp.status)
                    raise RemoteRewardError(
                        f"remote reward model {self.url} rejected the request: HTTP {resp.status}: {body}",
                        url=self.url, status=resp.status)
                raw = await resp.read()
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            raise _Retryable(one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)) from e
        except aiohttp.ClientError as e:
            raise RemoteRewardError(f"remote reward model {self.url}: {one_line(f'{type(e).__name__}: {e}')}",
                                    url=self.url) from e
        try:
            value = json.loads(raw)
        except ValueError:
            snippet = one_line(raw[:200].decode(errors="replace"))
            raise RemoteRewardError(f"remote reward model {self.url} answered with non-JSON: {snippet}",
                                    url=self.url) from None
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            raise RemoteRewardError(
                f"remote reward model {self.url} answered {one_line(repr(value), 120)}; expected a number or "
                "a JSON object", url=self.url)
        return value

    async def score(self, prompt: Any, response: Any, label: Any = None) -> float | dict:
        """POST one ``{"prompt", "response", "label"}`` and return the server's number or object."""
        payload = {"prompt": prompt, "response": response, "label": label}
        session, slots = self._ensure()

        async def attempt() -> Any:
            async with slots:
                return await self._attempt(session, payload)

        def on_retry(n: int, exc: BaseException, delay: float) -> None:
            log.info("remote reward model %s: %s; retry %d/%d in %.2fs", self.url, exc, n, self.max_retries - 1, delay)

        try:
            return await retry_call_async(attempt, attempts=self.max_retries, retry_on=(_Retryable,),
                                          backoff=self.backoff, on_retry=on_retry)
        except _Retryable as last:
            raise RemoteRewardError(f"remote reward model {self.url} failed after {self.max_retries} attempts: {last}",
                                    url=self.url, status=last.status) from None
        except TypeError as e:  # json= could not serialise the payload
            raise RemoteRewardError(f"remote reward model {self.url}: request body is not JSON-serialisable: "
                                    f"{one_line(e)}", url=self.url) from None


_shared: dict[str, RemoteRewardModel] = {}


def shared_remote(url: str) -> RemoteRewardModel:
    """One client per URL for the whole process (slime keeps one shared session the same way)."""
    client = _shared.get(url)
    if client is None:
        client = _shared[url] = RemoteRewardModel(url)
    return client


async def close_shared_remotes() -> None:
    """Close the clients made by :func:`shared_remote` (call before the event loop ends)."""
    clients = list(_shared.values())
    _shared.clear()
    for c in clients:
        await c.close()
