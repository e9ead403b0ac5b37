"""A frozen group's only engine being healed when a rollout asks for the group (#48): ``group_urls`` waits for its
record to come back on a live engine (``engines/health.py::wait_healing``) instead of failing the rollout; a record
nobody heals (its owner dead) fails at once, with the one line naming the group."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from slimectl.contract.errors import SlimectlError
from slimectl.contract.rundir import EngineRecord
from slimectl.contract.rundir.atomic import process_create_time
from slimectl.engines.groups import group_urls
from tests.helpers import start_engine, stop_engine, wait_healthy

DEAD_CREATE_TIME = 1.0  # no live process started at the epoch's first second: the pid reads as dead


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _record(url: str, pid: int, create_time: float | None, owner: dict) -> EngineRecord:
    return EngineRecord(url=url, backend="embedded", pid=pid, create_time=create_time, weight_version="0",
                        id="judge-engine-0-1", extra={"group": "judge", "heals": True, "owner": owner})


@pytest.fixture
def judge_run(tmp_path):
    """A run with a frozen group ``judge`` and one embedded engine of its tiny model, not registered yet."""
    from slimectl.stages.init import init_run

    run = init_run(tmp_path / "run", tiny_model="qwen2", overrides=["engine.groups=[{name: judge}]",
                                                                   "engine.startup_timeout_s=60"]).run
    proc, url = start_engine(run.config().model.path, tmp_path / "judge.log")
    try:
        wait_healthy(url)
        yield run, proc, url
    finally:
        stop_engine(proc)


def test_group_urls_waits_for_the_group_engine_being_healed(judge_run):
    run, proc, url = judge_run
    cfg, registry = run.config(), run.engine_group("judge")
    me = {"pid": os.getpid(), "create_time": process_create_time()}
    registry.register(_record(url, _dead_pid(), DEAD_CREATE_TIME, me))  # its process gone, this process heals it
    assert registry.live() == []

    def heal() -> None:
        time.sleep(0.5)
        registry.register(_record(url, proc.pid, None, me))  # registered again, on a live engine

    healer = threading.Thread(target=heal, daemon=True)
    healer.start()
    assert group_urls(run, cfg, "judge", "rollout.judge.group") == [url]
    healer.join()

    nobody = {"pid": _dead_pid(), "create_time": DEAD_CREATE_TIME}
    registry.register(_record(url, _dead_pid(), DEAD_CREATE_TIME, nobody))  # dead, and its healer gone too
    with pytest.raises(SlimectlError, match="rollout.judge.group = judge: no live engines of that group"):
        group_urls(run, cfg, "judge", "rollout.judge.group")
