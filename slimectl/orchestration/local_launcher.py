"""The local launcher of ``slimectl rl``: engines as child processes, the trainer in this process.

:class:`RunEngines` attaches to a running ``slimectl serve`` of the run, or starts engines owned by
this process (they die with it, even after ``kill -9``). :class:`InProcessTrainer` is the train
stage in this process and the weight sync from it: one trainer rank, or rank 0 of several (ranks > 0
follow it: :mod:`slimectl.orchestration.trainer_ranks`). The Ray launcher
(:mod:`slimectl.orchestration.ray_launcher`) runs the same trainer in its rank-0 worker; with
``train.tp*pp*dp`` > 1 the local launcher runs it as torchrun's rank 0
(:mod:`slimectl.orchestration.torchrun_trainer`).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import ExitStack, nullcontext

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import LockHeld, SlimectlError
from slimectl.contract.loop_bridge import LoopBridge
from slimectl.contract.rundir import RunDir
from slimectl.orchestration.trainer_ranks import Followers

log = logging.getLogger("slimectl.rl")


def _kill_orphan_engines(run: RunDir) -> None:
    """With no serve running, live registered engines (and the sglang-router in front of them) are
    leftovers of a killed serve/rl: stop them."""
    import psutil

    groups = ((run.engine_group(name), f"{name} engine") for name in run.engine_group_names())
    for registry, what in ((run.routers, "router"), (run.engines, "engine"), *groups):
        for rec in registry.list():
            if rec.alive():
                try:
                    p = psutil.Process(rec.pid)
                    p.terminate()
                    p.wait(10)
                except psutil.TimeoutExpired:
                    p.kill()
                except psutil.Error:
                    pass
                log.warning("stopped orphaned %s %s (pid %s) left by an earlier run", what, rec.url, rec.pid)
            if rec.alive() is not None:
                registry.unregister(rec.id)


class RunEngines:
    """The engines a run uses (:class:`~slimectl.orchestration.handles.EnginesInUse`): a running ``slimectl serve``'s,
    or an :class:`~slimectl.orchestration.handles.EngineSet` this process starts and owns — ``make_group(run, cfg)``,
    default :class:`~slimectl.stages.serve.EngineProcesses` (child processes) — with the frozen groups of
    ``engine.groups`` beside it (``make_frozen(run, cfg)``, default :class:`~slimectl.stages.serve.FrozenGroups`)."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...], stack: ExitStack,
                 make_group=None, make_frozen=None):
        from slimectl.stages.serve import EngineProcesses

        self.ids: dict[str, str | None] = {}
        self.group = None  # set when this process started the engines
        self.frozen = None  # the frozen groups (engine.groups) this process started with them
        self.registry = run.engines  # attached to a serve: followed (urls)
        self.sync_timeout_s = cfg.sync.timeout_s
        given = list(engine_urls) or list(cfg.engine.urls)
        if given:
            self.ids = {u.rstrip("/"): None for u in given}
            return
        serve_lock = run.lock("serve")
        try:
            serve_lock.acquire()
        except LockHeld:
            recs = run.engines.live()
            if not recs:
                raise SlimectlError(f"a `slimectl serve` holds {run.path} but registered no live engines yet; "
                                    f"wait for it or stop it") from None
            self.ids = {r.url.rstrip("/"): r.id for r in recs}
            log.info("using %d engine(s) of the running `slimectl serve`: %s", len(recs), ", ".join(self.ids))
            return
        stack.callback(serve_lock.release)
        _kill_orphan_engines(run)
        group = (make_group or EngineProcesses)(run, cfg)
        if isinstance(group, EngineProcesses):
            from slimectl.orchestration.heal_check import weights_check

            group.verify = weights_check(run, cfg)  # an engine the heartbeat starts again: its weights read back
        stack.callback(group.stop)
        group.start()
        self.group = group
        if cfg.engine.frozen_groups:  # a teacher, a judge: served beside the actor's engines, never synced
            from slimectl.stages.serve import FrozenGroups

            self.frozen = stack.enter_context((make_frozen or FrozenGroups)(run, cfg))
        self.ids = {e.url: e.id for e in group.engines}
        if cfg.rollout.async_mode == "fully_async":
            share_cores_with_engines(getattr(group, "engine_threads", {}))

    @property
    def urls(self) -> list[str]:
        """The engines in use: every one, less those the heartbeat found lost for good (attached to a ``serve``:
        the engines whose records are still there, at the URL each now says)."""
        if self.group is None and any(i is not None for i in self.ids.values()):
            self._follow_registry()
        lost = getattr(self.group, "lost", {})
        return [u for u in self.ids if u not in lost]

    def _follow_registry(self) -> None:
        """Attached to a ``serve``: an engine whose record is gone (its heartbeat could not bring it back) is no
        longer used; one registered again at another URL is used there."""
        recs = {r.id: r for r in self.registry.list()}
        ids = {}
        for url, rid in self.ids.items():
            if rid is None:
                ids[url] = rid
            elif rid in recs:
                ids[recs[rid].url.rstrip("/")] = rid
            else:
                log.warning("engine %s at %s is no longer registered (its serve lost it); going on without it", rid,
                            url)
        self.ids = ids

    def check_alive(self) -> None:
        if self.group is not None:
            self.group.check_alive()
        if self.frozen is not None:
            self.frozen.check_alive()

    def guard(self):
        """Held around a weight sync: the heartbeat neither probes nor restarts an engine meanwhile (this process's
        own; attached to a ``serve``, its heartbeat skips the engines the run's records say are held)."""
        if self.group is None:
            return self.registry.hold(self.sync_timeout_s) if self.ids and any(self.ids.values()) else nullcontext()
        lock = getattr(self.group, "lock", None)
        return lock if lock is not None else nullcontext()

    def heals(self) -> bool:
        """Whether the engines are watched (a lost one is restarted: a failed sync may be tried again): by this
        process's heartbeat, or by the ``serve`` this process is attached to (its records say so)."""
        if self.group is None:
            from slimectl.contract.rundir.registry import healed_by_owner

            return any(r.id in self.ids.values() and healed_by_owner(r) for r in self.registry.list())
        return getattr(self.group, "watcher", None) is not None

    def wait_healed(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until every engine's process runs again or is lost for good (attached to a
        ``serve``: until every engine's record is on a live process that answers, or gone)."""
        import time

        if self.group is None:
            from slimectl.engines.health import wait_registered

            late = wait_registered(self.registry, list(self.ids.values()), timeout)
            if late:
                log.warning("engine(s) %s not back after %gs; syncing them anyway", ", ".join(late), timeout)
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.guard():
                if all(w.poll() is None for w in self.group.watched()):
                    return
            time.sleep(0.1)


def share_cores_with_engines(engine_threads: dict) -> int | None:
    """Fully async on CPU: this process's trainer runs beside the embedded engines it started, so it takes the
    cores they leave (at least one) instead of torch's default of every core. Threads that outnumber the cores
    stall one another (each parallel op waits for its preempted thread): on 2 cores a SmolLM2-135M train step
    beside the generating engine took ~9.5 s with 2 threads and ~8.4 s with 1. Returns the threads set (None:
    an engine's thread count is torch's own choice, or none was started here: nothing changed)."""
    if not engine_threads or any(t is None for t in engine_threads.values()):
        return None
    import torch

    from slimectl.stages.serve import available_cpus

    threads = max(1, available_cpus() - sum(engine_threads.values()))
    torch.set_num_threads(threads)
    log.info("fully async: the trainer uses %d thread(s), the %d embedded engine(s) %d", threads,
             len(engine_threads), sum(engine_threads.values()))
    return threads


def open_engine_clients(cfg: SlimectlConfig, urls, bridge: LoopBridge, stack: ExitStack) -> dict:
    """{url: EngineClient} for ``urls``, closed (on ``bridge``'s loop) when ``stack`` unwinds."""
    from slimectl.engines.client import EngineClient

    token = cfg.engine.token()
    clients = {u: EngineClient(u, token=token, timeout=cfg.sync.timeout_s) for u in urls}

    async def close_clients() -> None:
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

    stack.callback(lambda: bridge.run(close_clients()))
    return clients


class InProcessTrainer:
    """The train stage in this process (one rank, or rank 0 of several), and the weight sync from it: the
    trainer of :class:`LocalLauncher`, of torchrun's rank 0 and of the Ray trainer's rank 0 (a
    :class:`~slimectl.orchestration.handles.TrainerHandle`).

    Takes the ``train`` lock; trains each rollout exactly once (:class:`Trainer`); syncs the
    engines from its live weights (distributed transport) or from ``weights/N`` (disk). With several trainer
    ranks, ``followers`` announces each collective operation to ranks > 0
    (:mod:`slimectl.orchestration.trainer_ranks`)."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack, critic_factory=None,
                 followers: Followers | None = None):
        from slimectl.stages.train.trainer import Trainer

        self.run, self.cfg, self.stack = run, cfg, stack
        self.disk = cfg.sync.transport == "disk"
        self.trainer = Trainer(run, cfg, stack.enter_context(run.lock("train")), critic_factory=critic_factory)
        stack.callback(self.trainer.close)  # a checkpoint still being written is published before the lock goes
        self.followers = followers or Followers()
        self.bridge = self.clients = self.transport = self.metrics = None
        self._open_passes: list = []  # the passes over the live tensors of the sync under way

    @property
    def weight_version(self) -> int:
        return self.trainer.weight_version

    def connect(self, bridge: LoopBridge, clients: dict) -> None:
        """Open the train metrics and the weight transport to ``clients`` (run on ``bridge``'s loop)."""
        from slimectl.contract.metrics import MetricsWriter
        from slimectl.stages.sync.transport import make_transport

        self.bridge, self.clients = bridge, clients
        transport = make_transport(self.cfg.sync.transport, self.cfg.sync)
        self.stack.callback(lambda: bridge.run(transport.close(clients)))
        tb = self.run.tensorboard_dir("train") if self.cfg.logging.tensorboard else None
        self.metrics = self.stack.enter_context(MetricsWriter(
            self.run.metrics_path("train"), tb, resume_step=self.trainer.actor.step,
            reason=f"resumed at rollout {self.trainer.next_rollout}"))
        bridge.run(transport.connect(clients))
        self.transport = transport

    def reconnect(self) -> None:
        """Build the weight transport again (a new weight-update group under the distributed transport) for the
        engines now in ``clients``: one the heartbeat started again is not in the old group."""
        from slimectl.stages.sync.transport import make_transport

        clients, bridge = self.clients, self.bridge
        bridge.run(self.transport.close(clients))
        transport = make_transport(self.cfg.sync.transport, self.cfg.sync)
        self.stack.callback(lambda: bridge.run(transport.close(clients)))
        bridge.run(transport.connect(clients))
        self.transport = transport

    def _source(self, version: int):
        from slimectl.weight_formats import weight_format

        form = weight_format(self.cfg)
        if not self.disk:
            def passes():  # each pass over the tensors is an operation of every trainer rank (their gathers)
                self.followers.announce("tensor_pass")
                tensors = iter(self.trainer.iter_hf_tensors())
                self._open_passes.append(tensors)
                for item in tensors:  # not `yield from`: closing this generator must leave the pass open
                    yield item

            return form.source_from_tensors(version, passes)
        if version == 0 and not self.run.weights.exists(0):
            return form.source_from_dir(0, self.cfg.model.path)
        if not self.run.weights.exists(version):  # publishing is collective over the trainer ranks
            self.followers.announce("publish_weights", version)
            self.trainer.publish(version - 1, version, checkpoint=False, weights=True)
        return form.source_from_dir(version, self.run.weights.get(version).path)

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        """Load weight version ``version`` into every engine; its sync metrics and seconds."""
        from slimectl.stages.sync import sync_engines

        s = self.cfg.sync
        with self.run.stage_log("sync"):
            try:
                res = self.bridge.run(sync_engines(self.clients, self.transport, self._source(version),
                                                   self.cfg.effective_pause_mode, s.verify, tracer=self.run.tracer("sync")))
            finally:
                if not self.disk:
                    self._finish_passes()
        return res.metrics(), res.seconds

    def _finish_passes(self) -> None:
        """Walk each pass over the tensors that a failed push left unfinished (a dead engine): ranks > 0 are
        inside its TP/PP gathers, and would wait there forever (or pair them with the next collective)."""
        passes, self._open_passes = self._open_passes, []
        for tensors in passes if self.followers.group is not None else ():
            for _ in tensors:
                pass

    def train(self, rid: int, art, last: bool) -> list[dict]:
        """Train on rollout ``rid`` (its READY artifact ``art``); the per-step train metrics."""
        with self.followers.operation("train", rid, last), self.run.stage_log("train"):
            return self.trainer.train_rollout(rid, art, self.metrics, publish_weights=self.disk, last=last)

    def checkpoint_if_behind(self) -> bool:
        """Checkpoint what was trained since the last checkpoint (a stop between rollouts)."""
        with self.followers.operation("checkpoint_if_behind"), self.run.stage_log("train"):
            return self.trainer.checkpoint_if_behind()

    def stop(self) -> None:
        """Tell the other trainer ranks (if any) to return: the loop's last word to the trainer."""
        self.followers.stop()


class LocalLauncher:
    """The default launcher: engines as child processes of this one (or a running serve's), the
    train stage in this process. Needs nothing beyond slimectl itself."""

    name = "local"

    def start_trainer(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack) -> InProcessTrainer:
        return InProcessTrainer(run, cfg, stack)

    def start_engines(self, run: RunDir, cfg: SlimectlConfig, engine_urls, stack: ExitStack) -> RunEngines:
        return RunEngines(run, cfg, engine_urls, stack)
