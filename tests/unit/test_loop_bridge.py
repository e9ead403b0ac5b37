"""LoopBridge (contract/loop_bridge.py): `slimectl rl`'s one event loop, which every synchronous caller hands its
coroutines to, from any thread; and the only place in the library that drives a loop from synchronous code."""

from __future__ import annotations

import _thread
import asyncio
import threading
import time

import pytest

from slimectl.contract.loop_bridge import LoopBridge
from tests.helpers import ROOT


def test_two_threads_run_side_by_side_on_one_loop():
    bridge = LoopBridge()
    seen, both_in = [], threading.Barrier(2, timeout=10)

    async def meet(name: str) -> str:
        seen.append(asyncio.get_running_loop())
        await asyncio.get_running_loop().run_in_executor(None, both_in.wait)  # both coroutines in flight at once
        return name

    try:
        other = []
        t = threading.Thread(target=lambda: other.append(bridge.run(meet("thread"))))
        t.start()
        assert bridge.run(meet("main")) == "main"
        t.join(10)
        assert other == ["thread"] and len(seen) == 2 and seen[0] is seen[1] is bridge.loop
    finally:
        bridge.close()
    bridge.close()  # idempotent
    assert bridge.loop.is_closed()
    with pytest.raises(RuntimeError, match="after close"):
        bridge.run(asyncio.sleep(0))


def test_a_call_cancels_what_it_left_running_and_only_that():
    bridge = LoopBridge()
    mine, theirs, release = [], [], threading.Event()

    async def leaves_tasks() -> int:
        async def child():
            mine.append(asyncio.create_task(asyncio.sleep(60)))  # a grandchild, started by the call's child
            await asyncio.sleep(60)

        mine.append(asyncio.create_task(child()))
        await asyncio.sleep(0.01)
        return 7

    async def keeps_running() -> None:
        theirs.append(asyncio.create_task(asyncio.sleep(60)))
        await asyncio.get_running_loop().run_in_executor(None, release.wait)

    other = threading.Thread(target=lambda: bridge.run(keeps_running()))
    try:
        other.start()
        while not theirs:
            time.sleep(0.01)
        assert bridge.run(leaves_tasks()) == 7
        assert len(mine) == 2 and all(t.cancelled() for t in mine)
        assert not theirs[0].done()  # another call's task, still in flight, is left alone
        with pytest.raises(ValueError, match="boom"):
            bridge.run(_raises())
    finally:
        release.set()
        other.join(10)
        bridge.close()
    assert theirs[0].cancelled()  # cancelled when its own call ended


async def _raises() -> None:
    raise ValueError("boom")


def test_an_interrupted_caller_cancels_its_coroutine_and_waits_for_it():
    bridge = LoopBridge()
    cleaned = []

    async def long_request() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # the coroutine's own cleanup (an abort request) runs whole
            cleaned.append(True)

    timer = threading.Timer(0.2, _thread.interrupt_main)  # Ctrl-C in the main thread while it waits
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bridge.run(long_request())
        assert cleaned == [True]
        assert bridge.run(asyncio.sleep(0, "still serving")) == "still serving"

        async def nested():
            return bridge.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="on its own loop"):
            bridge.run(nested())
    finally:
        timer.cancel()
        bridge.close()


def test_the_bridge_is_the_only_code_that_drives_a_loop_from_synchronous_code():
    """No ``run_until_complete`` and no loop of its own anywhere else in the library (``asyncio.run`` starts the
    loop of a command that is async throughout)."""
    drivers = {str(p.relative_to(ROOT)) for p in (ROOT / "slimectl").rglob("*.py")
               if any(s in p.read_text() for s in ("run_until_complete", "new_event_loop(", "run_forever("))}
    assert drivers <= {"slimectl/contract/loop_bridge.py"}, drivers
