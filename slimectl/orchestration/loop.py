"""``slimectl rl``: serve → (sync → rollout → train)* in one process tree, resumable.

The stages are the very code of the standalone subcommands: :func:`run_rollout` produces
``rollouts/N``, :class:`Trainer` (the train stage) consumes it exactly once and publishes,
:func:`sync_engines` moves the new weights in. They still meet only through the run directory
and the engine protocol; this module just sequences them.

Loop, for rollout ids from the train cursor to ``rollout.num_rollout``:

- ``rollout.async_mode = off`` (synchronous): rollout N on weights N → train N → sync N+1.
- ``one_step_off``: rollout N+1 is generated (on weights N) while train N runs; the sync of
  N+1 first drains it, so a rollout is at most one version stale (``rl/staleness``).

Engines: the registered ones when a ``slimectl serve`` is running for this run directory;
otherwise ``rl`` starts its own (they die with it, even after ``kill -9``). Before the first
rollout the actor's current weights are synced, so a rerun after a crash continues on the
weights the checkpoint holds. Rollouts already published are reused, never regenerated.

Where engines and trainer run is the launcher's choice: :class:`LocalLauncher` (the default)
starts engines as child processes and trains in this process; ``slimectl.orchestration.ray_launcher``
places both as Ray actors. Either way the loop below sequences the same stage code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

from slimectl.contract.config import SlimectlConfig
from slimectl.contract.errors import LockHeld, SlimectlError, UsageError
from slimectl.contract.rundir import RunDir

log = logging.getLogger("slimectl.rl")


@dataclass
class RLResult:
    trained: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    weight_version: int = 0
    seconds: float = 0.0


def _kill_orphan_engines(run: RunDir) -> None:
    """With no serve running, live registered engines are leftovers of a killed serve/rl: stop them."""
    import psutil

    for rec in run.engines.list():
        if rec.alive():
            try:
                p = psutil.Process(rec.pid)
                p.terminate()
                p.wait(10)
            except psutil.TimeoutExpired:
                p.kill()
            except psutil.Error:
                pass
            log.warning("stopped orphaned engine %s (pid %s) left by an earlier run", rec.url, rec.pid)
        if rec.alive() is not None:
            run.engines.unregister(rec.id)


class Engines:
    """Attach to a running ``slimectl serve`` of this run, or start engines owned by this process.

    ``make_group(run, cfg)`` builds what starts them: an :class:`~slimectl.stages.serve.EngineGroup`
    (child processes), or a launcher's equivalent with the same ``start``/``stop``/``engines``/
    ``check_alive``."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...], stack: ExitStack,
                 make_group=None):
        from slimectl.stages.serve import EngineGroup

        self.ids: dict[str, str | None] = {}
        self.group = None  # set when this process started the engines
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
        group = (make_group or EngineGroup)(run, cfg)
        stack.callback(group.stop)
        group.start()
        self.group = group
        self.ids = {e.url: e.id for e in group.engines}

    @property
    def urls(self) -> list[str]:
        return list(self.ids)

    def check_alive(self) -> None:
        if self.group is not None:
            self.group.check_alive()


def open_engine_clients(cfg: SlimectlConfig, urls, loop, stack: ExitStack) -> dict:
    """{url: EngineClient} for ``urls``, closed (on ``loop``) when ``stack`` unwinds."""
    from slimectl.engines.client import EngineClient

    token = os.environ.get(cfg.engine.token_env) or None
    clients = {u: EngineClient(u, token=token, timeout=cfg.sync.timeout_s) for u in urls}

    async def close_clients() -> None:
        await asyncio.gather(*(c.close() for c in clients.values()), return_exceptions=True)

    stack.callback(lambda: loop.run_until_complete(close_clients()))
    return clients


class InProcessTrainer:
    """The train stage in this process (one rank), and the weight sync from it: the trainer of
    :class:`LocalLauncher`, and what each Ray trainer actor runs inside itself.

    Takes the ``train`` lock; trains each rollout exactly once (:class:`Trainer`); syncs the
    engines from its live weights (distributed transport) or from ``weights/N`` (disk)."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack):
        from slimectl.stages.train import Trainer

        self.run, self.cfg, self.stack = run, cfg, stack
        self.disk = cfg.sync.transport == "disk"
        self.trainer = Trainer(run, cfg, stack.enter_context(run.lock("train")))
        self.loop = self.clients = self.transport = self.metrics = None

    @property
    def weight_version(self) -> int:
        return self.trainer.weight_version

    def connect(self, loop, clients: dict) -> None:
        """Open the train metrics and the weight transport to ``clients`` (run on ``loop``)."""
        from slimectl.contract.metrics import MetricsWriter
        from slimectl.stages.sync.transport import make_transport

        self.loop, self.clients = loop, clients
        transport = make_transport(self.cfg.sync.transport, self.cfg.sync)
        self.stack.callback(lambda: loop.run_until_complete(transport.close(clients)))
        tb = self.run.tensorboard_dir("train") if self.cfg.logging.tensorboard else None
        self.metrics = self.stack.enter_context(MetricsWriter(self.run.metrics_path("train"), tb))
        loop.run_until_complete(transport.connect(clients))
        self.transport = transport

    def _source(self, version: int):
        from slimectl.stages.sync import WeightSource
        from slimectl.stages.train import broadcast_from_rank0

        if not self.disk:
            def passes():  # several trainer ranks: each pass is announced to ranks > 0 (FollowerTrainer)
                broadcast_from_rank0("pass")
                yield from self.trainer.iter_hf_tensors()

            return WeightSource.from_tensors(version, passes)
        # Publishing is collective over the trainer ranks (a Ray trainer with several): rank 0 decides.
        if broadcast_from_rank0(not self.run.weights.exists(version)):
            if version == 0:
                return WeightSource.from_dir(0, self.cfg.model.path)
            self.trainer.publish(version - 1, version, checkpoint=False, weights=True)
        return WeightSource.from_dir(version, self.run.weights.get(version).path)

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        """Load weight version ``version`` into every engine; its sync metrics and seconds."""
        from slimectl.stages.sync import sync_engines
        from slimectl.stages.train import broadcast_from_rank0

        s = self.cfg.sync
        try:
            res = self.loop.run_until_complete(sync_engines(self.clients, self.transport, self._source(version),
                                                            s.pause_mode, s.verify))
        finally:
            if not self.disk:
                broadcast_from_rank0("done")  # no-op with one trainer rank
        return res.metrics(), res.seconds

    def train(self, rid: int, art, last: bool) -> list[dict]:
        """Train on rollout ``rid`` (its READY artifact ``art``); the per-step train metrics."""
        return self.trainer.train_rollout(rid, art, self.metrics, publish_weights=self.disk, last=last)


class FollowerTrainer:
    """Trainer rank > 0 of a trainer with several ranks (``rl --launcher ray`` with
    ``train.tp*pp*dp > 1``): it joins every collective of rank 0's :class:`InProcessTrainer` —
    training, checkpoint and weight publishing, the TP/PP gathers of a distributed sync — and,
    like the ranks > 0 of ``slimectl train`` under torchrun, holds no lock, writes nothing to the
    run directory and talks to no engine."""

    def __init__(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack):
        from slimectl.stages.train import FollowerLock, Trainer

        self.run, self.cfg = run, cfg
        self.disk = cfg.sync.transport == "disk"
        self.trainer = Trainer(run, cfg, FollowerLock())

    @property
    def weight_version(self) -> int:
        return self.trainer.weight_version

    def connect(self, loop, clients: dict) -> None:
        return None

    def sync(self, version: int) -> tuple[dict[str, float], float]:
        """Take part in rank 0's sync of weight version ``version``."""
        from slimectl.stages.train import broadcast_from_rank0

        if self.disk:
            if broadcast_from_rank0(None) and version != 0:
                self.trainer.publish(version - 1, version, checkpoint=False, weights=True)
        else:
            # Rank 0 announces each pass over its tensors (one per push, one more to verify) and
            # the end of the sync; the TP/PP gathers of every pass need every rank.
            while broadcast_from_rank0(None) == "pass":
                for _ in self.trainer.iter_hf_tensors():
                    pass
        return {}, 0.0

    def train(self, rid: int, art, last: bool) -> list[dict]:
        from slimectl.stages.train import NullMetrics

        return self.trainer.train_rollout(rid, art, NullMetrics(), publish_weights=self.disk, last=last)


class LocalLauncher:
    """The default launcher: engines as child processes of this one (or a running serve's), the
    train stage in this process. Needs nothing beyond slimectl itself."""

    name = "local"

    def start_trainer(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack) -> InProcessTrainer:
        return InProcessTrainer(run, cfg, stack)

    def start_engines(self, run: RunDir, cfg: SlimectlConfig, engine_urls, stack: ExitStack) -> Engines:
        return Engines(run, cfg, engine_urls, stack)


def run_rl(run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...] = (),
           stop: threading.Event | None = None, critical=nullcontext, launcher=None) -> RLResult:
    """Run the loop until ``rollout.num_rollout`` rollouts are trained (or ``stop`` is set).

    ``critical()`` wraps each weight sync (``StopSignals.deferred`` keeps a signal from cutting
    a pause/continue sequence in half). ``launcher`` places the engines and the trainer
    (default :class:`LocalLauncher`)."""
    from slimectl.contract.metrics import MetricsWriter
    from slimectl.stages.rollout.stage import run_rollout

    if cfg.data.prompt_data is None:
        raise UsageError("data.prompt_data is not set; point it at a .jsonl or .parquet prompt file")
    launcher = launcher or LocalLauncher()
    stop = stop or threading.Event()
    t_start = time.perf_counter()
    result = RLResult()
    n_total = cfg.rollout.num_rollout
    one_step_off = cfg.rollout.async_mode == "one_step_off"
    with ExitStack() as stack:
        stack.enter_context(run.lock("rl"))
        trainer = launcher.start_trainer(run, cfg, stack)
        start = result.weight_version = trainer.weight_version  # version N = trained on rollouts 0..N-1
        if start >= n_total:
            log.info("all %d rollouts are trained; nothing to do", n_total)
            return result
        engines = launcher.start_engines(run, cfg, engine_urls, stack)
        log.info("resuming at rollout %d, %d to go (%s loop, %s sync, %d engine(s))", start, n_total - start,
                 "one-step-off async" if one_step_off else "synchronous", cfg.sync.transport, len(engines.urls))

        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        clients = open_engine_clients(cfg, engines.urls, loop, stack)
        tb = (lambda s: run.tensorboard_dir(s)) if cfg.logging.tensorboard else (lambda s: None)
        sync_metrics = stack.enter_context(MetricsWriter(run.metrics_path("sync"), tb("sync")))
        rl_metrics = stack.enter_context(MetricsWriter(run.metrics_path("rl"), tb("rl")))

        def sync(version: int) -> float:
            engines.check_alive()
            with critical():
                metrics, seconds = trainer.sync(version)
            run.engines.set_weight_version(engines.ids.values(), str(version))
            sync_metrics.log(version, metrics)
            return seconds

        def rollout(rid: int):
            if not run.rollouts.exists(rid):
                engines.check_alive()
                run_rollout(run, cfg, rid, engines.urls)
                result.generated.append(rid)
            return run.rollouts.get(rid, verify="full")

        with critical():
            trainer.connect(loop, clients)
        sync(trainer.weight_version)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimectl-rollout")
        ahead: Future | None = None
        try:
            for rid in range(start, n_total):
                if stop.is_set():
                    log.info("stopping before rollout %d", rid)
                    break
                t0 = time.perf_counter()
                art = ahead.result() if ahead is not None else rollout(rid)
                t_rollout = time.perf_counter() - t0
                ahead = pool.submit(rollout, rid + 1) if one_step_off and rid + 1 < n_total else None
                t1 = time.perf_counter()
                offload = cfg.engine.offload_during_train and ahead is None
                if offload:
                    release_engines(loop, clients)
                steps = trainer.train(rid, art, last=rid == n_total - 1)
                t_train = time.perf_counter() - t1
                result.trained.append(rid)
                t2 = time.perf_counter()
                if ahead is not None:
                    ahead.result()  # drain: rollout rid+1 finishes on weights rid before they change
                t_drain = time.perf_counter() - t2
                if offload:
                    resume_engines(loop, clients, ["weights"])
                t_sync = sync(rid + 1)
                if offload:
                    resume_engines(loop, clients, ["kv_cache"])
                result.weight_version = rid + 1
                t_eval = 0.0
                ev = cfg.rollout.eval_interval
                if cfg.data.eval_data and ev and ((rid + 1) % ev == 0 or rid == n_total - 1):
                    from slimectl.stages.rollout.eval import run_eval

                    t3 = time.perf_counter()
                    run_eval(run, cfg, rid + 1, engines.urls)
                    t_eval = time.perf_counter() - t3
                total = time.perf_counter() - t0
                meta = art.meta
                staleness = rid - int(meta.get("weight_version") or 0)
                rec = {"rl/staleness": staleness, "rl/reward_mean": meta.get("reward_mean"),
                       "perf/rl_step_time": total, "perf/rl_rollout_wait_time": t_rollout + t_drain,
                       "perf/rl_train_time": t_train, "perf/rl_sync_time": t_sync, "perf/rl_eval_time": t_eval,
                       "perf/rl_other_time": max(0.0, total - t_rollout - t_drain - t_train - t_sync - t_eval),
                       "train/loss": steps[-1].get("train/loss") if steps else None}
                rl_metrics.log(rid, {k: v for k, v in rec.items() if v is not None})
                log.info("rl %d/%d: reward %.3f, staleness %d, rollout %.2f s, train %.2f s, sync %.2f s, step %.2f s",
                         rid + 1, n_total, meta.get("reward_mean") or 0.0, staleness, t_rollout + t_drain, t_train,
                         t_sync, total)
        finally:
            stop.set()
            if ahead is not None and not ahead.done():
                for c in clients.values():  # unblock the rollout still in flight
                    try:
                        loop.run_until_complete(c.abort_request(abort_all=True))
                    except Exception:
                        pass
            pool.shutdown(wait=True, cancel_futures=True)
        result.seconds = time.perf_counter() - t_start
        return result


async def _gather(coros) -> list:
    return await asyncio.gather(*coros)


def release_engines(loop, clients: dict) -> None:
    """Colocated training: every engine frees its memory (weights and KV cache) for the trainer."""
    loop.run_until_complete(_gather([c.release_memory_occupation() for c in clients.values()]))


def resume_engines(loop, clients: dict, tags: list[str]) -> None:
    loop.run_until_complete(_gather([c.resume_memory_occupation(tags) for c in clients.values()]))


class StopSignals:
    """SIGTERM/SIGINT handling for ``rl``: the first signal sets ``stop`` and raises KeyboardInterrupt
    in the main thread — at once, or, inside :meth:`deferred` (a weight sync: engines must be
    continued), when that section ends. Later signals are ignored so the cleanup runs whole."""

    def __init__(self, stop: threading.Event):
        self.stop = stop
        self.signal: int | None = None
        self._depth = 0
        self._pending = False

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        if self.signal is not None:
            return
        self.signal = signum
        self.stop.set()
        if self._depth:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                self._pending = False
                raise KeyboardInterrupt
