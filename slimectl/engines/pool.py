"""The engines of a run as one load-balanced pool of clients, with failover.

:class:`EnginePool` sends each request to the live engine with the fewest requests in flight
(at most ``concurrency_per_engine`` per engine). A connection failure marks that engine dead
and the request is retried on another one; only when every engine is dead does a request
fail (a rollout then publishes nothing).

With a ``router`` (the sglang-router ``serve`` started with ``engine.router: true``) every
``/generate`` goes through it and it balances; weight versions and aborts still go to each engine
(the router does not forward them). If the router fails (no answer, or a 5xx), the pool logs it once
and sends this and later requests to the engines directly.

With a ``registry``, the pool follows the engines ``serve``'s heartbeat heals (:mod:`slimectl.engines.health`):
an engine taken out of the pool takes requests again once the registry shows its record (the same id) on a new
live process, at its URL or a new one, on its weights or newer ones; and with ``heal_wait_s``, while every engine
is out and one of them is being healed (its record says ``heals`` and its owner lives), a request waits for it
instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing, asynccontextmanager
from typing import Any, AsyncIterator

from slimectl.contract.errors import SlimectlError
from slimectl.engines.client import EngineClient, EngineError

log = logging.getLogger("slimectl.rollout")  # its users' logger: the rollout's (and the harness's) engine failures

POLICY_ADAPTER = "policy"
"""The name a LoRA run's engines hold its adapter under (``/load_lora_adapter``'s ``lora_name``) and every
rollout request asks for (``lora_path`` in ``/generate``)."""

REVIVE_POLL_S = 0.25
"""Seconds between two looks at the registry for an engine taken out of the pool that came back."""


class EnginePool:
    """``registry`` (the run's :class:`~slimectl.contract.rundir.registry.EngineRegistry`) lets the
    pool say that an engine's *process* died, and where its log is, instead of only that it stopped
    answering. Each engine's failure is reported once, however many requests were in flight."""

    def __init__(self, urls: list[str], token: str | None = None, concurrency_per_engine: int = 64,
                 timeout: float = 600.0, registry=None, router: str | None = None, connections=None,
                 lora_path: str | None = None, heal_wait_s: float = 0.0):
        """``connections``: a :class:`~slimectl.engines.client.KeptConnections` whose sessions the
        clients use (kept open after :meth:`close`); None: each client opens and closes its own.
        ``lora_path``: the adapter every ``/generate`` asks for (a LoRA run's :data:`POLICY_ADAPTER`).
        ``heal_wait_s``: how long a request waits, every engine being out, for one the heartbeat heals (0, the
        default: it fails at once, and the rollout with it)."""
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

        def client(u: str) -> EngineClient:
            return EngineClient(u, token=token, timeout=timeout, retries=1, backoff=0.2,
                                retry_log_level=logging.DEBUG, session=session(u))

        self.clients = {u: client(u) for u in urls}
        self._new_client = client
        self.concurrency_per_engine = concurrency_per_engine
        self.inflight = {u: 0 for u in urls}
        self.sems = {u: asyncio.Semaphore(concurrency_per_engine) for u in urls}
        self.dead: set[str] = set()
        self.why: dict[str, str] = {}
        self.requests = {u: 0 for u in urls}
        self.registry = registry
        self.heal_wait_s = heal_wait_s
        self.down: dict[str, tuple[str, int | None, str | None]] = {}
        """URL of an engine taken out -> (its record's id, the pid and weight version it had then): what
        :meth:`revive` looks for."""
        self._looked = float("-inf")

    def alive(self) -> list[str]:
        return [u for u in self.clients if u not in self.dead]

    def _pick(self) -> str:
        self.revive()
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
        self._remember_down(url)
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
            url = await self._pick_or_wait_for_heal()
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
            url = await self._pick_or_wait_for_heal()
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

    # ------------------------------------------------------------------ following the registry (heals)
    def _remember_down(self, url: str) -> None:
        rec = self._record(lambda r: r.url.rstrip("/") == url.rstrip("/"))
        if rec is not None:
            self.down[url] = (rec.id, rec.pid, rec.weight_version)

    def _record(self, match):
        """The first registry record ``match`` accepts (None: none, no registry, or the registry unreadable)."""
        if self.registry is None:
            return None
        try:
            return next((r for r in self.registry.list() if match(r)), None)
        except (OSError, SlimectlError):
            return None

    def revive(self, force: bool = False) -> list[str]:
        """Put back the engines taken out whose record (the same id) the registry now shows on another live
        process: started again by the heartbeat of the ``serve`` that owns them, at their URL or a new one
        (a new client for it), on the weights it had or newer ones (one started on older weights, e.g. the initial
        ones, waits for a sync). Looks at most every :data:`REVIVE_POLL_S` unless ``force``; the URLs put back."""
        if not self.down or (not force and time.monotonic() - self._looked < REVIVE_POLL_S):
            return []
        self._looked = time.monotonic()
        back = []
        for url, (rid, pid, version) in list(self.down.items()):
            rec = self._record(lambda r: r.id == rid)
            if rec is None or rec.pid == pid or rec.alive() is not True or _older(rec.weight_version, version):
                continue
            new = rec.url.rstrip("/")
            del self.down[url]
            self.dead.discard(url)
            if new not in self.clients:  # started again at another URL: the old one stays out
                self.clients[new] = self._new_client(new)
                self.inflight[new], self.requests[new] = 0, 0
                self.sems[new] = asyncio.Semaphore(self.concurrency_per_engine)
            self.dead.discard(new)
            self.why.pop(new, None)
            back.append(new)
            log.warning("engine %s is back at %s (registered again, pid %s); sending it requests again", rid, new,
                        rec.pid)
        return back

    def _healing(self) -> bool:
        """Whether an engine taken out is being started again: its record is there, says ``heals`` and its
        owner (the serve group that watches it) lives."""
        from slimectl.contract.rundir.registry import healed_by_owner

        ids = {rid for rid, _, _ in self.down.values()}
        return self._record(lambda r: r.id in ids and healed_by_owner(r)) is not None

    async def _pick_or_wait_for_heal(self) -> str:
        """:meth:`_pick`; with every engine out and one of them being healed, wait (up to ``heal_wait_s``) for
        it to come back rather than fail the request."""
        deadline = time.monotonic() + self.heal_wait_s
        while True:
            try:
                return self._pick()
            except EngineError:
                if time.monotonic() >= deadline or not self._healing():
                    raise
            await asyncio.sleep(REVIVE_POLL_S)

    async def abort_all(self) -> None:
        await asyncio.gather(*(self.clients[u].abort_request(abort_all=True) for u in self.alive()),
                             return_exceptions=True)

    async def weight_versions(self) -> dict[str, str]:
        """The weight version each engine in the pool serves (those that fail are taken out); with every engine out
        and one being healed, waits (up to ``heal_wait_s``) for it to come back, as a request does."""
        deadline = time.monotonic() + self.heal_wait_s
        while True:
            self.revive()
            out = {}
            for u in self.alive():
                try:
                    out[u] = await self.clients[u].weight_version()
                except EngineError as exc:
                    self.mark_dead(u, exc)
            if out or time.monotonic() >= deadline or not self._healing():
                return out
            await asyncio.sleep(REVIVE_POLL_S)

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


def _older(version: str | None, than: str | None) -> bool:
    """Whether weight version ``version`` is older than ``than`` (versions that are not numbers: when they differ)."""
    if version == than:
        return False
    try:
        return int(version) < int(than)
    except (TypeError, ValueError):
        return True
