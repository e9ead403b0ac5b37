"""The engines of ``rl --launcher ray``: one :class:`EngineWorker` Ray actor per engine, and the driver's
:class:`RayEngineActors` over them, watched and healed by the heartbeat (``engine.health_check``).

Each actor starts its engine exactly as ``slimectl serve`` does (:class:`~slimectl.stages.serve.EngineProcesses`
for its one index: a child process of the actor, registered in ``RUN/engines/``), but does not watch it: the
driver does, with the same :class:`~slimectl.engines.health.EngineWatcher` as a local ``rl``
(:class:`RayEngineActors` is a :class:`~slimectl.engines.health.Healable`). An engine whose process exits, or
whose actor dies, is lost at once (each actor answers one long :meth:`EngineWorker.wait_engine` call when its
engine exits; Ray fails it when the actor dies); from ``first_wait`` on, one whose ``/health_generate`` does not
answer is lost too. A lost engine's actor is asked to kill its engine's process group, then ``ray.kill``\\ ed; a
new actor in the same placement-group bundle (the same node) kills what is left of the old engine's process
tree there, starts the engine on the same URL at the weight version the registry recorded for it (full
weights), checks its weights against ``weights/N`` (:func:`~slimectl.orchestration.heal_check.weights_check`) and
registers it again under its id, before the driver hands it requests again.

The frozen groups of ``engine.groups`` (an OPD teacher, the judge reward's engines) are engine actors too
(:func:`frozen_group_actors`): one :class:`RayEngineActors` per group, its actors in a placement group of its own
(``group-NAME``), each engine started from the group's model at version 0 and registered in
``RUN/engines/groups/NAME/``, watched by a heartbeat of its own (the group's ``health_check``) and healed the same
way, at version 0 (not checked against ``weights/N``, which are the actor's); no sync reaches them.
"""

from __future__ import annotations

import logging
import threading

from slimectl.contract.config import build_config
from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.orchestration.ray_workers import worker_context, worker_logging

log = logging.getLogger("slimectl.ray")

KILL_TIMEOUT_S = 10.0
"""How long a lost engine's actor may take to kill its engine before the actor itself is killed."""


def url_host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).hostname or ""


def is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def healer(watched: bool) -> dict | None:
    """What the driver tells its engine actors to record as the ``owner`` of their engines when its heartbeat watches
    them (``watched``): itself, the process that heals them (its pid, start time and process table); None else."""
    from slimectl.contract.rundir.atomic import host_id
    from slimectl.contract.rundir.registry import this_process

    return {**this_process(), "host_id": host_id()} if watched else None


def owner_extra(owner: dict | None) -> dict:
    """An engine record's ``owner`` and ``heals``, written by an engine actor: the driver that heals the engine
    (``owner``, from :func:`healer`) when it shares this process table — a record is not pruned as dead while its
    owner lives (``registry.prune_dead``), and a pool waits for an engine being healed (``engines/pool.py``) —
    else this actor, which does not heal it."""
    from slimectl.contract.rundir.atomic import host_id
    from slimectl.contract.rundir.registry import this_process

    if owner is not None and owner.get("host_id") == host_id():
        return {"owner": {"pid": owner["pid"], "create_time": owner["create_time"]}, "heals": True}
    return {"owner": this_process(), "heals": False}


def unwatched_config(cfg_data: dict, group: str | None = None) -> SlimectlConfig:
    """The driver's config as an engine actor uses it (a frozen ``group``'s: its
    :meth:`~slimectl.contract.config_schema.SlimectlConfig.group_config`): its engine is watched by the driver, not
    by the actor."""
    cfg = build_config(cfg_data, origin="the rl driver's config")
    cfg = cfg.group_config(group) if group else cfg
    cfg.engine.health_check.enabled = False
    return cfg


class EngineWorker:
    """One engine, in its own Ray worker process (a Ray actor), started exactly as ``slimectl serve`` starts it.
    Threaded (``max_concurrency``): :meth:`wait_engine` blocks while the other calls are answered."""

    def __init__(self) -> None:
        self.group = None

    def start(self, run_path: str, cfg_data: dict, index: int, log_level: int, group: str | None = None,
              owner: dict | None = None) -> dict:
        """Launch engine ``index`` (of frozen group ``group``: its model at version 0, registered in
        ``RUN/engines/groups/NAME/``), wait until healthy, register it (the record names this actor, and the driver
        that heals it: ``owner``, :func:`owner_extra`)."""
        from slimectl.stages.serve import EngineProcesses

        worker_logging(log_level)
        run = RunDir.open(run_path)
        self.group = EngineProcesses(run, unwatched_config(cfg_data, group), engine_indices=[index],
                                     group=group).start()
        engine, registry = self.group.engines[0], self.group.registry
        where = worker_context()
        registry.update(engine.id, extra={**registry.get(engine.id).extra, "launcher": "ray", **where,
                                          **owner_extra(owner)})
        return {"id": engine.id, "url": engine.url, "backend": engine.backend, "pid": engine.pid,
                "weight_version": self.group.weight_version, **where}

    def restart(self, run_path: str, cfg_data: dict, index: int, url: str, version: str, engine_id: str,
                stale: dict, log_level: int, group: str | None = None, owner: dict | None = None) -> dict:
        """Start lost engine ``index`` again at ``url`` on ``weights/version`` (full weights), check its weights
        and register it again as ``engine_id``. ``stale``: the lost engine's pid, start time and host: what is
        left of its process tree on this node is killed first, and a new actor on another node is refused.
        ``group``: a frozen group's engine (its model at version 0, not checked against ``weights/N``); ``owner``:
        the driver that heals it (:func:`owner_extra`)."""
        from slimectl.contract.rundir import EngineRecord
        from slimectl.engines.supervisor import kill_tree
        from slimectl.orchestration.heal_check import weights_check
        from slimectl.stages.serve import EngineProcesses, ServedEngine

        worker_logging(log_level)
        where = worker_context()
        if stale["host"] != where["actor_host"]:
            raise SlimectlError(f"Ray placed its new actor on host {where['actor_host']}, not on its node "
                                f"{stale['host']} (whose address {url} it must keep)")
        if stale.get("pid"):
            kill_tree(stale["pid"], stale.get("create_time"))
        run = RunDir.open(run_path)
        cfg = unwatched_config(cfg_data, group)
        self.group = EngineProcesses(run, cfg, engine_indices=[index], group=group,
                                     verify=None if group else weights_check(run, cfg))
        # healthy and checked: at `version`, or a newer one a sync of the driver reached it with meanwhile
        pid, version = self.group.restart(f"engine-{index}", url, version)
        extra = {"log": str(run.path / "logs" / f"{self.group.prefix}engine-{index}.log"), "launcher": "ray",
                 **where, **owner_extra(owner), **({"group": group} if group else {})}
        self.group.registry.register(EngineRecord(url=url, backend=self.group.backend, pid=pid,
                                                  weight_version=version, id=engine_id, extra=extra))
        self.group.engines.append(ServedEngine(engine_id, url, self.group.backend, pid))
        return {"id": engine_id, "url": url, "backend": self.group.backend, "pid": pid, "weight_version": version,
                "check": self.group.restart_check, **where}

    def wait_engine(self) -> int | None:
        """Return once the engine's process exits: its exit status (the driver's heartbeat sees a dead engine at
        once). None when the engine was stopped. (Polled: a blocking ``wait`` would hold the process's lock
        against the supervisor's own polls.)"""
        import time

        group = self.group
        procs = [p for p in group.supervisor.processes if p.name.startswith("engine-")] if group else []
        while procs and self.group is group:
            rc = procs[0].popen.poll()
            if rc is not None:
                return rc
            time.sleep(0.1)
        return None

    def kill_engine(self) -> None:
        """SIGKILL the engine's process group and its descendants (the heartbeat found it lost)."""
        if self.group is not None:
            self.group.supervisor.stop(timeout=0.0)

    def check_alive(self) -> None:
        self.group.check_alive()

    def stop(self) -> None:
        """Unregister and stop the engine (also what happens when the actor's process dies)."""
        if self.group is not None:
            self.group.stop()
            self.group = None


class RayEngineActors:
    """What :class:`slimectl.orchestration.local_launcher.RunEngines` starts under Ray: one
    :class:`EngineWorker` per engine, with :class:`~slimectl.stages.serve.EngineProcesses`'s
    ``start``/``stop``/``engines``/``urls``/``check_alive``, and its ``lock``/``watched``/``heal``/``watcher``/``lost``
    for the heartbeat (:class:`~slimectl.engines.health.Healable`). ``group``: a frozen group of ``engine.groups``
    (its engines in placement group ``group-NAME``, registered in ``RUN/engines/groups/NAME/``, never synced)."""

    def __init__(self, launcher, run: RunDir, cfg: SlimectlConfig, group: str | None = None):
        self.launcher, self.run, self.group = launcher, run, group
        self.driver_cfg = cfg  # what each actor is sent (it takes its group's part itself)
        self.cfg = cfg.group_config(group) if group else cfg  # the group's engine section: heartbeat, on_lost
        self.model_path = self.cfg.model.path
        self.registry = run.engine_group(group) if group else run.engines
        self.prefix = f"{group}-" if group else ""
        self.slots = launcher.layout.frozen[group] if group else launcher.layout.engines
        self.workers: list = []
        self.engines: list = []
        self.infos: list[dict] = []
        self.watching: list = []  # each actor's wait_engine call: done when its engine exits or the actor dies
        self.lock = threading.RLock()  # a weight sync, or the heartbeat healing an engine
        self.watcher = None
        self.lost: dict[str, str] = {}  # url -> the line saying why that engine is gone for good

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _worker(self, index: int):
        return self.launcher.worker(EngineWorker, self.slots[index], max_concurrency=4)

    def start(self) -> "RayEngineActors":
        from slimectl.stages.serve import ServedEngine

        launcher = self.launcher
        self.workers = [self._worker(i) for i in range(len(self.slots))]
        owner = healer(self.cfg.engine.health_check.enabled)
        self.infos = launcher.get([a.start.remote(str(self.run.path), self.driver_cfg.to_dict(), i,
                                                  launcher.log_level, self.group, owner)
                                   for i, a in enumerate(self.workers)], "engine")
        for info in self.infos:
            self.engines.append(ServedEngine(info["id"], info["url"], info["backend"], info["pid"]))
            log.info("ray: engine %s at %s in actor %s (pid %d) on node %s", info["id"], info["url"],
                     info["ray_actor_id"][:12], info["actor_pid"], info["ray_node_id"][:12])
        self._check_reachable()
        self.watching = [a.wait_engine.remote() for a in self.workers]
        if self.cfg.engine.health_check.enabled:
            from slimectl.engines.health import EngineWatcher

            self.watcher = EngineWatcher(self, self.cfg.engine.health_check).start()
        return self

    def _check_reachable(self) -> None:
        from slimectl.contract.rundir.atomic import hostname

        here = {hostname(), self.launcher.trainer_host}
        for info in self.infos:
            if is_loopback(url_host(info["url"])) and here != {info["actor_host"]}:
                raise UsageError(f"engine {info['id']} runs on host {info['actor_host']} but listens on "
                                 f"{info['url']}, which the driver and trainer ({', '.join(sorted(here))}) cannot "
                                 f"reach; set engine.host=0.0.0.0 (and engine.advertise_host if needed)")

    def check_alive(self) -> None:
        """Without the heartbeat: raise when an engine (or its actor) died. With it: when engines are lost for
        good (``engine.on_lost``)."""
        if self.watcher is None:
            self.launcher.get([a.check_alive.remote() for a in self.workers], "engine")
            return
        from slimectl.engines.health import lost_for_good

        line = lost_for_good(self.lost, len(self.workers), self.cfg.engine.on_lost)
        if line:
            raise SlimectlError(line)

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        with self.lock:
            workers, self.workers, self.engines = self.workers, [], []
        self.launcher.stop_workers(workers, "engine")

    # ------------------------------------------------------------------ heal (the heartbeat's)
    def watched(self) -> list:
        """The engines the heartbeat watches (:class:`~slimectl.engines.health.Watched`), less those lost for good."""
        from slimectl.engines.health import Watched

        return [Watched(f"{self.prefix}engine-{i}", info["url"], lambda i=i: self._poll(i))
                for i, info in enumerate(self.infos)
                if info["url"] not in self.lost and i < len(self.workers)]

    def _poll(self, i: int) -> int | str | None:
        """Engine ``i``'s exit status once its process exited, a line once its actor died, None while it runs."""
        ray = self.launcher.ray
        done, _ = ray.wait([self.watching[i]], timeout=0)
        if not done:
            return None
        try:
            rc = ray.get(done[0])
        except ray.exceptions.RayActorError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"its Ray actor died ({first[:200]})"
        except Exception as exc:  # noqa: BLE001 — the actor's call failed: the engine is not watched, so lost
            return f"its Ray actor failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        return -9 if rc is None else int(rc)

    def heal(self, loss) -> None:
        """Kill the lost engine's actor (its engine first), start a new actor in its bundle that starts the engine
        again on its URL at its recorded weight version, checks it and registers it again; an engine that does not
        come back is recorded in :attr:`lost` (one line)."""
        import time

        from slimectl.engines.health import give_up

        i = next(i for i, info in enumerate(self.infos) if info["url"] == loss.url)
        info, old = self.infos[i], self.workers[i]
        version = self._recorded_version(info)
        log.warning("%s at %s is lost: %s; killing its Ray actor and starting it again at weight version %s",
                    loss.name, loss.url, loss.why, version)
        stale = self._stale(info)
        self._kill(old)  # (the fault point serve.engine_restarted is the new actor's, in EngineProcesses)
        new = self._worker(i)
        try:
            back = self.launcher.get(new.restart.remote(str(self.run.path), self.driver_cfg.to_dict(), i, loss.url,
                                                        version, info["id"], stale, self.launcher.log_level,
                                                        self.group, healer(True)), "engine")
        except SlimectlError as exc:
            self.launcher.ray.kill(new)
            self.registry.unregister(info["id"])
            give_up(self.lost, loss, exc, len(self.workers), self.cfg.engine.on_lost)
            return
        self.workers[i], self.infos[i] = new, {**info, **back}
        self.watching[i] = new.wait_engine.remote()
        log.warning("%s at %s is back at weight version %s (%s) in actor %s (pid %d), %.1fs after it was found lost",
                    loss.name, loss.url, back["weight_version"], "its frozen model" if self.group else back["check"],
                    back["ray_actor_id"][:12], back["actor_pid"], time.monotonic() - loss.at)

    def _recorded_version(self, info: dict) -> str:
        """The weight version the registry last recorded for the engine (the one it started at, without a record)."""
        try:
            return str(self.registry.get(info["id"]).weight_version)
        except (SlimectlError, OSError, KeyError):
            return str(info["weight_version"])

    def _stale(self, info: dict) -> dict:
        """What the new actor needs to kill what is left of the lost engine: its pid, start time and host."""
        try:
            rec = self.registry.get(info["id"])
            return {"pid": rec.pid, "create_time": rec.create_time, "host": info["actor_host"]}
        except (SlimectlError, OSError):
            return {"pid": info["pid"], "create_time": None, "host": info["actor_host"]}

    def _kill(self, actor) -> None:
        """Ask the actor to kill its engine's process group (it may be dead or hung: then what is left is the
        new actor's to kill), then kill the actor."""
        ray = self.launcher.ray
        try:
            ray.get(actor.kill_engine.remote(), timeout=KILL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 — dead or stuck: killing it is what is left
            log.info("ray: the lost engine's actor did not kill its engine (%s)", str(exc).splitlines()[0][:200])
        ray.kill(actor, no_restart=True)


def frozen_group_actors(launcher, run: RunDir, cfg: SlimectlConfig):
    """:class:`~slimectl.stages.serve.FrozenGroups` under ``rl --launcher ray``: each frozen group of
    ``engine.groups`` (a teacher, a judge) as engine actors of its own (:class:`RayEngineActors` with its ``group``:
    started, registered, watched and healed like the actor's engines, at its model's version 0, never synced); an
    external group (engines started elsewhere) only registered, from the driver."""
    from slimectl.stages.serve import FrozenGroups

    frozen = FrozenGroups(run, cfg)
    for name in launcher.layout.frozen:
        frozen.groups[name] = RayEngineActors(launcher, run, cfg, group=name)
    return frozen
