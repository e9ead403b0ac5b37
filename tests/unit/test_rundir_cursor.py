"""The consumption cursor: exactly-once, even when the consumer is kill -9'ed at random moments."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from slimectl.contract.errors import CursorError
from slimectl.contract.rundir import RunDir


def test_commit_must_be_exactly_the_next_id(run_dir):
    cur = run_dir.cursor("train")
    with run_dir.lock("train") as lock:
        assert cur.next_id == 0
        cur.commit(0, {"ckpt": 0}, lock=lock)
        with pytest.raises(CursorError, match="already consumed"):
            cur.commit(0, lock=lock)
        with pytest.raises(CursorError, match="would skip rollouts/000001..000002"):
            cur.commit(3, lock=lock)
        st = cur.commit(1, {"ckpt": 1}, lock=lock)
    assert st.next == 2 and st.consumed == [0, 1] and st.data == {"ckpt": 1}
    assert run_dir.cursor("train").read().data == {"ckpt": 1}


def test_commit_requires_the_stage_lock(run_dir):
    with pytest.raises(CursorError, match="requires holding the train stage lock"):
        run_dir.cursor("train").commit(0)


def test_rewind_to_checkpoint(run_dir):
    cur = run_dir.cursor("train")
    with run_dir.lock("train") as lock:
        for i in range(4):
            cur.commit(i, lock=lock)
        st = cur.rewind(2, {"ckpt": 1}, reason="resume from checkpoint 1", lock=lock)
        assert st.next == 2 and st.consumed == [0, 1] and st.rewinds[-1]["from"] == 4
        with pytest.raises(CursorError):
            cur.rewind(3, None, reason="forward", lock=lock)


# A consumer whose whole state (a running total) is committed atomically with the cursor.
# Items are rollouts 0..N-1 whose payload is the value to add.
CONSUMER = r"""
import os, random, sys, time
from slimectl.contract.rundir import RunDir
run = RunDir.open(sys.argv[1]); n = int(sys.argv[2])
random.seed(os.getpid())
with run.lock("train", stale_after=30, heartbeat_interval=0.5) as lock:
    cur = run.cursor("train")
    while True:
        st = cur.read()
        if st.next >= n:
            break
        art = run.rollouts.wait_for(st.next, timeout=30, poll=0.01)
        value = int(art.file("value").read_text())
        time.sleep(random.random() * 0.02)            # "training"
        total = st.data.get("total", 0) + value
        log = st.data.get("applied", []) + [st.next]
        cur.commit(st.next, {"total": total, "applied": log}, lock=lock)
        time.sleep(random.random() * 0.01)
print("DONE", flush=True)
"""


def test_exactly_once_across_random_kill_9(run_dir):
    n = 30
    for i in range(n):
        with run_dir.rollouts.publish(i) as d:
            (d / "value").write_text(str(i * i))
    rng = random.Random(1)
    cursor = run_dir.cursor("train")
    kills = 0
    while cursor.next_id < n - 3 and kills < 8:
        # Let the consumer get a random distance further, then kill it at a random instant.
        target = rng.randint(cursor.next_id + 1, n - 2)
        p = subprocess.Popen([sys.executable, "-c", CONSUMER, str(run_dir.path), str(n)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while cursor.next_id < target and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.random() * 0.02)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        kills += 1
    final = subprocess.run([sys.executable, "-c", CONSUMER, str(run_dir.path), str(n)],
                           capture_output=True, text=True, timeout=120)
    assert final.returncode == 0 and "DONE" in final.stdout, final.stderr
    st = RunDir.open(run_dir.path).cursor("train").read()
    assert st.next == n
    assert st.consumed == list(range(n))
    assert st.data["applied"] == list(range(n))       # every rollout applied once, in order
    assert st.data["total"] == sum(i * i for i in range(n))
    assert kills >= 3  # the consumer really was killed mid-run, several times
