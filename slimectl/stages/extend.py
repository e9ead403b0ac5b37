"""``slimectl extend``: change how many rollouts a run has (``rollout.num_rollout``), from any stage.

The frozen ``config.yaml`` never changes once a run has artifacts; the new length is recorded in
``RUN/extend.json`` (written atomically: temp file, fsync, rename) and every stage that reads the
run's config (``rollout``, ``train``, ``rl``, ``status``) reads it through
:meth:`slimectl.contract.rundir.run.RunDir.stage_config`. See docs/run-directory.md, "Extending a run".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from slimectl.contract.config import EXTEND_FILE, build_config, read_extension
from slimectl.contract.errors import UsageError
from slimectl.contract.rundir.artifacts import utcnow
from slimectl.contract.rundir.atomic import atomic_write_json, hostname
from slimectl.contract.rundir.run import RunDir

log = logging.getLogger("slimectl.extend")

#: How many earlier lengths ``extend.json`` keeps in its ``history``.
HISTORY = 50


@dataclass
class ExtendResult:
    num_rollout: int
    previous: int
    produced: int  # rollout ids below this one are published (or were: the newest id + 1)
    trained: int  # rollouts trained (the train cursor's next id)

    @property
    def changed(self) -> bool:
        return self.num_rollout != self.previous


def extend_run(run: RunDir, num_rollout: int) -> ExtendResult:
    """Set the run's ``rollout.num_rollout`` to ``num_rollout`` (longer or shorter, never below what
    was already produced or trained) and record it in ``RUN/extend.json``."""
    frozen = run.config()
    old = read_extension(run.path) or {}
    previous = old.get("num_rollout", frozen.rollout.num_rollout)
    ids = run.rollouts.ids()
    produced = ids[-1] + 1 if ids else 0
    trained = run.cursor("train").read().next
    floor = max(produced, trained, 1)
    if num_rollout < floor:
        have = [f"{produced} produced (ids 0-{produced - 1})" if produced else "", f"{trained} trained" if trained else ""]
        raise UsageError(f"--num-rollout {num_rollout} is below what run {run.path} already has: "
                         f"{' and '.join(h for h in have if h) or 'nothing'} rollouts; pass --num-rollout {floor} or more")
    data = frozen.to_dict()
    data["rollout"]["num_rollout"] = num_rollout
    build_config(data, origin=f"run config with --num-rollout {num_rollout}")  # e.g. the LR warmup must still fit
    result = ExtendResult(num_rollout, previous, produced, trained)
    if not result.changed:
        return result
    history = list(old.get("history", []))
    if old:
        history.append({k: old.get(k) for k in ("num_rollout", "updated", "host", "pid")})
    with run.stage_log("extend"):
        atomic_write_json(run.path / EXTEND_FILE, {
            "num_rollout": num_rollout,
            "previous": previous,
            "frozen": frozen.rollout.num_rollout,
            "updated": utcnow(),
            "host": hostname(),
            "pid": os.getpid(),
            "history": history[-HISTORY:],
        })
        log.info("run %s: rollout.num_rollout %d -> %d (%d produced, %d trained)", run.path, previous, num_rollout,
                 produced, trained)
    return result
