"""The sync choreography (:func:`sync_engines`) and the standalone stage (:func:`run_sync`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.faults import fault_point
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.stages.sync.source import WeightSource
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
                       verify: bool = False) -> SyncResult:
    """Pause every engine, flush, move ``source`` in with ``transport``, flush, continue.

    Engines are always continued, whatever failed. Afterwards each must report weight version
    ``source.version``; with ``verify`` sampled tensors are read back and compared.
    Raises :class:`SlimectlError` naming the engine that failed.
    """
    from slimectl.engines.client import EngineError

    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    urls = list(clients)
    paused: list[str] = []
    moved = 0
    try:
        results = await asyncio.gather(*(clients[u].pause_generation(pause_mode) for u in urls), return_exceptions=True)
        paused = [u for u, r in zip(urls, results) if not isinstance(r, BaseException)]
        for u, r in zip(urls, results):
            if isinstance(r, BaseException):
                raise SlimectlError(f"sync stopped before any weight moved: {r}")
        await asyncio.gather(*(clients[u].flush_cache() for u in urls), return_exceptions=True)
        phases["pause"] = time.perf_counter() - t0
        fault_point("sync.paused")
        t1 = time.perf_counter()
        moved = await transport.push(clients, source, flush_cache=pause_mode != "in_place")
        phases["transfer"] = time.perf_counter() - t1
        fault_point("sync.pushed")
    except EngineError as exc:
        raise SlimectlError(f"sync of weight version {source.version} failed: {exc}") from None
    finally:
        t2 = time.perf_counter()
        await asyncio.gather(*(clients[u].flush_cache() for u in paused), return_exceptions=True)
        resumed = await asyncio.gather(*(clients[u].continue_generation() for u in paused), return_exceptions=True)
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
    return [EngineTarget(r.url.rstrip("/"), r.id) for r in run.engines.require_live()]


def weight_source(run: RunDir, cfg: SlimectlConfig, version: int | None) -> WeightSource:
    """``weights/N`` (latest by default); version 0 falls back to the initial model (model.path)."""
    ids = run.weights.ids()
    if version is None:
        version = ids[-1] if ids else 0
    if run.weights.exists(version):
        return WeightSource.from_dir(version, run.weights.get(version).path)
    if version == 0 and cfg.model.path:
        return WeightSource.from_dir(0, cfg.model.path)
    have = ", ".join(str(i) for i in ids) or "none"
    raise UsageError(f"weights/{version:06d} is not published (published versions: {have}); "
                     f"train first (`slimectl train -r {run.path}`) or pass --version")


def run_sync(run: RunDir, cfg: SlimectlConfig, version: int | None = None, transport: str | None = None,
             verify: bool | None = None, engine_urls: list[str] | tuple[str, ...] = ()) -> SyncResult:
    """Push weight version ``version`` (default: the latest published) to every registered engine."""
    with run.stage_log("sync"):
        from slimectl.engines.client import EngineClient
        from slimectl.contract.metrics import MetricsWriter

        kind = transport or cfg.sync.transport
        verify = cfg.sync.verify if verify is None else verify
        with run.lock("sync"):
            source = weight_source(run, cfg, version)
            targets = engine_targets(run, engine_urls)
            token = cfg.engine.token()
            tr = make_transport(kind, cfg.sync)
            tr.progress = cfg.logging.progress

            async def go() -> SyncResult:
                clients = {t.url: EngineClient(t.url, token=token, timeout=cfg.sync.timeout_s) for t in targets}
                try:
                    await tr.connect(clients)
                    try:
                        return await sync_engines(clients, tr, source, cfg.effective_pause_mode, verify)
                    finally:
                        await tr.close(clients)
                finally:
                    await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

            result = asyncio.run(go())
            run.engines.set_weight_version([t.id for t in targets], str(result.version))
            tb = run.tensorboard_dir("sync") if cfg.logging.tensorboard else None
            with MetricsWriter(run.metrics_path("sync"), tb) as m:
                m.log(result.version, result.metrics())
            log.info("sync: weight version %d to %d engine(s) by %s in %.2f s (%.1f MB)%s", result.version,
                     len(result.engines), result.transport, result.seconds, result.bytes / 1e6,
                     ", verified" if result.verified else "")
            return result
