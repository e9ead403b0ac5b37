"""A standalone ``sync`` beside a ``serve`` that heals its engines (issue #48: nothing lost, nothing twice).

A ``serve`` whose heartbeat is on (its records say so: :func:`~slimectl.contract.rundir.registry.healed_by_owner`)
restarts an engine it lost under the same id and URL, at the weight version its record says, and registers it
again with its new process. A sync that meets such an engine (its record on a dead process, or a push that failed
on it) waits for the record to come back on a live process that answers
(:func:`~slimectl.engines.health.wait_registered`, as an ``rl`` attached to a serve does) and syncs it then; an
engine not back within ``engine.startup_timeout_s``, or lost for good (its record gone), is left behind — the
others are synced — and named in one line (:func:`left_behind_line`).
"""

from __future__ import annotations

import asyncio
import logging

from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.registry import healed_by_owner
from slimectl.stages.sync.transport import EngineTarget

log = logging.getLogger("slimectl.sync")


def healed(run: RunDir, targets: list[EngineTarget]) -> list[str]:
    """The ids of ``targets`` whose ``serve`` restarts them when they are lost."""
    ids = {t.id for t in targets} - {None}
    return [r.id for r in run.engines.list() if r.id in ids and healed_by_owner(r)]


def restarting(run: RunDir, targets: list[EngineTarget]) -> list[str]:
    """The ids of ``targets`` whose record is on a dead process that their ``serve`` is restarting."""
    ids = {t.id for t in targets} - {None}
    return [r.id for r in run.engines.healing() if r.id in ids]


def processes(run: RunDir, targets: list[EngineTarget]) -> dict[str, int | None]:
    """Each of ``targets``' record id -> its process id now (an engine started again: a new one)."""
    ids = {t.id for t in targets} - {None}
    return {r.id: r.pid for r in run.engines.list() if r.id in ids}


async def wait_back(run: RunDir, targets: list[EngineTarget], ids: list[str],
                    timeout: float) -> tuple[list[EngineTarget], list[str]]:
    """Wait (up to ``timeout`` s) for the records of ``ids`` to be on a live process that answers; the targets to
    sync now (each at the URL its record says) and one phrase per engine left behind (not back in time, or its
    record gone: lost for good)."""
    from slimectl.engines.health import wait_registered

    log.warning("waiting up to %gs for engine(s) %s to be back on a live process that answers (their serve "
                "restarts a lost one)", timeout, ", ".join(ids))
    late = set(await asyncio.to_thread(wait_registered, run.engines, ids, timeout))
    recs = {r.id: r for r in run.engines.list()}
    kept, left = [], []
    for t in targets:
        rec = recs.get(t.id)
        if t.id is None:
            kept.append(t)
        elif rec is None:
            left.append(f"engine {t.id} at {t.url} was lost for good by its serve (its record is gone; see its log)")
        elif t.id in late:
            where = rec.extra.get("log") if isinstance(rec.extra, dict) else None
            left.append(f"engine {t.id} at {t.url} is not back after {timeout:g}s (its serve is restarting it"
                        f"{f'; see {where}' if where else ''})")
        else:
            kept.append(EngineTarget(rec.url.rstrip("/"), t.id))
    return kept, left


def left_behind_line(run: RunDir, left: list[str], version: int, synced: list[str]) -> str:
    """One line: the engines left behind, where the version went, and the fix."""
    done = f"weight version {version} is in the other {len(synced)} engine(s)" if synced else "no engine was synced"
    return (f"{'; '.join(left)}; {done}; run `slimectl sync -r {run.path}` again once it is back (or raise "
            f"engine.startup_timeout_s, or restart `slimectl serve`)")
