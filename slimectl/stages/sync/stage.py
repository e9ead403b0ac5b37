"""The sync choreography (:func:`sync_engines`) and the standalone stage (:func:`run_sync`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.contract.trace import NULL_TRACER, SpanRecorder
from slimectl.weight_formats import WeightSource, weight_format
from slimectl.stages.sync import healing
from slimectl.stages.sync.transport import EngineTarget, WeightTransport, make_transport

log = logging.getLogger("slimectl.sync")


@dataclass
class SyncResult:
    version: int
    transport: str
    engines: list[str]
    seconds: float
    bytes: int
    verified: bool = False
    phases: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        m = {"sync/time": self.seconds, "sync/bytes": float(self.bytes), "sync/weight_version": float(self.version),
             "sync/num_engines": float(len(self.engines))}
        m.update({f"sync/{k}_time": v for k, v in self.phases.items()})
        return m


async def sync_engines(clients: dict, transport: WeightTransport, source: WeightSource, pause_mode: str = "abort",
                       verify: bool = False, tracer: SpanRecorder = NULL_TRACER) -> SyncResult:
    """Pause every engine, flush, move ``source`` in with ``transport``, flush, continue.

    Engines are always continued, whatever failed. Afterwards each must report weight version
    ``source.version``; with ``verify`` sampled tensors are read back and compared.
    Raises :class:`SlimectlError` naming the engine that failed. ``tracer`` gets the spans ``sync``
    and, inside it, ``pause``, ``update`` (the transfer), ``continue`` and ``verify``, each with the version.
    The source goes to the engines as its format hands it to them (``engine.lora_merged``: a LoRA version as the
    base with the adapter merged in).
    """
    with source.form.for_engines(source, transport.name) as source:
        with tracer.span("sync", version=source.version, transport=transport.name, engines=len(clients)):
            return await _sync_engines(clients, transport, source, pause_mode, verify, tracer)


async def _sync_engines(clients: dict, transport: WeightTransport, source: WeightSource, pause_mode: str,
                        verify: bool, tracer: SpanRecorder) -> SyncResult:
    from slimectl.engines.client import EngineError

    t0 = time.perf_counter()
    version = source.version
    phases: dict[str, float] = {}
    urls = list(clients)
    paused: list[str] = []
    moved = 0
    try:
        with tracer.span("pause", version=version, mode=pause_mode):
            results = await asyncio.gather(*(clients[u].pause_generation(pause_mode) for u in urls),
                                           return_exceptions=True)
            paused = [u for u, r in zip(urls, results) if not isinstance(r, BaseException)]
            for u, r in zip(urls, results):
                if isinstance(r, BaseException):
                    raise SlimectlError(f"sync stopped before any weight moved: {r}")
            await asyncio.gather(*(clients[u].flush_cache() for u in urls), return_exceptions=True)
        phases["pause"] = time.perf_counter() - t0
        fault_point("sync.paused")
        t1 = time.perf_counter()
        with tracer.span("update", version=version):
            moved = await transport.push(clients, source, flush_cache=pause_mode != "in_place")
        phases["transfer"] = time.perf_counter() - t1
        fault_point("sync.pushed")
    except EngineError as exc:
        raise SlimectlError(f"sync of weight version {source.version} failed: {exc}") from None
    finally:
        t2, started = time.perf_counter(), time.time()
        await asyncio.gather(*(clients[u].flush_cache() for u in paused), return_exceptions=True)
        resumed = await asyncio.gather(*(clients[u].continue_generation() for u in paused), return_exceptions=True)
        tracer.record("continue", started, time.time(), version=version)
        stuck = [(u, r) for u, r in zip(paused, resumed) if isinstance(r, BaseException)]
        phases["continue"] = time.perf_counter() - t2
        if stuck:
            u, r = stuck[0]
            raise SlimectlError(f"engine {u} could not be continued after the weight update ({r}); it may still be "
                                f"paused: POST {u}/continue_generation or restart it")
    versions = await asyncio.gather(*(clients[u].weight_version() for u in urls), return_exceptions=True)
    for u, v in zip(urls, versions):
        if isinstance(v, BaseException):
            raise SlimectlError(f"engine {u} did not answer after the weight update: {v}")
        if str(v) != str(source.version):
            raise SlimectlError(f"engine {u} reports weight_version {v} after the sync, expected {source.version}")
    verified = False
    if verify:
        from slimectl.stages.sync.verify import verify_engines

        t3 = time.perf_counter()
        with tracer.span("verify", version=version):
            problems = await verify_engines(clients, source)
        phases["verify"] = time.perf_counter() - t3
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise SlimectlError(problems[0] + more)
        verified = problems.verified  # False when an engine could not read any tensor back (warned)
    return SyncResult(source.version, transport.name, urls, time.perf_counter() - t0, moved, verified, phases)


def engine_targets(run: RunDir, engine_urls: list[str] | tuple[str, ...] = ()) -> list[EngineTarget]:
    if engine_urls:
        by_url = {r.url.rstrip("/"): r.id for r in run.engines.list()}
        return [EngineTarget(u.rstrip("/"), by_url.get(u.rstrip("/"))) for u in engine_urls]
    return [EngineTarget(r.url.rstrip("/"), r.id) for r in run.engines.require_live(healing=True)]


def weight_source(run: RunDir, cfg: SlimectlConfig, version: int | None) -> WeightSource:
    """``weights/N`` (latest by default); version 0 falls back to the initial model (model.path)."""
    ids = run.weights.ids()
    if version is None:
        version = ids[-1] if ids else 0
    if run.weights.exists(version):
        return weight_format(cfg).source_from_dir(version, run.weights.get(version).path)
    if version == 0 and cfg.model.path:
        return weight_format(cfg).source_from_dir(0, cfg.model.path)
    have = ", ".join(str(i) for i in ids) or "none"
    raise UsageError(f"weights/{version:06d} is not published (published versions: {have}); "
                     f"train first (`slimectl train -r {run.path}`) or pass --version")


class EngineSync:
    """A sync process's connection to its engines: the clients and the transport, opened once, then
    :meth:`push` for each version (``run_sync``: one; ``follow_sync``: each new ``weights/N``). Beside a ``serve``
    that heals its engines, an engine it is restarting is waited for and synced once back (:mod:`.healing`)."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, transport: str | None, verify: bool | None,
                 engine_urls: list[str] | tuple[str, ...]):
        self.run, self.cfg = run, cfg
        self.verify = cfg.sync.verify if verify is None else verify
        self.targets = engine_targets(run, engine_urls)
        self.transport_name = transport or cfg.sync.transport
        self.transport: WeightTransport | None = None
        self.clients: dict = {}
        self.left: list[str] = []
        """One phrase per engine this sync goes on without (not back from its serve's heal in time, or lost)."""

    async def __aenter__(self) -> "EngineSync":
        restarting = healing.restarting(self.run, self.targets)
        if restarting:
            await self._wait_back(restarting)
        before = healing.processes(self.run, self.targets)
        try:
            await self._open()
        except SlimectlError as exc:
            if not await self._follow_heal(exc, before):
                await self._close()  # (connected again meanwhile, maybe)
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()

    async def _open(self) -> None:
        from slimectl.engines.client import EngineClient

        token = self.cfg.engine.token()
        self.transport = make_transport(self.transport_name, self.cfg.sync)
        self.transport.progress = self.cfg.logging.progress
        self.clients = {t.url: EngineClient(t.url, token=token, timeout=self.cfg.sync.timeout_s) for t in self.targets}
        if not self.clients:
            return  # every engine left behind: nothing to connect (the push says so)
        try:
            await self.transport.connect(self.clients)
        except BaseException:
            await self._close_clients()
            raise

    async def _close(self) -> None:
        try:
            await self.transport.close(self.clients)
        finally:
            await self._close_clients()

    async def _close_clients(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)

    async def _wait_back(self, ids: list[str]) -> None:
        """Wait for the engines ``ids`` their serve is restarting; go on with those back (the others: :attr:`left`)."""
        self.targets, left = await healing.wait_back(self.run, self.targets, ids, self.cfg.engine.startup_timeout_s)
        self.left += left

    async def _follow_heal(self, exc: SlimectlError, before: dict[str, int | None]) -> bool:
        """After ``exc``: wait for the engines their serve heals to be back and connect again; whether one of them
        was restarted (or left behind) since ``before`` (their processes then): only then is it tried once more."""
        ids = healing.healed(self.run, self.targets)
        if not ids or (healing.processes(self.run, self.targets) == before
                       and not healing.restarting(self.run, self.targets)):
            return False  # no engine lost: a refusal of a live engine (a corrupt delta, a bad version) is the error
        log.warning("sync failed (%s); syncing again once the lost engine is back", exc)
        await self._close()
        await self._wait_back(ids)
        await self._open()
        return healing.processes(self.run, self.targets) != before or bool(self.left)

    async def push(self, source: WeightSource) -> SyncResult:
        """Load ``source`` into every engine, record the engines' version and the sync metrics. A push that fails
        while the engines' serve restarts one of them is made once more when it is back (or without it, when it
        is not back in time: then, the others synced, raises naming it)."""
        from slimectl.contract.metrics import MetricsWriter

        before = healing.processes(self.run, self.targets)
        try:
            result = await self._push(source)
        except SlimectlError as exc:
            if not await self._follow_heal(exc, before):
                raise
            result = await self._push(source)
        self.run.engines.set_weight_version([t.id for t in self.targets], str(result.version))
        tb = self.run.tensorboard_dir("sync") if self.cfg.logging.tensorboard else None
        with MetricsWriter(self.run.metrics_path("sync"), tb) as m:
            m.log(result.version, result.metrics())
        log.info("sync: weight version %d to %d engine(s) by %s in %.2f s (%.1f MB)%s", result.version,
                 len(result.engines), result.transport, result.seconds, result.bytes / 1e6,
                 ", verified" if result.verified else "")
        if self.left:
            raise SlimectlError(healing.left_behind_line(self.run, self.left, result.version, result.engines))
        return result

    async def _push(self, source: WeightSource) -> SyncResult:
        if not self.targets:
            raise SlimectlError(healing.left_behind_line(self.run, self.left, source.version, []))
        with self.run.engines.hold(self.cfg.sync.timeout_s):  # their serve's heartbeat waits (engines paused)
            return await sync_engines(self.clients, self.transport, source, self.cfg.effective_pause_mode,
                                      self.verify, tracer=self.run.tracer("sync"))


def run_sync(run: RunDir, cfg: SlimectlConfig, version: int | None = None, transport: str | None = None,
             verify: bool | None = None, engine_urls: list[str] | tuple[str, ...] = ()) -> SyncResult:
    """Push weight version ``version`` (default: the latest published) to every registered engine."""
    with run.stage_log("sync"), run.lock("sync"):
        source = weight_source(run, cfg, version)

        async def go() -> SyncResult:
            async with EngineSync(run, cfg, transport, verify, engine_urls) as engines:
                return await engines.push(source)

        return asyncio.run(go())


def follow_sync(run: RunDir, cfg: SlimectlConfig, transport: str | None = None, verify: bool | None = None,
                engine_urls: list[str] | tuple[str, ...] = (), stop=None, poll_s: float = 0.2,
                on_synced: Callable[[SyncResult], None] | None = None) -> list[int]:
    """``sync --follow``: push each new ``weights/N`` to every engine as soon as it is published (a version
    published while one is being pushed is skipped for the newer one), until ``weights/{rollout.num_rollout}``
    is in the engines or ``stop`` is set. Returns the versions pushed."""
    import threading

    stop = stop or threading.Event()
    pushed: list[int] = []
    with run.stage_log("sync"), run.lock("sync") as lock:
        async def go() -> None:
            async with EngineSync(run, cfg, transport, verify, engine_urls) as engines:
                # A sync killed between pause and continue (kill -9) left the engines paused, maybe already on the
                # newest weights, so nothing below would push (and continue) them: continue them first.
                await asyncio.gather(*(c.continue_generation() for c in engines.clients.values()),
                                     return_exceptions=True)
                served = await _served_versions(engines.clients)
                tracer, waiting = run.tracer("sync"), time.time()
                while not stop.is_set():
                    lock.check()
                    ids = run.weights.ids()
                    newest = ids[-1] if ids else None
                    if newest is not None and any(v != newest for v in served.values()):
                        tracer.record("wait:weights", waiting, time.time(), version=newest)
                        try:
                            source = weight_source(run, cfg, newest)
                            res = await engines.push(source)
                        except (UsageError, SlimectlError) as exc:
                            if run.weights.exists(newest):
                                raise
                            log.info("weights/%06d was pruned before it reached the engines (%s); taking the newer "
                                     "one", newest, exc)
                            continue
                        served = {u: newest for u in engines.clients}
                        pushed.append(newest)
                        waiting = time.time()
                        if on_synced is not None:
                            on_synced(res)
                    if newest is not None and newest >= cfg.rollout.num_rollout and \
                            all(v == newest for v in served.values()):
                        return
                    await asyncio.sleep(poll_s)

        asyncio.run(go())
    return pushed


async def _served_versions(clients: dict) -> dict[str, int | None]:
    """Each engine's weight version as an int (None: not one of this run's versions)."""
    out: dict[str, int | None] = {}
    for u, c in clients.items():
        try:
            out[u] = int(await c.weight_version())
        except (TypeError, ValueError, SlimectlError):  # (SlimectlError: it does not answer; the push finds why)
            out[u] = None
    return out
