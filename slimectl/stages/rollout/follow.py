"""``slimectl rollout --follow``: generate all the time, publishing each rollout as soon as its batch is scored.

Prompt groups generate concurrently and across rollout boundaries (:class:`GroupStream`): when
``rollout.batch_size`` groups are scored (and pass the dynamic filter) they are published as the next
``rollouts/N``, while the groups still in flight go on generating for the one after. Weight updates land
while requests are in flight (``sync --follow`` with ``sync.pause_mode`` retract or in_place), so a sample
may hold tokens of several weight versions; each records them.

Staleness bound: with the newest published weights at version V (trained on rollouts 0..V-1), no group
is started for rollout R while R - V > ``rollout.max_staleness`` (AReaL's bound on groups started:
``(V + max_staleness + 1) * batch_size``); a group started earlier can still land in a later rollout,
which is what ``rollout.stale_samples`` decides about at train time.

Exactly once: a published rollout also holds the prompt source's position after every group started so
far (``data_state.json``) and those groups as they were when they started, plus the finished groups not
yet published (``buffer.parquet``). A follower killed at any point (``kill -9``) and started again continues
from the last published rollout: every prompt group lands in exactly one rollout.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import SlimectlError
from slimectl.contract.faults import fault_point
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import Sample
from slimectl.engines.pool import EnginePool
from slimectl.stages.rollout.generate import GroupResult
from slimectl.stages.rollout.producer import RolloutProducer
from slimectl.stages.rollout.prompts import next_rollout_id, require_prompt_data

log = logging.getLogger("slimectl.rollout")

POLL_S = 0.2
"""Seconds between two looks at the newest published weights (and the engines' versions) while generation
waits for them."""
CALLER_POLL_S = 0.005
"""The same when the caller says the version (``slimectl rl``: a variable of its own, cheap to read)."""
MAX_DROPPED_ROUNDS = 16
"""Rounds of groups (``over_sampling_batch_size``) the dynamic filter may drop in a row before the follower gives up."""


@dataclass
class FollowResult:
    published: list[int] = field(default_factory=list)
    complete: bool = False
    """All ``rollout.num_rollout`` rollouts are published."""


def published_version(run: RunDir) -> int:
    """The newest published weight version (0: the initial model)."""
    ids = run.weights.ids()
    return ids[-1] if ids else 0


class GroupStream:
    """Prompt groups generating concurrently, across rollouts: started as room allows, scored and filtered
    as they finish, handed out in batches. ``carried`` is what a rerun continues from if this process
    stops now (the groups in flight as they started, finished ones not handed out, aborted ones)."""

    def __init__(self, producer: RolloutProducer, requeued: list[list[Sample]]):
        self.producer, self.keep = producer, producer.keep
        self.in_flight: dict[asyncio.Future, list[Sample]] = {}
        self.ready: list[GroupResult] = []
        self.requeued = requeued
        """Groups to start before new prompts (the supply pops them): buffered by an earlier rollout, or aborted here."""
        self.counts = {"dropped": 0, "aborted": 0}

    def start(self, groups: list[list[Sample]]) -> None:
        for g in groups:
            as_started = copy.deepcopy(g)
            task = asyncio.ensure_future(self.producer.generate_group(g))
            self.in_flight[task] = as_started

    async def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a group in flight to finish; take every finished one (the first failure raises)."""
        if not self.in_flight:
            await asyncio.sleep(timeout)
            return
        done, _ = await asyncio.wait(list(self.in_flight), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        failure = None
        for task in done:
            self.in_flight.pop(task)
            if task.cancelled():
                continue
            if task.exception() is not None:
                failure = failure or task.exception()
                continue
            self._take(task.result())
        if failure is not None:
            raise failure

    def _take(self, res: GroupResult) -> None:
        if res.partial:  # a sample was aborted (an update that aborts, an engine restarting): it goes on later
            self.counts["aborted"] += 1
            self.requeued.append(res.samples)
        elif self.keep is not None and not self.keep(res.samples):
            res.kept = False
            self.counts["dropped"] += 1
        else:
            self.ready.append(res)

    def take(self, n: int) -> list[GroupResult]:
        """The first ``n`` groups that finished, in group order."""
        batch, self.ready = self.ready[:n], self.ready[n:]
        return sorted(batch, key=lambda r: r.group_index)

    def carried(self) -> list[list[Sample]]:
        groups = list(self.in_flight.values()) + [r.samples for r in self.ready] + list(self.requeued)
        return sorted(groups, key=lambda g: g[0].group_index)

    async def close(self, pool: EnginePool) -> None:
        """Abort what is in flight (its groups are in the last published rollout's buffer)."""
        if not self.in_flight:
            return
        try:
            await pool.abort_all()
        except Exception:  # noqa: BLE001 — stopping anyway; the tasks are cancelled below
            pass
        for task in self.in_flight:
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        self.in_flight.clear()


def follow_rollouts(run: RunDir, cfg: SlimectlConfig, engine_urls: list[str] | tuple[str, ...] = (),
                    stop: threading.Event | None = None, newest_version: Callable[[], int] | None = None,
                    skip_bad_rows: bool | None = None, on_published: Callable[[int], None] | None = None,
                    bridge=None) -> FollowResult:
    """Publish rollouts from the next id until ``rollout.num_rollout`` are published (or ``stop`` is set).

    ``newest_version()``: the weight version the staleness bound counts from (default: the newest
    published ``weights/N``; ``slimectl rl`` passes the version its engines were last synced to).
    ``on_published(rid)`` is called after each rollout is published. ``bridge``: the
    :class:`~slimectl.contract.loop_bridge.LoopBridge` to run on (``slimectl rl``'s one loop); None: ``asyncio.run``."""
    with run.stage_log("rollout"):
        from slimectl.backends.hf.vlm import refuse_vlm_options

        refuse_vlm_options(cfg.model.path, "rollout --follow", fully_async=True)  # (untested with images)
        require_prompt_data(cfg)
        with run.lock("rollout") as lock:
            first = next_rollout_id(run)
            if first >= cfg.rollout.num_rollout:
                log.info("all %d rollouts (rollout.num_rollout) are published; nothing to follow (to go on: "
                         "slimectl extend -r %s --num-rollout N)", cfg.rollout.num_rollout, run.path)
                return FollowResult(complete=True)
            producer = RolloutProducer.for_rollouts(run, cfg, first, engine_urls, skip_bad_rows, lock, carry=True)
            follower = _Follower(producer, stop or threading.Event(), newest_version, on_published)
            return bridge.run(follower.follow()) if bridge is not None else asyncio.run(follower.follow())


class _Follower:
    """One follower's loop: start groups as the staleness bound allows, publish each full batch."""

    def __init__(self, producer: RolloutProducer, stop: threading.Event, newest_version: Callable[[], int] | None,
                 on_published: Callable[[int], None] | None):
        self.producer, self.run, self.cfg, self.rid = producer, producer.run, producer.cfg, producer.rollout_id
        self.stop = stop
        self.given_version = newest_version
        """What the caller says the engines serve (None: the newest published weights, and what the engines report)."""
        self.version = 0
        """The version the bound counted from at the last look."""
        self.on_published = on_published
        self.tracer = self.run.tracer("rollout")
        self.result = FollowResult()

    async def follow(self) -> FollowResult:
        cfg, producer = self.cfg, self.producer
        async with producer:
            await producer.engine_versions()
            served = _ServedVersion(producer.pool)
            behind = published_version(self.run) - await self._serving(served)
            if self.given_version is None and behind > cfg.effective_max_staleness:  # a follower waits, not refuses
                log.info("the engines serve weights %d versions older than the newest weights/N; generation waits "
                         "until they are synced (slimectl sync -r %s --follow)", behind, self.run.path)
            stream = GroupStream(producer, producer.supply.buffered)
            try:
                await self._loop(stream, served)
            finally:
                await stream.close(producer.pool)
        return self.result

    async def _loop(self, stream: GroupStream, served: "_ServedVersion") -> None:
        r, supply = self.cfg.rollout, self.producer.supply
        n, batch, ahead = r.num_rollout, r.batch_size, self.cfg.effective_max_staleness
        round_size = r.over_sampling_batch_size or batch
        since, waiting = time.time(), None
        poll = CALLER_POLL_S if self.given_version else POLL_S
        while self.rid < n and not self.stop.is_set():
            self.producer.lock.check()
            version = self.version = await self._serving(served)
            allowed = (version + ahead + 1 - self.rid) * batch - len(stream.ready)
            room = min(round_size, allowed) - len(stream.in_flight)
            if room > 0:
                stream.start(supply(room))
            if waiting is not None and stream.in_flight:  # the wait for newer weights is over
                self.tracer.record("wait:weights", waiting, time.time(), rollout=self.rid, version=version)
                waiting = None
            if len(stream.ready) >= batch:
                await self._publish(stream, since)
                since = time.time()
                continue
            if not stream.in_flight and waiting is None:
                log.debug("rollout %d waits for newer weights: the engines serve version %d and rollout.max_staleness "
                          "= %d", self.rid, version, ahead)
                waiting = time.time()
            if stream.counts["dropped"] > MAX_DROPPED_ROUNDS * round_size:  # (counted since the last publish)
                raise SlimectlError(f"rollout {self.rid}: the dynamic filter dropped {MAX_DROPPED_ROUNDS} rounds of "
                                    f"groups in a row; relax rollout.dynamic_filter")
            await stream.settle(poll)
        if waiting is not None:
            self.tracer.record("wait:weights", waiting, time.time(), rollout=self.rid)
        self.result.complete = self.rid >= n

    async def _serving(self, served: "_ServedVersion") -> int:
        """The version the staleness bound counts from: the caller's, or the newest published weights as far as
        every engine serves them (published ones not synced yet do not count)."""
        if self.given_version is not None:
            return self.given_version()
        published = published_version(self.run)
        return min(published, await served.get(default=published))

    async def _publish(self, stream: GroupStream, since: float) -> None:
        r, rid = self.cfg.rollout, self.rid
        kept = stream.take(r.batch_size)
        samples = [s for g in kept for s in g.samples]
        for s in samples:
            s.rollout_id = rid
        versions = [s.oldest_version for s in samples if isinstance(s.oldest_version, int)]
        counts = {"dropped": stream.counts["dropped"], "aborted": stream.counts["aborted"]}
        stream.counts = {"dropped": 0, "aborted": 0}
        carried = stream.carried()
        metrics = await self.producer.finish(kept, counts, since, str(min(versions)) if versions else None, {
            "rollout/partial_groups_buffered": len(carried), "rollout/groups_in_flight": len(stream.in_flight),
            "rollout/weights_served": self.version})
        self.producer.publish(rid, kept, metrics, carried, since)
        self.result.published.append(rid)
        self.rid += 1
        if self.on_published is not None:
            self.on_published(rid)
        fault_point("rollout.follow_published")


class _ServedVersion:
    """The oldest weight version the engines serve, asked again at most every :data:`POLL_S`."""

    def __init__(self, pool: EnginePool):
        self.pool, self.value, self.asked = pool, None, float("-inf")

    async def get(self, default: int) -> int:
        if time.monotonic() - self.asked >= POLL_S:
            self.asked = time.monotonic()
            versions = []
            for v in (await self.pool.weight_versions()).values():
                try:
                    versions.append(int(v))
                except (TypeError, ValueError):  # not one of this run's versions: it does not hold generation back
                    pass
            self.value = min(versions) if versions else None
        return default if self.value is None else self.value
