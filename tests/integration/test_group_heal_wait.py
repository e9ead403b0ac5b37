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



def test_the_judges_pool_waits_for_its_only_engine_being_healed(tmp_path):
    """The judge reward's pool (``make_judge``) over a frozen group of one engine: the engine dies and a verdict is
    asked while it is down; its record (``heals``, its healer alive) comes back on a new engine at another URL, and
    the request is answered there instead of failing the sample's verdict."""
    import asyncio
    from types import SimpleNamespace

    from slimectl.stages.init import init_run
    from slimectl.stages.rollout.judge import make_judge

    run = init_run(tmp_path / "run", tiny_model="qwen2", overrides=[
        "engine.groups=[{name: judge}]", "engine.startup_timeout_s=60", "rollout.reward=judge",
        "rollout.judge.group=judge", "rollout.judge.timeout_s=120"]).run
    cfg, registry = run.config(), run.engine_group("judge")
    me = {"pid": os.getpid(), "create_time": process_create_time()}
    first, url = start_engine(cfg.model.path, tmp_path / "judge-0.log", own_process=True)
    procs = [first]
    try:
        wait_healthy(url)
        registry.register(_record(url, first.pid, None, me))
        judge, close = make_judge(run, cfg)
        first.kill()
        first.wait()

        def heal() -> None:  # the heartbeat's part: a new engine started and registered under the same id
            proc, new_url = start_engine(cfg.model.path, tmp_path / "judge-1.log", own_process=True)
            procs.append(proc)
            wait_healthy(new_url)
            registry.register(_record(new_url, proc.pid, None, me))

        async def go():
            healer = threading.Thread(target=heal, daemon=True)
            healer.start()
            try:
                sample = SimpleNamespace(prompt="1+1=", response="2", label="2", metadata={})
                await judge.score(sample)
                return sample.metadata["judge"]
            finally:
                healer.join()
                await close()

        verdict = asyncio.run(go())
        assert isinstance(verdict["verdict"], str), verdict  # answered (the tiny model's text need not parse)
        assert verdict["engine_url"].rstrip("/") not in (url, None)  # by the engine healed at the new URL
    finally:
        for p in procs:
            stop_engine(p)
