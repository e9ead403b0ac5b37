"""The engines of a run as one load-balanced pool of clients, with failover.

:class:`EnginePool` sends each request to the live engine with the fewest requests in flight
(at most ``concurrency_per_engine`` per engine). A connection failure marks that engine dead
and the request is retried on another one; only when every engine is dead does a request
fail (a rollout then publishes nothing).

With a ``router`` (the sglang-router ``serve`` started with ``engine.router: true``) every
``/generate`` goes through it and it balances; weight versions and aborts still go to each engine
(the router does not forward them). If the router fails (no answer, or a 5xx), the pool logs it once
and sends this and later requests to the engines directly.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator

from slimectl.contract.errors import SlimectlError
from slimectl.engines.client import EngineClient, EngineError

log = logging.getLogger("slimectl.rollout")  # its users' logger: the rollout's (and the harness's) engine failures

POLICY_ADAPTER = "policy"
"""The name a LoRA run's engines hold its adapter under (``/load_lora_adapter``'s ``lora_name``) and every
rollout request asks for (``lora_path`` in ``/generate``)."""


class EnginePool:
    """``registry`` (the run's :class:`~slimectl.contract.rundir.registry.EngineRegistry`) lets the
    pool say that an engine's *process* died, and where its log is, instead of only that it stopped
    answering. Each engine's failure is reported once, however many requests were in flight."""

    def __init__(self, urls: list[str], token: str | None = None, concurrency_per_engine: int = 64,
                 timeout: float = 600.0, registry=None, router: str | None = None, connections=None,
                 lora_path: str | None = None):
        """``connections``: a :class:`~slimectl.engines.client.KeptConnections` whose sessions the
        clients use (kept open after :meth:`close`); None: each client opens and closes its own.
        ``lora_path``: the adapter every ``/generate`` asks for (a LoRA run's :data:`POLICY_ADAPTER`)."""
        if not urls:
            raise SlimectlError("no engines registered; start them with `slimectl serve -r RUN` or pass --engine-url")
        self.router = router.rstrip("/") if router else None
        self.lora_path = lora_path

        def session(url: str):
            return connections.session(url) if connections is not None else None

        # the router only forwards /generate, which engines serve without the admin token
        self.router_client = EngineClient(self.router, timeout=timeout, retries=1, backoff=0.2,
                                          retry_log_level=logging.DEBUG, session=session(self.router)) \
            if self.router else None
        self.router_sem = asyncio.Semaphore(concurrency_per_engine * len(urls))
        self.router_requests = 0
        self.clients = {u: EngineClient(u, token=token, timeout=timeout, retries=1, backoff=0.2,
                                        retry_log_level=logging.DEBUG, session=session(u)) for u in urls}
        self.inflight = {u: 0 for u in urls}
        self.sems = {u: asyncio.Semaphore(concurrency_per_engine) for u in urls}
        self.dead: set[str] = set()
        self.why: dict[str, str] = {}
        self.requests = {u: 0 for u in urls}
        self.registry = registry

    def alive(self) -> list[str]:
        return [u for u in self.clients if u not in self.dead]

    def _pick(self) -> str:
        alive = self.alive()
        if not alive:
            why = "; ".join(self.why.get(u, u) for u in self.clients)
            raise EngineError(f"every engine failed ({why}); check `slimectl status` and the engine logs")
        return min(alive, key=lambda u: (self.inflight[u], self.requests[u]))

    def _describe_failure(self, url: str, exc: BaseException) -> str:
        """'engine ID at URL: its process (pid N) died; its log: PATH', or the connection error."""
        rec = None
        if self.registry is not None:
            try:
                rec = next((r for r in self.registry.list() if r.url.rstrip("/") == url.rstrip("/")), None)
            except (OSError, SlimectlError):
                rec = None
        if rec is not None and rec.alive() is False:
            where = rec.extra.get("log") if isinstance(rec.extra, dict) else None
            return (f"engine {rec.id} at {url}: its process (pid {rec.pid}) died"
                    + (f"; its log: {where}" if where else ""))
        return f"engine {url}: {exc}"

    def mark_dead(self, url: str, exc: BaseException) -> None:
        """Take ``url`` out of the pool, saying why once (later failures of requests already in
        flight there are only logged at DEBUG)."""
        if url in self.dead:
            log.debug("engine %s: another request in flight failed (%s)", url, exc)
            return
        self.dead.add(url)
        self.why[url] = self._describe_failure(url, exc)
        rest = len(self.alive())
        log.warning("%s; %s", self.why[url],
                    f"retrying its requests on the {rest} other engine(s)" if rest else "no engine left")

    @asynccontextmanager
    async def _on(self, url: str):
        """One request on engine ``url``: counted in flight, within its concurrency."""
        self.inflight[url] += 1
        self.requests[url] += 1
        try:
            async with self.sems[url]:
                yield
        finally:
            self.inflight[url] -= 1

    def _router_failed(self, router: str, exc: EngineError) -> None:
        """After the router failed with ``exc``: a bad request is raised (the engines would refuse it too); else
        this and later requests go to the engines directly."""
        if exc.status is not None and exc.status < 500:
            raise exc
        if self.router is not None:
            self.router = None
            log.warning("router %s failed (%s); sending requests to the engines directly", router, exc)

    async def generate(self, **body: Any) -> dict[str, Any]:
        """POST /generate through the router when there is one, else on the least-loaded live
        engine; fail over on connection errors."""
        if self.lora_path is not None:
            body.setdefault("lora_path", self.lora_path)
        if self.router is not None:
            router = self.router
            try:
                async with self.router_sem:
                    self.router_requests += 1
                    out = await self.router_client.generate(**body)
                out.setdefault("meta_info", {})["engine_url"] = router
                return out
            except EngineError as exc:
                self._router_failed(router, exc)
        while True:
            url = self._pick()
            try:
                async with self._on(url):
                    out = await self.clients[url].generate(**body)
                out.setdefault("meta_info", {})["engine_url"] = url
                return out
            except EngineError as exc:
                if exc.status is not None:  # the engine answered: a bad request, not a dead engine
                    raise
                self.mark_dead(url, exc)

    async def generate_stream(self, **body: Any) -> AsyncIterator[dict[str, Any]]:
        """A streamed /generate (:meth:`EngineClient.generate_stream`: each chunk the output so far, the last one
        the whole answer): through the router when there is one, else on the least-loaded live engine. It fails
        over (another engine, or from the router to the engines) only while no chunk was delivered; after the first
        one an engine lost is an :class:`EngineError` (``status`` None) the caller ends its answer with. Closing
        the iterator early closes the connection: the engine aborts the request."""
        if self.lora_path is not None:
            body.setdefault("lora_path", self.lora_path)
        started = [False]  # a chunk was delivered
        if self.router is not None:
            router = self.router
            try:
                async with self.router_sem, aclosing(_relay(self.router_client, router, body, started)) as chunks:
                    self.router_requests += 1
                    async for out in chunks:
                        yield out
                return
            except EngineError as exc:
                if started[0]:
                    raise
                self._router_failed(router, exc)
        while True:
            url = self._pick()
            try:
                async with self._on(url), aclosing(_relay(self.clients[url], url, body, started)) as chunks:
                    async for out in chunks:
                        yield out
                return
            except EngineError as exc:
                if exc.status is not None:  # the engine answered: a bad request, not a dead engine
                    raise
                self.mark_dead(url, exc)
                if started[0]:
                    raise EngineError(f"{self.why.get(url, url)}: the stream broke after its first tokens were "
                                      f"delivered; nothing of it can be retried", url=url) from None

    async def abort_all(self) -> None:
        await asyncio.gather(*(self.clients[u].abort_request(abort_all=True) for u in self.alive()),
                             return_exceptions=True)

    async def weight_versions(self) -> dict[str, str]:
        out = {}
        for u in self.alive():
            try:
                out[u] = await self.clients[u].weight_version()
            except EngineError as exc:
                self.mark_dead(u, exc)
        return out

    async def close(self) -> None:
        clients = list(self.clients.values()) + ([self.router_client] if self.router_client else [])
        await asyncio.gather(*(c.close() for c in clients))


async def _relay(client: EngineClient, where: str, body: dict[str, Any], started: list[bool]
                 ) -> AsyncIterator[dict[str, Any]]:
    """``client``'s streamed /generate, each chunk marked with the ``engine_url`` it came from; ``started[0]`` set
    once one was delivered."""
    async with aclosing(client.generate_stream(**body)) as chunks:
        async for out in chunks:
            started[0] = True
            out.setdefault("meta_info", {})["engine_url"] = where
            yield out
