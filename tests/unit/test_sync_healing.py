"""What a standalone sync makes of the engines a ``serve`` is restarting (stages/sync/healing.py), on registry
records alone: one back is synced at the URL its record says, one not back in time and one lost for good (its
record gone) are left behind in one line; an engine given by URL is never waited for."""

from __future__ import annotations

import asyncio
import os
import subprocess

from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.atomic import process_create_time
from slimectl.contract.rundir.registry import EngineRecord
from slimectl.stages.sync import healing
from slimectl.stages.sync.transport import EngineTarget


def test_engines_back_late_and_lost(run_dir: RunDir, tmp_path):
    run = run_dir
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = {"pid": os.getpid(), "create_time": process_create_time()}
    log = str(tmp_path / "engine-1.log")
    reg = run.engines
    reg.register(EngineRecord(url="http://127.0.0.1:7", backend="embedded", id="back", pid=os.getpid(),
                              extra={"owner": owner, "heals": True}))
    reg.register(EngineRecord(url="http://127.0.0.1:8", backend="embedded", id="late", pid=dead.pid,
                              extra={"owner": owner, "heals": True, "log": log}))
    targets = [EngineTarget("http://127.0.0.1:6", "back"), EngineTarget("http://127.0.0.1:8", "late"),
               EngineTarget("http://127.0.0.1:9", "lost"), EngineTarget("http://127.0.0.1:5", None)]
    assert healing.restarting(run, targets) == ["late"] and healing.healed(run, targets) == ["back", "late"]

    # "back": on a live process (this one), but nothing answers its /health_generate: a heal not finished either
    kept, left = asyncio.run(healing.wait_back(run, targets, ["late"], timeout=0.2))
    assert [(t.url, t.id) for t in kept] == [("http://127.0.0.1:7", "back"), ("http://127.0.0.1:5", None)]
    assert left == [f"engine late at http://127.0.0.1:8 is not back after 0.2s (its serve is restarting it; see {log})",
                    "engine lost at http://127.0.0.1:9 was lost for good by its serve (its record is gone; see its log)"]
    line = healing.left_behind_line(run, left, 3, ["http://127.0.0.1:7"])
    assert "\n" not in line and line.startswith("engine late at http://127.0.0.1:8 is not back after 0.2s")
    assert f"weight version 3 is in the other 1 engine(s); run `slimectl sync -r {run.path}` again" in line
    assert "no engine was synced" in healing.left_behind_line(run, left, 3, [])
