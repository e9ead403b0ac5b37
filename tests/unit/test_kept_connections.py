"""KeptConnections (engines/client.py): `slimectl rl` keeps one loop and one keep-alive session per
engine between rollouts, so rollout N+1 reuses rollout N's connections instead of opening one per
request; a connection the engine closed while the loop sat idle is never picked for a request."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp import web

from slimectl.engines.client import EngineClient, KeptConnections
from slimectl.engines.pool import EnginePool


class Server:
    """A /generate stub in its own thread; records each request's client port (its connection)."""

    def __init__(self, keepalive_timeout: float = 75.0):
        self.ports: list[int] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def generate(request: web.Request) -> web.Response:
            self.ports.append(request.transport.get_extra_info("peername")[1])
            await asyncio.sleep(0.01)  # the requests of one "rollout" overlap
            return web.json_response({"text": "", "output_ids": [1], "meta_info": {}})

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/generate", generate)
            self.runner = web.AppRunner(app, keepalive_timeout=keepalive_timeout)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()

        self.thread = threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                                       daemon=True)
        self.thread.start()
        ready.wait(10)

    def take_ports(self) -> set[int]:
        ports, self.ports = set(self.ports), []
        return ports

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


async def _rollout(url: str, connections, n: int = 8) -> None:
    """What a rollout does with the pool: n concurrent /generate calls, then close the pool."""
    pool = EnginePool([url], connections=connections)
    try:
        await asyncio.gather(*(pool.generate(input_ids=[1, 2], sampling_params={}) for _ in range(n)))
    finally:
        await pool.close()


def test_a_later_rollout_reuses_the_connections_of_the_earlier_one(server):
    kept = KeptConnections()
    try:
        kept.run(_rollout(server.url, kept))
        first = server.take_ports()
        kept.run(_rollout(server.url, kept))
        second = server.take_ports()
    finally:
        kept.close()
    assert len(first) > 1  # concurrent requests: several connections
    assert second <= first  # all reused, none opened
    # without kept connections every rollout opens its own
    asyncio.run(_rollout(server.url, None))
    assert not server.take_ports() & first


def test_connections_the_engine_closed_while_idle_are_not_used():
    server = Server(keepalive_timeout=0.2)  # the engine drops idle connections after 0.2 s
    kept = KeptConnections()
    try:
        kept.run(_rollout(server.url, kept))
        first = server.take_ports()
        threading.Event().wait(0.6)  # the loop is idle (training): the engine closes them meanwhile

        async def no_retries() -> None:  # a stale connection would fail a request outright here
            client = EngineClient(server.url, retries=0, session=kept.session(server.url))
            await asyncio.gather(*(client.generate(input_ids=[1]) for _ in range(8)))

        kept.run(no_retries())
        assert server.take_ports().isdisjoint(first)
    finally:
        kept.close()
        server.stop()


def test_run_cancels_what_the_coroutine_left_behind_and_close_is_idempotent():
    kept = KeptConnections()
    left: list[asyncio.Task] = []

    async def leaves_a_task() -> int:
        left.append(asyncio.get_running_loop().create_task(asyncio.sleep(60)))
        return 7

    assert kept.run(leaves_a_task()) == 7
    assert left[0].cancelled()
    kept.close()
    kept.close()
    assert kept.bridge.loop.is_closed()  # its own bridge, closed with it
