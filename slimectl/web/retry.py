"""The one retry helper: call again on the named exceptions, with backoff, up to N attempts."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

#: ``on_retry(attempt, error, delay)``: called before sleeping ``delay`` s after failed attempt ``attempt`` (1-based).
OnRetry = Callable[[int, BaseException, float], None]


def exponential_backoff(base: float, cap: float = float("inf"), jitter: float = 0.0) -> Callable[[int], float]:
    """Delay after failed attempt ``n`` (1-based): ``min(base * 2**(n-1), cap)``, plus up to ``jitter`` of it at random."""
    def delay(attempt: int) -> float:
        d = min(base * 2 ** (attempt - 1), cap)
        return d + random.uniform(0, jitter * d) if jitter else d
    return delay


def _check(attempts: int) -> None:
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")


def retry_call(fn: Callable[[], T], *, attempts: int, retry_on: tuple[type[BaseException], ...],
               backoff: Callable[[int], float], on_retry: OnRetry | None = None,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, called again after an exception of a ``retry_on`` type, at most ``attempts`` times in
    all; the last such exception is re-raised when they are used up. Other exceptions pass at once."""
    _check(attempts)
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except retry_on as exc:
            if attempt == attempts:
                raise
            delay = backoff(attempt)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


async def retry_call_async(fn: Callable[[], Awaitable[T]], *, attempts: int,
                           retry_on: tuple[type[BaseException], ...], backoff: Callable[[int], float],
                           on_retry: OnRetry | None = None,
                           sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> T:
    """:func:`retry_call` for a coroutine function (the backoff awaits, it does not block the loop)."""
    _check(attempts)
    for attempt in range(1, attempts + 1):
        try:
            return await fn()
        except retry_on as exc:
            if attempt == attempts:
                raise
            delay = backoff(attempt)
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            await sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover
