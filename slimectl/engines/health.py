"""The heartbeat on the engines a process started (slime's ``--use-fault-tolerance``).

:class:`EngineWatcher` is a daemon thread over a group of engines it can heal (:class:`Healable`: ``serve``'s
and ``rl``'s :class:`~slimectl.stages.serve.EngineProcesses`, child processes of this one, and the Ray
launcher's :class:`~slimectl.orchestration.ray_engines.RayEngineActors`, one Ray actor per engine). Every
``interval`` seconds it looks at each engine: a process that has exited (or, under Ray, an engine actor that
died) is lost at once; from ``first_wait`` seconds on, an engine whose
``GET /health_generate`` does not answer 200 within ``timeout`` seconds (hung: alive, never answering, e.g.
SIGSTOPped) is lost too. A lost engine is handed to the group's ``heal`` (kill its process group, start it
again, bring it to its weight version, register it again), which runs under the group's ``lock``: the
heartbeat is not sent while the group holds it for a weight sync (a paused engine answers no generate), nor while
another process syncing the engines holds their records (``EngineRegistry.hold``: a ``sync``, an ``rl`` attached to
this ``serve``); a dead process is still found at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from slimectl.web.client import http_status

log = logging.getLogger("slimectl.engines.health")

HEALTH_PATH = "/health_generate"


@dataclass(frozen=True)
class Watched:
    """One engine as the watcher sees it: its name, its URL and how to ask its process's exit status (None:
    running; a string: a line saying why it is gone, e.g. its Ray actor died; asked when the engine's turn comes,
    not when the round began)."""

    name: str
    url: str
    poll: Callable[[], int | str | None]


@dataclass(frozen=True)
class Loss:
    """An engine the watcher found lost: which, why, and when (``time.monotonic()``)."""

    name: str
    url: str
    why: str
    at: float


class Healable(Protocol):
    """A group of engines the watcher heals: :class:`~slimectl.stages.serve.EngineProcesses` (child processes),
    :class:`~slimectl.orchestration.ray_engines.RayEngineActors` (Ray actors)."""

    lock: threading.RLock
    """Held by the group while it syncs weights (no heartbeat then) and by ``heal``."""

    registry: object
    """Its engines' records (:class:`~slimectl.contract.rundir.registry.EngineRegistry`): while another process
    (a ``sync``, an attached ``rl``) holds them for a sync (``registry.held()``), no heartbeat either."""

    def watched(self) -> list[Watched]:
        """The engines to watch now (the ones lost for good are not among them)."""

    def heal(self, loss: Loss) -> None:
        """Kill the engine, start it again and bring it back, or record it as lost for good."""


def probe(engine: Watched, heartbeat: bool, timeout: float) -> str | None:
    """Why ``engine`` is lost, or None while it is well."""
    if engine.poll() is None and (not heartbeat or http_status(engine.url + HEALTH_PATH, timeout=timeout) == 200):
        return None
    deadline = time.monotonic() + 0.5  # a process that died during the heartbeat is dead, not hung: a moment
    while (rc := engine.poll()) is None and time.monotonic() < deadline:  # for its exit to be seen
        time.sleep(0.05)
    if isinstance(rc, str):
        return rc
    if rc is not None:
        return f"its process exited ({f'signal {-rc}' if rc < 0 else f'exit code {rc}'})"
    return f"GET {HEALTH_PATH} did not answer 200 within {timeout:g}s (hung)"


def lost_for_good(lost: dict[str, str], engines: int, on_lost: str) -> str | None:
    """The line a group's ``check_alive`` raises with when its heartbeat gave engines up (``lost``: url -> why):
    one lost under ``engine.on_lost: stop``, or all ``engines`` lost; None while the run may go on."""
    if not lost or (on_lost != "stop" and len(lost) < engines):
        return None
    why = "engine.on_lost is stop" if on_lost == "stop" else "no engine is left"
    return f"{next(iter(lost.values()))}; stopping: {why}"


def give_up(lost: dict[str, str], loss: Loss, exc: BaseException, engines: int, on_lost: str) -> None:
    """Record ``loss`` in a group's ``lost`` (url -> one line) as an engine that could not be started again
    (``exc``), and log what the run does now."""
    lost[loss.url] = f"{loss.name} at {loss.url} is lost ({loss.why}) and could not be started again: {exc}"
    rest = engines - len(lost)
    log.error("%s; %s", lost[loss.url], f"going on with the other {rest} engine(s)" if rest and
              on_lost == "continue" else f"engine.on_lost: {on_lost}")


class EngineWatcher:
    """``EngineWatcher(group, health_check).start()``; :meth:`stop` before the group stops its engines.
    ``losses`` lists every loss found, in order (what a test or a bench reads back)."""

    def __init__(self, group: Healable, health_check) -> None:
        self.group = group
        self.first_wait = float(health_check.first_wait)
        self.interval = float(health_check.interval)
        self.timeout = float(health_check.timeout)
        self.losses: list[Loss] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slimectl-engine-health", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> "EngineWatcher":
        self._t0 = time.monotonic()
        self._thread.start()
        log.info("watching the engines: heartbeat %s every %gs (timeout %gs) after %gs", HEALTH_PATH, self.interval,
                 self.timeout, self.first_wait)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 — the watcher must outlive one bad round
                log.exception("engine health check failed; trying again in %gs", self.interval)

    def check_once(self) -> list[Loss]:
        """One round over the engines: heal each one found lost; the losses of this round."""
        heartbeat = time.monotonic() - self._t0 >= self.first_wait
        found = []
        with self.group.lock:  # not while a sync holds the engines paused (this process's, or another's)
            heartbeat = heartbeat and not self.group.registry.held()
            for engine in self.group.watched():
                if self._stop.is_set():
                    break
                why = probe(engine, heartbeat, self.timeout)
                if why is None:
                    continue
                loss = Loss(engine.name, engine.url, why, time.monotonic())
                self.losses.append(loss)
                found.append(loss)
                self.group.heal(loss)
        return found


def wait_registered(registry, ids, timeout: float, probe_timeout: float = 5.0, poll: float = 0.1) -> list[str]:
    """Wait (up to ``timeout`` seconds) until every engine record of ``ids`` in ``registry`` (the run's
    :class:`~slimectl.contract.rundir.registry.EngineRegistry`) is on a live process that answers
    ``GET /health_generate``, or is gone (lost for good), or its owner died: what a process attached to a ``serve``
    that heals its engines does after a sync failed on one. The ids still not back at the deadline."""
    from slimectl.contract.rundir.registry import owner_alive

    deadline = time.monotonic() + timeout
    waiting = [i for i in ids if i is not None]
    while True:
        recs = {r.id: r for r in registry.list()}
        waiting = [i for i in waiting if i in recs and owner_alive(recs[i]) and not (
            recs[i].alive() is not False and http_status(recs[i].url + HEALTH_PATH, timeout=probe_timeout) == 200)]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(poll)


def wait_healing(registry, timeout: float) -> list[str]:
    """Wait (up to ``timeout`` seconds) for the engines of ``registry`` being healed — a record whose process is gone,
    that says ``heals`` and whose owner (the process that heals it) lives — to be back or gone
    (:func:`wait_registered`): what a caller that found no live engine in a group does before it gives up (a frozen
    group's only engine, healed while a rollout begins). The ids still not back at the deadline."""
    ids = [r.id for r in registry.healing()]
    if not ids:
        return []
    log.info("waiting up to %gs for engine(s) %s, being healed", timeout, ", ".join(ids))
    return wait_registered(registry, ids, timeout)
