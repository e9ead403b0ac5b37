"""Engines that heal (#48): the heartbeat (``engine.health_check``) kills a dead or hung engine, starts it again
on its port at its weight version, checks it and registers it again; an engine that cannot come back is reported
in one line, and the run goes on with the others or stops (``engine.on_lost``). ``rl`` loses no request and
runs none twice when an engine is ``kill -9``ed in the middle of a rollout."""

from __future__ import annotations

import re
import shutil
import signal
import threading
import time

import psutil
import pytest

from slimectl.contract.errors import SlimectlError
from slimectl.contract.rundir import RunDir
from tests.helpers import post, read_jsonl, slimectl_in_process, write_config

pytestmark = pytest.mark.xdist_group("engine_heal")

FAST = {"first_wait": 0, "interval": 0.3, "timeout": 2}


def _listener(url: str) -> psutil.Process:
    """The process that listens on the engine URL's port (the engine itself, not a fork client in front of it)."""
    port = int(url.rsplit(":", 1)[1])
    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    assert len(pids) == 1, (url, pids)
    return psutil.Process(pids.pop())


def _wait(what, cond, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def kill_engine_1_at_rollout_1(path, killed: dict) -> None:
    """``kill -9`` engine-1 of the run at ``path`` once it is synced to weight version 1 (rollout 1 begins); what
    was killed goes in ``killed`` (the engine's pid, its URL, its record's ``extra``)."""
    def synced_to_1():
        try:
            recs = RunDir.open(path).engines.list()
        except Exception:  # noqa: BLE001 — the run is not there yet
            return None
        return next((r for r in recs if r.id.startswith("engine-1-") and r.weight_version == "1"), None)

    rec = _wait("the sync of weight version 1", synced_to_1, timeout=300)
    p = _listener(rec.url)
    killed.update(pid=p.pid, url=rec.url, extra=rec.extra)
    p.kill()


@pytest.fixture
def group(tmp_path):
    """Two embedded engines of a run on a copy of the tiny model (a test may delete it), watched with a fast
    heartbeat."""
    from slimectl.stages.init import init_run
    from slimectl.stages.serve import EngineProcesses
    from slimectl.starter_models.tiny_models import build_tiny_model

    model = build_tiny_model("qwen2", tmp_path / "model")
    hc = [f"engine.health_check.{k}={v}" for k, v in FAST.items()]
    run = init_run(tmp_path / "run", overrides=[f"model.path={model}", "engine.num_engines=2", *hc]).run
    g = EngineProcesses(run, run.config()).start()
    try:
        yield run, g, model
    finally:
        g.stop()


def test_a_hung_engine_is_replaced_and_one_that_cannot_come_back_is_reported(group):
    run, g, model = group
    url0, url1 = g.urls
    first_pid = next(e.pid for e in g.engines if e.url == url0)
    old = _listener(url0)
    old.send_signal(signal.SIGSTOP)  # alive, never answering
    loss = _wait("the hung engine's loss", lambda: g.watcher.losses and g.watcher.losses[0])
    assert loss.url == url0 and "did not answer 200 within 2s (hung)" in loss.why
    rec = _wait("engine-0 registered again", lambda: next(
        (r for r in run.engines.list() if r.url == url0 and r.pid != first_pid), None))
    assert not old.is_running() or old.status() == psutil.STATUS_ZOMBIE  # killed while stopped (its group)
    assert rec.weight_version == "0" and _listener(url0).pid != old.pid
    out = post(url0, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "0"
    assert g.lost == {}
    g.check_alive()  # healed: nothing to report

    shutil.rmtree(model)  # engine-1 cannot come back
    _listener(url1).kill()
    line = _wait("engine-1 reported lost", lambda: g.lost.get(url1))
    assert "\n" not in line and line.startswith(f"engine-1 at {url1} is lost (its process exited") and \
        "could not be started again" in line
    assert [r.url for r in run.engines.list()] == [url0]  # its record gone; engine-0 serves on
    g.check_alive()  # engine.on_lost: continue (the default)
    g.cfg.engine.on_lost = "stop"
    with pytest.raises(SlimectlError, match="engine.on_lost is stop"):
        g.check_alive()


@pytest.mark.slow
def test_rl_loses_no_sample_when_an_engine_is_killed_mid_rollout(tmp_path):
    """``rl`` (synchronous loop, 2 engines of its own): engine-1 is ``kill -9``ed as rollout 1 begins; its
    requests finish on engine-0, it comes back at weight version 1 and takes the syncs of 2 and 3."""
    rl_with_engine_1_killed(tmp_path, "off")


def wait_engine_at_version(path, engine: str, version: str | None, timeout: float = 300):
    """The record of ``engine`` (``engine-1``: ``engine-1-``...) in the run at ``path``, once it says ``version``
    (None: once there is one)."""
    def synced():
        try:
            recs = RunDir.open(path).engines.list()
        except Exception:  # noqa: BLE001 — the run is not there yet
            return None
        return next((r for r in recs if r.id.startswith(f"{engine}-") and version in (None, r.weight_version)), None)

    return _wait(f"{engine} at weight version {version}", synced, timeout=timeout)


HOLD_S = 1.0
"""How long an engine is held stopped before it is killed: the rollout's requests on it hang meanwhile (below the
heartbeat's 2 s timeout, so the heartbeat does not take it for hung first)."""


def signal_engine_mid_rollout(path, engine: str, version: str, sig: int = signal.SIGKILL) -> int:
    """Once ``engine``'s record says ``version`` (the rollout on it beginning), ``SIGSTOP`` it: the requests the
    rollout sends it hang, so the rollout cannot end before the fault; for ``sig`` SIGKILL, ``kill -9`` it
    :data:`HOLD_S` later with those requests in flight (SIGSTOP: it stays hung, for the heartbeat). Its pid."""
    p = _listener(wait_engine_at_version(path, engine, None).url)  # looked up first: the fault lands at once
    wait_engine_at_version(path, engine, version)
    p.suspend()
    if sig == signal.SIGKILL:
        time.sleep(HOLD_S)
        p.kill()
    return p.pid


def kill_engine_at_version(path, engine: str, version: str, killed: list[int]) -> None:
    """Once ``engine``'s record says ``version``, ``kill -9`` it with requests in flight (its pid appended to
    ``killed``)."""
    killed.append(signal_engine_mid_rollout(path, engine, version))


def assert_rollouts_exact(run: RunDir, n_rollout: int, batch: int, n: int) -> None:
    """Every group in exactly one rollout, with exactly its samples; no prompt group twice across rollouts."""
    from slimectl.contract.samples import SAMPLES_FILE, read_samples

    seen = set()
    for rid in range(n_rollout):
        samples = read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))
        keys = [(s.group_index, s.index) for s in samples]
        assert len(samples) == batch * n and len(set(keys)) == len(keys), (rid, keys)
        groups = [s.group_index for s in samples]
        assert len(set(groups)) == batch and all(groups.count(gi) == n for gi in groups), (rid, groups)
        assert not seen & set(groups), (rid, sorted(seen & set(groups)))  # a group lands in one rollout only
        seen |= set(groups)


def rl_with_engine_1_killed(tmp_path, mode: str, n_rollout: int = 3, batch: int = 4, n: int = 4, back_at: str = "1",
                            **sections) -> tuple[RunDir, str]:
    """``rl`` under ``rollout.async_mode`` ``mode`` with 2 engines of its own (and config ``sections``); engine-1
    ``kill -9``ed once it is synced to weight version 1 (rollout 1 generating, or under one_step_off rollout 2):
    exit 0, every rollout exact, the lost requests retried on engine-0, engine-1 back at version ``back_at``
    (checked) and the last sync on both. The run and rl's stderr."""
    cfg = write_config(tmp_path, rollout={"num_rollout": n_rollout, "batch_size": batch, "n_samples_per_prompt": n,
                                          "max_response_len": 24, "async_mode": mode},
                       engine={"num_engines": 2, "health_check": FAST}, **sections)
    path = tmp_path / "run"
    killed: list[int] = []
    killer = threading.Thread(target=kill_engine_at_version, args=(path, "engine-1", "1", killed), daemon=True)
    killer.start()
    res = slimectl_in_process("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2")
    killer.join(timeout=5)
    assert res.returncode == 0, res.stderr[-3000:]
    assert killed, "engine-1 was not killed"
    err = res.stderr
    assert re.search(r"engine-1 at \S+ is lost: (its process exited|GET /health_generate did not answer)", err), \
        err[-3000:]  # (killed during a heartbeat, and its exit not seen yet: it did not answer)
    assert "retrying its requests on the 1 other engine(s)" in err, err[-3000:]  # killed with requests in flight
    assert f"is back at weight version {back_at} (checked)" in err, err[-3000:]
    run = RunDir.open(path)
    assert_rollouts_exact(run, n_rollout, batch, n)
    syncs = [(int(r["sync/weight_version"]), int(r["sync/num_engines"])) for r in read_jsonl(run.metrics_path("sync"))]
    assert syncs[-1] == (n_rollout, 2)  # the last sync reached both engines, engine-1 among them
    assert run.engines.list() == []
    return run, err
