"""Single-writer stage locks: exclusion, kill -9 recovery, cross-host heartbeats, takeover detection."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slimectl.contract.errors import LockHeld, LockLost
from slimectl.contract.rundir.locks import StageLock

HOLDER = r"""
import sys, time
from slimectl.contract.rundir.locks import StageLock
lock = StageLock(sys.argv[1], "train", stale_after=5, heartbeat_interval=0.2).acquire()
print("LOCKED", flush=True)
time.sleep(600)
"""


def start_holder(locks_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(locks_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "LOCKED"
    return p


def test_second_acquirer_is_refused_with_holder_details(tmp_path):
    p = start_holder(tmp_path)
    try:
        with pytest.raises(LockHeld) as ei:
            StageLock(tmp_path, "train").acquire()
        msg = str(ei.value)
        assert f"pid {p.pid}" in msg and "already running" in msg
        other = StageLock(tmp_path, "rollout").acquire()  # other stages are independent
        other.release()
    finally:
        p.kill()
        p.wait()


def test_kill_9_holder_is_recovered_at_once(tmp_path):
    p = start_holder(tmp_path)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    lock = StageLock(tmp_path, "train")
    assert lock.holder()["stale"] is True
    t0 = time.monotonic()
    lock.acquire()
    assert time.monotonic() - t0 < 2  # same host: a dead pid is enough, no heartbeat wait
    assert lock.holder()["pid"] == os.getpid()
    lock.release()
    assert lock.holder() is None


def test_wait_for_lock_until_released(tmp_path):
    p = start_holder(tmp_path)
    try:
        with pytest.raises(LockHeld):
            StageLock(tmp_path, "train").acquire(wait=True, timeout=0.3, poll=0.05)
    finally:
        p.terminate()
        p.wait()
    StageLock(tmp_path, "train").acquire(wait=True, timeout=10, poll=0.05).release()


def fake_remote_lock(tmp_path, age_s):
    path = tmp_path / "train.lock"
    path.write_text(json.dumps({"stage": "train", "host": "some-other-host", "pid": 1, "token": "remote",
                                "acquired": "earlier"}))
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_remote_holder_with_fresh_heartbeat_is_respected(tmp_path):
    fake_remote_lock(tmp_path, age_s=1)
    with pytest.raises(LockHeld, match="some-other-host"):
        StageLock(tmp_path, "train", stale_after=30).acquire()


def test_remote_holder_with_old_heartbeat_is_taken_over(tmp_path):
    fake_remote_lock(tmp_path, age_s=120)
    lock = StageLock(tmp_path, "train", stale_after=30).acquire()
    assert json.loads((tmp_path / "train.lock").read_text())["token"] == lock.token
    lock.release()
    assert not list(tmp_path.glob(".stale-*"))


def test_heartbeat_keeps_a_live_lock_fresh(tmp_path):
    lock = StageLock(tmp_path, "train", stale_after=1.0, heartbeat_interval=0.1).acquire()
    try:
        time.sleep(1.5)
        assert lock.holder()["heartbeat_age_s"] < 1.0
    finally:
        lock.release()


def test_takeover_is_noticed_by_the_old_holder(tmp_path):
    lock = StageLock(tmp_path, "train", stale_after=1.0, heartbeat_interval=0.05).acquire()
    try:
        # Simulate another host deciding we are dead and replacing the lock.
        (tmp_path / "train.lock").write_text(json.dumps({"stage": "train", "host": "x", "pid": 1, "token": "thief"}))
        deadline = time.monotonic() + 5
        while lock.held and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(LockLost):
            lock.check()
    finally:
        lock.release()
    # Releasing a lost lock must not delete the new owner's lock file.
    assert json.loads((tmp_path / "train.lock").read_text())["token"] == "thief"


def test_garbage_lock_file_is_judged_by_age(tmp_path):
    path = tmp_path / "train.lock"
    path.write_text("\x00garbage")
    with pytest.raises(LockHeld):
        StageLock(tmp_path, "train", stale_after=30).acquire()
    old = time.time() - 60
    os.utime(path, (old, old))
    StageLock(tmp_path, "train", stale_after=30).acquire().release()


def test_a_creator_killed_while_writing_its_record_leaves_no_lock(tmp_path):
    """kill -9 in the middle of acquiring: no empty lock file is left for others to wait out
    (a record-less lock can only be judged by its age); the next stage takes the lock at once
    and removes the dead creator's record file once it is old."""
    code = ("import os, signal\n"
            "from slimectl.contract.rundir.locks import StageLock\n"
            "os.write = lambda fd, data: os.kill(os.getpid(), signal.SIGKILL)\n"
            f"StageLock({str(tmp_path)!r}, 'rollout').acquire()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert res.returncode == -signal.SIGKILL
    assert not (tmp_path / "rollout.lock").exists()
    (debris,) = tmp_path.glob(".rollout.lock.*.tmp")
    os.utime(debris, (time.time() - 120, time.time() - 120))
    with StageLock(tmp_path, "rollout", stale_after=30, heartbeat_interval=10) as lock:
        assert lock.held and not debris.exists()


def test_a_stage_cleaning_up_removes_a_dead_holders_lock_without_ever_holding_it(run_dir, monkeypatch):
    """Every stage removes the locks of dead holders when it starts (RunDir.cleanup). It must not take them
    to do so: a stage starting at that moment on the same run directory would find its lock held by the
    cleaner and stop ("already running"), as a `rollout --follow` restarted beside a `sync --follow` did."""
    locks = run_dir.path / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    p = start_holder(locks)  # a `train` holder, killed by kill -9
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    monkeypatch.setattr(StageLock, "acquire", lambda self, *a, **k: pytest.fail(f"took the {self.stage} lock"))
    assert [stage for stage, _ in run_dir._remove_stale_locks()] == ["train"]
    assert not (locks / "train.lock").exists()
    assert StageLock(locks, "train").remove_stale({"token": "another"}) is False  # nothing left to remove
