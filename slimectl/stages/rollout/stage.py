"""``slimectl rollout``: generate and score one rollout with a
:class:`~slimectl.stages.rollout.producer.RolloutProducer` and publish it as ``rollouts/N``; engines
serving weights too old for ``rollout.max_staleness`` are refused.

The artifact holds ``samples.parquet`` (see :mod:`slimectl.contract.samples`), ``data_state.json`` (the
prompt source's position after this rollout — rollout N+1 starts from it), ``metrics.json``
and ``trace.jsonl`` (per-sample generate/reward spans). Nothing is published unless the whole
rollout succeeded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import ArtifactExists, SlimectlError, UsageError
from slimectl.contract.rundir import RunDir
from slimectl.stages.rollout.generate import GroupResult
from slimectl.stages.rollout.producer import RolloutProducer
from slimectl.stages.rollout.prompts import (carries_groups, load_prompt_rows, next_rollout_id, refuse_vlm_rollout,
                                             require_prompt_data)

log = logging.getLogger("slimectl.rollout")


class StaleEngine(SlimectlError):
    """An engine serves weights older than the newest published ones by more than ``rollout.max_staleness``."""


@dataclass
class RolloutResult:
    rollout_id: int
    num_samples: int
    metrics: dict[str, Any]
    path: Path | None
    """The published artifact; None when nothing was made (``complete``)."""
    complete: bool = False
    """``--next`` found the run complete (``rollout.num_rollout`` rollouts published): nothing was made."""


def check_prompt_data(cfg: SlimectlConfig) -> None:
    """Check ``data.prompt_data`` and every ``data.eval_data`` file (rows, input and label keys) without
    tokenizing: what ``slimectl rl`` runs before it starts any engine. Raises :class:`DatasetError` (exit 2)."""
    require_prompt_data(cfg)
    load_prompt_rows(cfg, cfg.data.prompt_data)
    for name, spec in cfg.data.eval_data.items():
        load_prompt_rows(cfg, spec, key=f"data.eval_data.{name}")


def max_staleness(cfg: SlimectlConfig) -> int:
    """``rollout.max_staleness``, or what ``rollout.async_mode`` implies: 0 (off), 1 (one_step_off, fully_async)."""
    return cfg.effective_max_staleness


def check_staleness(run: RunDir, cfg: SlimectlConfig, versions: dict[str, str]) -> None:
    """Refuse engines more than :func:`max_staleness` versions behind the newest published ``weights/N``.

    ``versions`` maps engine URL to the weight version it reports. Nothing is compared while the run
    has published no weights (every engine serves the initial model then)."""
    ids = run.weights.ids()
    if not ids:
        return
    newest, limit = ids[-1], max_staleness(cfg)
    names = {r.url.rstrip("/"): r.id for r in run.engines.list()}
    why = "" if cfg.rollout.max_staleness is not None else f", implied by rollout.async_mode = {cfg.rollout.async_mode}"
    for url, version in versions.items():
        name = f"engine {names[url]} ({url})" if url in names else f"engine {url}"
        try:
            behind = newest - int(version)
        except (TypeError, ValueError):
            raise StaleEngine(f"{name} serves weight version {version!r}, not one of this run's versions (newest: "
                              f"weights/{newest:06d}); sync it first: slimectl sync -r {run.path}") from None
        if behind > limit:
            raise StaleEngine(f"{name} serves weight version {version}, {behind} behind the newest published "
                              f"weights/{newest:06d} (rollout.max_staleness = {limit}{why}); sync it first: "
                              f"slimectl sync -r {run.path}")


def run_rollout(run: RunDir, cfg: SlimectlConfig, rollout_id: int | None = None, engine_urls: list[str] | tuple[str, ...] = (),
                force: bool = False, skip_bad_rows: bool | None = None, connections=None) -> RolloutResult:
    """Produce rollout ``rollout_id`` (default: the next one) and publish it.

    ``connections``: a :class:`~slimectl.engines.client.KeptConnections` (``slimectl rl``: the
    rollout runs on its loop and reuses its connections to the engines); None: a fresh loop and
    fresh connections, closed at the end."""
    with run.stage_log("rollout"):
        refuse_vlm_rollout(cfg, "rollout")
        require_prompt_data(cfg)
        with run.lock("rollout") as lock:
            rid = next_rollout_id(run) if rollout_id is None else rollout_id
            n = cfg.rollout.num_rollout
            extend = f"extend the run: slimectl extend -r {run.path} --num-rollout N"
            if rid >= n and rollout_id is None:
                log.warning("the run is complete: all %d rollouts (rollout.num_rollout) are published, so there is no "
                            "rollout %d to make; to go on, %s", n, rid, extend)
                return RolloutResult(rid, 0, {}, None, complete=True)
            if rid >= n:
                raise UsageError(f"rollout {rid} is past the run's end: rollout.num_rollout = {n} (ids 0-{n - 1}); "
                                 f"to go on, {extend}")
            if run.rollouts.exists(rid) and not force:
                raise ArtifactExists(f"rollouts/{rid:06d} is already published; pass --force to regenerate it")
            producer = RolloutProducer.for_rollouts(run, cfg, rid, engine_urls, skip_bad_rows, lock, carries_groups(cfg),
                                                    connections)
            work, started = _rollout_async(run, cfg, producer), time.time()
            kept, metrics, leftover = connections.run(work) if connections is not None else asyncio.run(work)
            producer.publish(rid, kept, metrics, leftover, started, overwrite=force)
            return RolloutResult(rid, sum(len(g.samples) for g in kept), metrics, run.rollouts.dir_for(rid))


async def _rollout_async(run: RunDir, cfg: SlimectlConfig, producer: RolloutProducer
                         ) -> tuple[list[GroupResult], dict[str, Any], list[list]]:
    """Generate one batch on the engines (all serving one weight version, fresh enough) and its metrics: the kept
    groups, the metrics and the groups a later rollout continues."""
    from slimectl.contract.logs import progress

    r, rid = cfg.rollout, producer.rollout_id
    async with producer:
        weight_version = await _served_version(run, cfg, producer)
        bar = progress(total=r.batch_size, mode=cfg.logging.progress, desc=f"rollout {rid}", unit="group")

        def on_group_done(res: GroupResult) -> None:
            producer.lock.check()
            if res.kept:
                bar.update(1)

        t0 = time.time()
        try:
            kept, counts, leftover = await producer.batch(on_group_done)
        finally:
            bar.close()
        continued = sum(bool(s.metadata.get("partial_continued")) for g in kept for s in g.samples)
        metrics = await producer.finish(kept, counts, t0, weight_version, {
            "rollout/partial_groups_buffered": len(leftover), "rollout/partial_samples_continued": continued})
        return kept, metrics, leftover


async def _served_version(run: RunDir, cfg: SlimectlConfig, producer: RolloutProducer) -> str:
    """The one weight version every engine serves (refused: none answering, too stale, or several versions)."""
    versions = await producer.engine_versions()
    check_staleness(run, cfg, versions)
    if len(set(versions.values())) > 1:
        raise SlimectlError(f"engines serve different weight versions {versions}; run `slimectl sync` first")
    return next(iter(versions.values()))
