"""The one bridge from synchronous code to async code: :class:`LoopBridge`, one event loop on a thread of
its own, to which any thread hands a coroutine and waits for its result (:meth:`LoopBridge.run`).

``slimectl rl`` is synchronous where it must be (the trainer, the locks, the signal handling) and async where
it talks to engines (the rollouts, the weight transports, the engines' memory calls). Its session owns one
bridge, and everything async in the process runs on that one loop: the rollouts (this thread's, the
one-step-off thread's, the fully async follower's), the syncs, the evals. Two threads' coroutines run on it
side by side (a sync while the follower generates), and a kept HTTP session serves every one of them.
A command that is async throughout starts with ``asyncio.run`` instead; this module is the only place in
slimectl that drives a loop from synchronous code (``tests/unit/test_loop_bridge.py`` checks it).

Stdlib only.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from typing import Any, Awaitable, TypeVar

T = TypeVar("T")

_CALL: contextvars.ContextVar[weakref.WeakSet | None] = contextvars.ContextVar("slimectl_bridge_call", default=None)
"""The tasks started on behalf of one :meth:`LoopBridge.run` (set in its coroutine's context; every task it
starts, and theirs, inherits it)."""


def _task_factory(loop: asyncio.AbstractEventLoop, coro, **kw: Any) -> asyncio.Task:
    """The loop's tasks, each recorded with the call that started it."""
    task = asyncio.Task(coro, loop=loop, **kw)
    ctx = kw.get("context")
    call = ctx.get(_CALL) if ctx is not None else _CALL.get()
    if call is not None:
        call.add(task)
    return task


async def _call(coro: Awaitable[T]) -> T:
    """``coro``, then the tasks it started and left running cancelled (as ``asyncio.run`` ends)."""
    started: weakref.WeakSet = weakref.WeakSet()
    _CALL.set(started)
    try:
        return await coro
    finally:
        left = [t for t in started if not t.done()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)


class LoopBridge:
    """One event loop, run on a daemon thread started at the first :meth:`run`; closed by :meth:`close`."""

    def __init__(self, name: str = "slimectl-loop"):
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(_task_factory)
        self._name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _started(self) -> None:
        with self._lock:
            if self.loop.is_closed():
                raise RuntimeError("LoopBridge.run after close()")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the loop and return its result (or raise its exception), from any thread but the
        loop's own, as ``asyncio.run`` would: the tasks it started and left running are cancelled before this
        returns. Interrupted while it waits (KeyboardInterrupt in the main thread), the coroutine is cancelled
        and waited for, then the interruption goes on."""
        try:
            if threading.current_thread() is self._thread:
                raise RuntimeError("LoopBridge.run from a coroutine on its own loop (await the coroutine instead)")
            self._started()
        except RuntimeError:
            if asyncio.iscoroutine(coro):
                coro.close()  # never to run
            raise
        done = threading.Event()
        box: dict[str, asyncio.Task] = {}

        def start() -> None:
            box["task"] = task = self.loop.create_task(_call(coro))
            task.add_done_callback(lambda _: done.set())

        self.loop.call_soon_threadsafe(start)
        try:
            done.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(lambda: box["task"].cancel())  # (after start: the loop keeps their order)
            done.wait()
            raise
        return box["task"].result()

    def close(self) -> None:
        """Finish the loop's async generators and default executor, stop it and close it (idempotent)."""
        if self.loop.is_closed():
            return
        try:
            if self._thread is not None:
                self.run(self.loop.shutdown_asyncgens())
                self.run(self.loop.shutdown_default_executor())
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
        finally:
            with self._lock:
                self.loop.close()
