"""``slimectl rl``: serve → (sync → rollout → train)* in one process tree, resumable.

The stages are the very code of the standalone subcommands: :func:`run_rollout` produces
``rollouts/N``, :class:`Trainer` (the train stage) consumes it exactly once and publishes,
:func:`sync_engines` moves the new weights in. They still meet only through the run directory
and the engine protocol; this module just sequences them.

Loop, for rollout ids from the train cursor to ``rollout.num_rollout``:

- ``rollout.async_mode = off`` (synchronous): rollout N on weights N → train N → sync N+1.
- ``one_step_off``: rollout N+1 is generated (on weights N) while train N runs; the sync of
  N+1 first drains it, so a rollout is at most one version stale (``rl/staleness``).
- ``fully_async``: a rollout follower (:func:`~slimectl.stages.rollout.follow.follow_rollouts`, the code of
  ``rollout --follow``) generates all the time on a thread of its own, at most ``rollout.max_staleness``
  versions ahead of the weights the engines were last synced to; this thread trains each rollout as it is
  published and syncs the new weights while requests are in flight (``sync.pause_mode``: retract).

One event loop serves the whole process: the session's
:class:`~slimectl.contract.loop_bridge.LoopBridge`, which runs the engine clients, the weight transport,
every rollout (this thread's, the one-step-off thread's, the follower's) and eval, each thread handing it
its coroutines.

Engines: the registered ones when a ``slimectl serve`` is running for this run directory;
otherwise ``rl`` starts its own (they die with it, even after ``kill -9``). Before the first
rollout the actor's current weights are synced, so a rerun after a crash continues on the
weights the checkpoint holds. Rollouts already published are reused, never regenerated.

Where engines and trainer run is the launcher's choice:
:class:`~slimectl.orchestration.local_launcher.LocalLauncher` (the default) starts engines as child
processes and trains in this process; :mod:`slimectl.orchestration.ray_launcher` places both as Ray
workers. Either way the loop below sequences the same stage code.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.contract.faults import fault_point
from slimectl.contract.loop_bridge import LoopBridge
from slimectl.contract.rundir import RunDir
from slimectl.orchestration.handles import EnginesInUse, Launcher, TrainerHandle

log = logging.getLogger("slimectl.rl")


@dataclass
class RLResult:
    trained: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    weight_version: int = 0
    seconds: float = 0.0


def make_launcher(name: str = "local", address: str | None = None, colocate: bool | None = None):
    """The launcher ``run_rl`` places engines and trainer with (``local`` or ``ray``); Ray is imported
    only for ``ray``, and its options are refused for ``local``."""
    if name == "local":
        from slimectl.orchestration.local_launcher import LocalLauncher

        for flag, value in (("--address", address), ("--colocate/--no-colocate", colocate)):
            if value is not None:
                raise UsageError(f"{flag} places actors on Ray; add --launcher ray")
        return LocalLauncher()
    if name != "ray":
        raise UsageError(f"--launcher {name!r}: expected local or ray")
    from slimectl.orchestration.ray_launcher import RayLauncher

    return RayLauncher(address=address, colocate=bool(colocate))


def run_rl(run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...] = (),
           stop: threading.Event | None = None, critical=nullcontext, launcher: Launcher | None = None) -> RLResult:
    """Run the loop until ``rollout.num_rollout`` rollouts are trained (or ``stop`` is set).

    ``critical()`` wraps each weight sync (``InterruptOnSignal.deferred`` keeps a signal from cutting
    a pause/continue sequence in half). ``launcher`` places the engines and the trainer
    (default :class:`LocalLauncher`)."""
    from slimectl.orchestration.local_launcher import LocalLauncher
    from slimectl.stages.rollout.stage import check_prompt_data

    check_prompt_data(cfg)  # the data and its keys, before any engine or trainer starts
    launcher = launcher or LocalLauncher()
    t_start = time.perf_counter()
    result = RLResult()
    with ExitStack() as stack:
        stack.enter_context(run.lock("rl"))
        stack.enter_context(run.stage_log("rl"))
        trainer = launcher.start_trainer(run, cfg, stack)
        start = result.weight_version = trainer.weight_version  # version N = trained on rollouts 0..N-1
        if start >= cfg.rollout.num_rollout:
            log.info("all %d rollouts are trained; nothing to do (to go on: slimectl extend -r %s --num-rollout N)",
                     cfg.rollout.num_rollout, run.path)
            return result
        engines = launcher.start_engines(run, cfg, engine_urls, stack)
        log.info("resuming at rollout %d, %d to go (%s loop, %s sync, %d engine(s))", start,
                 cfg.rollout.num_rollout - start, LOOP_NAMES[cfg.rollout.async_mode], cfg.sync.transport,
                 len(engines.urls))
        RLSession(run, cfg, trainer, engines, stack, critical, result).run_rollouts(start, stop or threading.Event())
        result.seconds = time.perf_counter() - t_start
        return result


LOOP_NAMES = {"off": "synchronous", "one_step_off": "one-step-off async", "fully_async": "fully async"}


class RLSession:
    """One ``rl`` process's loop over its rollouts, with the trainer and the engines started: the engine
    clients, the sync and rl metrics, and (one-step-off) the thread that generates the next rollout."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, trainer: TrainerHandle, engines: EnginesInUse,
                 stack: ExitStack, critical, result: RLResult):
        from slimectl.contract.metrics import MetricsWriter
        from slimectl.engines.client import KeptConnections
        from slimectl.orchestration.local_launcher import open_engine_clients

        self.run, self.cfg, self.trainer, self.engines, self.critical, self.result = \
            run, cfg, trainer, engines, critical, result
        # The process's one event loop: the clients, the transport, every rollout (this thread's, the one-step-off
        # thread's, the fully async follower's) and eval run on it, handed over through this bridge.
        self.bridge = LoopBridge()
        stack.callback(self.bridge.close)
        self.clients = open_engine_clients(cfg, engines.urls, self.bridge, stack)
        tb = (lambda s: run.tensorboard_dir(s)) if cfg.logging.tensorboard else (lambda s: None)
        self.sync_metrics = stack.enter_context(MetricsWriter(run.metrics_path("sync"), tb("sync")))
        self.rl_metrics = stack.enter_context(MetricsWriter(run.metrics_path("rl"), tb("rl")))
        # One keep-alive session per engine for every rollout of this process (on this thread, or the
        # one-step-off rollout thread).
        self.kept = KeptConnections(bridge=self.bridge)
        stack.callback(self.kept.close)  # (after the rollout thread is shut down)
        self.synced = 0
        """The weight version the engines were last synced to (fully_async: the staleness bound counts from it)."""
        self._group_processes: dict[str, int | None] | None = None
        """``sync.transport: distributed``: the engines' processes when the weight-update group was built."""

    def sync(self, version: int) -> float:
        """Load weight version ``version`` into the engines in use; tried once more, after the heartbeat has
        restarted them, when an engine was lost during it."""
        for attempt in (1, 2):
            self.engines.check_alive()
            self._drop_lost_clients()
            try:
                with self.engines.guard(), self.critical():
                    self._rebuild_group_for_restarted_engines()
                    metrics, seconds = self.trainer.sync(version)
                    # recorded before the heartbeat may look again: an engine lost right after this sync is started
                    # again at the version its record says, which must be this one
                    self.run.engines.set_weight_version(self.engines.ids.values(), str(version))
                break
            except SlimectlError as exc:
                if attempt == 2 or not self.engines.heals():
                    raise
                log.warning("sync of weight version %d failed (%s); syncing again once the lost engine is back",
                            version, exc)
                self.engines.wait_healed(self.cfg.engine.startup_timeout_s)
        self.synced = version
        self.sync_metrics.log(version, metrics)
        return seconds

    def _engine_processes(self) -> dict[str, int | None]:
        """Each engine in use's record id -> its process id now (an engine the heartbeat started again: a new one)."""
        ids = set(self.engines.ids.values()) - {None}
        return {r.id: r.pid for r in self.run.engines.list() if r.id in ids}

    def _rebuild_group_for_restarted_engines(self) -> None:
        """``sync.transport: distributed``: an engine started again since the weight-update group was built (or one
        lost for good) is not in the group; build it again over the engines now in use, and the sync sends it the
        full weights from the trainer. (Held under the engines' guard: no heal meanwhile.)"""
        if self.cfg.sync.transport != "distributed":
            return
        now = self._engine_processes()
        if self._group_processes is None or now == self._group_processes:
            self._group_processes = now
            return
        changed = sorted(set(now.items()) ^ set(self._group_processes.items()))
        reconnect = getattr(self.trainer, "reconnect", None)
        if reconnect is None:
            raise SlimectlError(f"engine(s) {', '.join(sorted({i for i, _ in changed}))} were started again since the "
                                f"weight-update group was built, and this launcher cannot build it again; rerun rl "
                                f"(it resumes from the last checkpoint)")
        log.warning("engine(s) %s started again or lost since the weight-update group was built; building it again",
                    ", ".join(sorted({i for i, _ in changed})))
        reconnect()
        self._group_processes = now

    def _drop_lost_clients(self) -> None:
        """Engines lost for good (``engine.on_lost: continue``) get no more syncs; one a ``serve`` this process is
        attached to registered again at another URL gets them there (the clients dict is the trainer's too)."""
        from slimectl.engines.client import EngineClient

        urls = self.engines.urls
        for url in [u for u in self.clients if u not in urls]:
            client = self.clients.pop(url)
            try:
                self.bridge.run(client.close())
            except Exception:  # noqa: BLE001 — closing a client of a gone engine
                pass
        for url in [u for u in urls if u not in self.clients]:
            self.clients[url] = EngineClient(url, token=self.cfg.engine.token(), timeout=self.cfg.sync.timeout_s)

    def rollout(self, rid: int):
        """``rollouts/RID``, generated unless already published (never regenerated)."""
        from slimectl.stages.rollout.stage import run_rollout

        if not self.run.rollouts.exists(rid):
            self.engines.check_alive()
            run_rollout(self.run, self.cfg, rid, self.engines.urls, connections=self.kept)
            self.result.generated.append(rid)
        return self.run.rollouts.get(rid, verify="full")

    def run_rollouts(self, start: int, stop: threading.Event) -> None:
        """Sync the trainer's weights, then (rollout, train, sync, eval) for each rollout from ``start``."""
        n_total = self.cfg.rollout.num_rollout
        one_step_off = self.cfg.rollout.async_mode == "one_step_off"
        with self.critical():
            self.trainer.connect(self.bridge, self.clients)
        self.bridge.run(resume_released_engines(self.clients))  # left released by a run killed in training
        self.sync(self.trainer.weight_version)
        if self.cfg.rollout.async_mode == "fully_async":
            return self.run_fully_async(start, stop)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-rollout")
        ahead: Future | None = None
        tracer = self.run.tracer("train")
        try:
            for rid in range(start, n_total):
                if stop.is_set():
                    log.info("stopping before rollout %d", rid)
                    _checkpoint_before_stopping(self.trainer)
                    break
                t0 = time.perf_counter()
                with tracer.wait("rollout", rollout=rid):  # the trainer waits for the rollout it trains next
                    art = ahead.result() if ahead is not None else self.rollout(rid)
                t_rollout = time.perf_counter() - t0
                ahead = pool.submit(self.rollout, rid + 1) if one_step_off and rid + 1 < n_total else None
                fault_point("rl.rollout_in_flight") if ahead is not None else None
                self.step(rid, art, ahead, t0, t_rollout)
        except KeyboardInterrupt:
            _checkpoint_before_stopping(self.trainer)
            raise
        finally:
            stop.set()
            if ahead is not None and not ahead.done():
                for c in self.clients.values():  # unblock the rollout still in flight
                    try:
                        self.bridge.run(c.abort_request(abort_all=True))
                    except Exception:
                        pass
            pool.shutdown(wait=True, cancel_futures=True)

    def run_fully_async(self, start: int, stop: threading.Event) -> None:
        """Train each rollout the follower thread publishes, as it appears, and sync after each."""
        from slimectl.contract.errors import WaitTimeout
        from slimectl.stages.rollout.follow import follow_rollouts

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-rollout")
        follower = pool.submit(follow_rollouts, self.run, self.cfg, self.engines.urls, stop, lambda: self.synced,
                               bridge=self.bridge)
        tracer = self.run.tracer("train")
        try:
            for rid in range(start, self.cfg.rollout.num_rollout):
                t0 = time.perf_counter()
                try:
                    with tracer.wait("rollout", rollout=rid):
                        art = self.run.rollouts.wait_for(rid, verify="full", poll=0.01,
                                                         should_stop=lambda: stop.is_set() or follower.done())
                except WaitTimeout:
                    if follower.done() and not stop.is_set():
                        follower.result()  # the follower's failure, raised here
                        raise SlimectlError(f"the rollout follower stopped before publishing rollout {rid}") from None
                    log.info("stopping before rollout %d", rid)
                    _checkpoint_before_stopping(self.trainer)
                    break
                self.engines.check_alive()
                self.step(rid, art, None, t0, time.perf_counter() - t0)
        except KeyboardInterrupt:
            _checkpoint_before_stopping(self.trainer)
            raise
        finally:
            stop.set()  # (the follower's stop too)
            pool.shutdown(wait=True)
        if follower.exception() is not None:
            raise follower.exception()

    def step(self, rid: int, art, ahead: Future | None, t0: float, t_rollout: float) -> None:
        """Rollout ``rid`` generated (``art``): train on it, drain the one-step-off rollout, sync, eval, log."""
        n_total = self.cfg.rollout.num_rollout
        t1 = time.perf_counter()
        offload = self.cfg.engine.offload_during_train and ahead is None
        with self.engines.guard() if offload else nullcontext():  # no heartbeat to engines without their memory
            if offload:
                release_engines(self.bridge, self.clients)
            try:
                steps = self.trainer.train(rid, art, last=rid == n_total - 1)
            except BaseException:
                if offload:  # engines that outlive this run (a `serve`'s) take their memory back for the rerun's sync
                    _resume_quietly(self.bridge, self.clients)
                raise
            t_train = time.perf_counter() - t1
            self.result.trained.append(rid)
            t2 = time.perf_counter()
            if ahead is not None:
                ahead.result()  # drain: rollout rid+1 finishes on weights rid before they change
            t_drain = time.perf_counter() - t2
            if offload:
                resume_engines(self.bridge, self.clients, ["weights"])
            t_sync = self.sync(rid + 1)
            if offload:
                resume_engines(self.bridge, self.clients, ["kv_cache"])
        self.result.weight_version = rid + 1
        t_eval = self.evaluate(rid)
        total = time.perf_counter() - t0
        staleness = rid - int(art.meta.get("weight_version") or 0)
        rec = {"rl/staleness": staleness, "rl/reward_mean": art.meta.get("reward_mean"),
               "perf/rl_step_time": total, "perf/rl_rollout_wait_time": t_rollout + t_drain,
               "perf/rl_train_time": t_train, "perf/rl_sync_time": t_sync, "perf/rl_eval_time": t_eval,
               "perf/rl_other_time": max(0.0, total - t_rollout - t_drain - t_train - t_sync - t_eval),
               "train/loss": steps[-1].get("train/loss") if steps else None}
        self.rl_metrics.log(rid, {k: v for k, v in rec.items() if v is not None})
        log.info("rl %d/%d: reward %.3f, staleness %d, rollout %.2f s, train %.2f s, sync %.2f s, step %.2f s",
                 rid + 1, n_total, art.meta.get("reward_mean") or 0.0, staleness, t_rollout + t_drain, t_train,
                 t_sync, total)

    def evaluate(self, rid: int) -> float:
        """Evaluate weight version ``rid + 1`` at the eval interval (and at the end); its seconds."""
        cfg = self.cfg
        ev = cfg.rollout.eval_interval
        if not (cfg.data.eval_data and ev and ((rid + 1) % ev == 0 or rid == cfg.rollout.num_rollout - 1)):
            return 0.0
        from slimectl.stages.rollout.eval import run_eval

        t = time.perf_counter()
        run_eval(self.run, cfg, rid + 1, self.engines.urls, bridge=self.bridge)
        return time.perf_counter() - t


def _checkpoint_before_stopping(trainer) -> None:
    """A stop (SIGTERM, Ctrl-C) between two rollouts: checkpoint the rollouts trained since the last
    checkpoint (``train.save_interval`` > 1), as a standalone ``train`` does, so the rerun resumes
    where this run stopped instead of training them again. A stop in the middle of a rollout's
    training checkpoints nothing: the rerun resumes from the last checkpoint."""
    try:
        if trainer.checkpoint_if_behind():
            log.info("checkpointed the rollouts trained since the last checkpoint before stopping")
    except Exception as exc:  # stopping anyway: the last checkpoint still holds
        log.warning("could not checkpoint before stopping (%s); the rerun resumes from the last checkpoint", exc)


async def _gather(coros) -> list:
    return await asyncio.gather(*coros)


def release_engines(bridge: LoopBridge, clients: dict) -> None:
    """Colocated training: every engine frees its memory (weights and KV cache) for the trainer."""
    bridge.run(_gather([c.release_memory_occupation() for c in clients.values()]))


def resume_engines(bridge: LoopBridge, clients: dict, tags: list[str]) -> None:
    bridge.run(_gather([c.resume_memory_occupation(tags) for c in clients.values()]))


async def resume_released_engines(clients: dict) -> list[str]:
    """Engines that report memory released (``memory_released`` in ``/server_info``: a colocated run
    killed while it trained, by ``kill -9``, left a ``serve``'s engines so) take it back before the
    first sync, which then loads their weights. Engines that do not report it (SGLang) are left as
    they are. Returns the URLs resumed."""
    async def released(client) -> bool:
        try:
            return bool((await client.get_server_info()).get("memory_released"))
        except Exception:  # noqa: BLE001 — an engine that cannot say is not resumed; the sync reports it
            return False

    flags = await _gather([released(c) for c in clients.values()])
    resumed = [url for url, flag in zip(clients, flags) if flag]
    if resumed:
        log.info("resuming the memory of %s, released by a run that stopped while it trained", ", ".join(resumed))
        await _gather([clients[u].resume_memory_occupation(None) for u in resumed])
    return resumed


def _resume_quietly(bridge: LoopBridge, clients: dict) -> None:
    """Best effort, on the way out after a failed or stopped training: every engine takes its memory back
    (its weights stay unloaded until the next sync pushes them)."""
    try:
        resume_engines(bridge, clients, None)
    except Exception as exc:
        log.warning("could not resume the engines' memory (%s); POST /resume_memory_occupation to each", exc)
