"""``supervisor.kill_tree``: what is left of an engine whose supervisor died with it (a killed Ray engine actor's
engine) is killed by pid and start time: the process, its descendants, and the members of its process group that
outlived it (SGLang's scheduler after a ``kill -9`` of its server)."""

from __future__ import annotations

import signal
import subprocess

import psutil

from slimectl.engines.supervisor import kill_tree

TREE = "sleep 300 & echo up; wait"  # a shell (the server) and its child (its scheduler)


def _tree() -> tuple[psutil.Process, list[psutil.Process]]:
    """A leader in its own session with one child (a server and its scheduler)."""
    p = subprocess.Popen(["sh", "-c", TREE], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    leader = psutil.Process(p.pid)
    kids = leader.children(recursive=True)
    assert len(kids) == 1
    return leader, kids


def test_kill_tree_kills_a_live_process_and_its_descendants():
    leader, kids = _tree()
    kill_tree(leader.pid, leader.create_time())
    _, alive = psutil.wait_procs([leader, *kids], timeout=10)
    assert alive == []


def test_kill_tree_kills_the_group_members_a_dead_leader_left():
    leader, kids = _tree()
    created = leader.create_time()
    leader.send_signal(signal.SIGKILL)
    psutil.wait_procs([leader], timeout=10)
    assert kids[0].is_running() and kids[0].status() != psutil.STATUS_ZOMBIE  # orphaned, in the leader's group
    kill_tree(leader.pid, created)
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert alive == []


def test_kill_tree_spares_a_process_that_reused_the_pid():
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        kill_tree(p.pid, psutil.Process(p.pid).create_time() - 100)  # another process's start time
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
