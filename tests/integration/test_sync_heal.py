"""A standalone ``slimectl sync`` beside a ``serve`` that heals its engines (#48, item 2): a sync that meets an
engine the serve's heartbeat is restarting waits for its record to come back and syncs it; one not back in time is
named in one line (exit 1), the others synced."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import post, publish_weights, slimectl_in_process, start_serve, write_config
from tests.integration.test_engine_heal import FAST, _listener, _wait

pytestmark = pytest.mark.xdist_group("engine_heal")


def _served_version(url: str) -> str:
    return post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
                )["meta_info"]["weight_version"]


def _engine_1(run: RunDir):
    return next(r for r in run.engines.list() if r.id.startswith("engine-1-"))


def _back(run: RunDir, pid: int):
    """engine-1's record once it is on a new live process."""
    rec = _engine_1(run)
    return rec if rec.pid != pid and rec.alive() else None


def _serve(tmp_path, **rollout):
    """A run (tiny qwen2) and its ``serve`` of 2 engines with a fast heartbeat: (run, serve, urls, serve's log)."""
    cfg = write_config(tmp_path, engine={"num_engines": 2, "health_check": FAST}, rollout=rollout)
    path = tmp_path / "run"
    assert slimectl_in_process("init", path, "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(path)
    serve_err = tmp_path / "serve.err"
    serve, urls = start_serve(run, "--num-engines", "2", stderr_file=serve_err)
    return run, serve, urls, serve_err


@pytest.mark.slow
def test_a_standalone_sync_follows_a_serves_heal(tmp_path):
    """``serve`` (2 engines, its heartbeat) and weights/1; engine-1 ``kill -9``ed and ``slimectl sync`` run at once:
    it waits for engine-1's restart (at version 0, its record's) and syncs it — exit 0, both engines on version 1,
    ``sync --verify`` clean. Then weights/2 with serve stopped (SIGSTOP: no heartbeat, no heal) and engine-1 killed
    again: the sync waits ``engine.startup_timeout_s`` for it, syncs engine-0 and exits 1 naming engine-1 and the
    fix; once serve goes on and engine-1 is back (at version 1), the sync it names brings it to version 2."""
    run, serve, urls, serve_err = _serve(tmp_path)
    path = run.path
    try:
        publish_weights(run, 1, seed=1)
        first = _engine_1(run)
        _listener(first.url).kill()
        res = slimectl_in_process("sync", "-r", path)
        assert res.returncode == 0, res.stderr[-3000:] + serve_err.read_text()[-3000:]
        assert "weight version 1 ->" in res.stdout and all(u in res.stdout for u in urls)
        # synced on its new process (once registered again: a sync may reach it just before serve registers it)
        healed = _wait("engine-1 registered again", lambda: _back(run, first.pid))
        assert {r.weight_version for r in run.engines.list()} == {"1"}
        assert [_served_version(u) for u in urls] == ["1", "1"]
        res = slimectl_in_process("sync", "-r", path, "--version", "1", "--verify")
        assert res.returncode == 0 and "verified" in res.stdout, res.stderr[-3000:]

        publish_weights(run, 2, seed=2)
        serve.send_signal(signal.SIGSTOP)
        try:
            _listener(healed.url).kill()
            res = slimectl_in_process("sync", "-r", path, "--set", "engine.startup_timeout_s=1")
        finally:
            serve.send_signal(signal.SIGCONT)
        assert res.returncode == 1, res.stdout
        line = res.stderr.strip().splitlines()[-1]
        assert f"engine {healed.id} at {healed.url} is not back after 1s" in line, line
        assert "weight version 2 is in the other 1 engine(s)" in line and f"slimectl sync -r {path}" in line, line
        assert len(line) < 500 and "Traceback" not in res.stderr
        engine_0 = next(u for u in urls if u != healed.url)
        assert _served_version(engine_0) == "2"
        recs = {r.id: r.weight_version for r in run.engines.list()}
        assert recs[healed.id] == "1" and set(recs.values()) == {"1", "2"}  # engine-1 not recorded as synced

        back = _wait("serve's heal of engine-1", lambda: _back(run, healed.pid), timeout=120)
        assert back.weight_version == "1" and _served_version(back.url) == "1"  # restarted at its recorded version
        res = slimectl_in_process("sync", "-r", path, "--verify")
        assert res.returncode == 0 and "verified" in res.stdout, res.stderr[-3000:]
        assert [_served_version(u) for u in urls] == ["2", "2"]
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["disk", "distributed"])
def test_sync_follow_follows_a_serves_heal(tmp_path, transport):
    """``sync --follow`` (its library call, on a thread) beside ``serve``: weights/1 reaches both engines; engine-1
    ``kill -9``ed and weights/2 published at once: the push that meets the restarting engine waits for it and is
    made again, and the follower ends (weights/{num_rollout} in every engine) with both engines on version 2."""
    from slimectl.stages.sync.stage import follow_sync

    run, serve, urls, serve_err = _serve(tmp_path, num_rollout=2)
    stop, out = threading.Event(), {}

    def follow():
        try:
            out["pushed"] = follow_sync(run, run.stage_config("sync"), transport, stop=stop)
        except BaseException as exc:  # noqa: BLE001 — reported by the assertion below
            out["error"] = exc

    follower = threading.Thread(target=follow, daemon=True)
    try:
        follower.start()
        publish_weights(run, 1, seed=1)
        _wait("weights/1 in both engines", lambda: {r.weight_version for r in run.engines.list()} == {"1"})
        first = _engine_1(run)
        _listener(first.url).kill()
        publish_weights(run, 2, seed=2)
        follower.join(timeout=120)
        assert not follower.is_alive() and "error" not in out, (out, serve_err.read_text()[-3000:])
        assert out["pushed"] == [1, 2]
        _wait("engine-1 registered again", lambda: _back(run, first.pid))
        assert {r.weight_version for r in run.engines.list()} == {"2"}
        assert [_served_version(u) for u in urls] == ["2", "2"]
    finally:
        stop.set()
        follower.join(timeout=30)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


def _pause(url: str, token: str | None) -> None:
    from slimectl.engines.client import EngineClient

    async def go():
        async with EngineClient(url, token=token) as c:
            await c.pause_generation("abort")

    asyncio.run(go())


@pytest.mark.slow
def test_a_sync_in_another_process_holds_off_the_serves_heartbeat(tmp_path):
    """A process syncing the engines of a ``serve`` (here: this one) holds their records
    (``EngineRegistry.hold``): engine-1 paused far longer than the heartbeat's timeout is not taken for hung while
    the hold lasts (the same pid throughout); once the hold is let go, still paused, it is (found hung, restarted)."""
    run, serve, urls, serve_err = _serve(tmp_path)
    try:
        first = _engine_1(run)
        with run.engines.hold(60):
            _pause(first.url, run.config().engine.token())
            time.sleep(3 * FAST["timeout"] + FAST["interval"])
            assert _engine_1(run).pid == first.pid and "is lost" not in serve_err.read_text(), serve_err.read_text()
        back = _wait("engine-1 found hung and restarted", lambda: _back(run, first.pid), timeout=120)
        assert back.url == first.url
        assert f"GET /health_generate did not answer 200 within {FAST['timeout']:g}s (hung)" in serve_err.read_text()
        assert not list((run.path / "engines" / ".holds").glob("*.json"))  # the hold let go
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
