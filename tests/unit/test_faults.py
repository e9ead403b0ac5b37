"""The fault-point hook itself (slimectl/contract/faults.py): the list matches the code, the spec is
checked, it is a no-op without the variable, and it kills at the NTH arrival. The faults injected
into real runs, and the audits after them: tests/e2e/test_fault_injection.py."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from slimectl.contract.errors import UsageError
from slimectl.contract.faults import ENV, FAULT_POINTS, fault_point, parse_spec
from tests.helpers import ROOT


def test_the_list_of_fault_points_matches_the_calls_in_the_code():
    calls = []
    for p in sorted((ROOT / "slimectl").rglob("*.py")):
        calls += re.findall(r"""fault_point\(["']([^"']+)["']\)""", p.read_text())
    assert sorted(calls) == sorted(FAULT_POINTS)  # each point is called from exactly one place
    doc = (ROOT / "docs" / "run-directory.md").read_text()
    section = doc[doc.index("## Fault points"):]
    assert [n for n in FAULT_POINTS if f"`{n}`" not in section] == []  # and each is documented


def test_spec_parsing_refuses_unknown_points_and_bad_counts():
    assert parse_spec("sync.paused") == {"sync.paused": 1}
    assert parse_spec("sync.paused:3, engine.generate") == {"sync.paused": 3, "engine.generate": 1}
    with pytest.raises(UsageError, match="unknown fault point 'sync.pause'"):
        parse_spec("sync.pause")
    for bad in ("sync.paused:0", "sync.paused:x", "sync.paused:-1"):
        with pytest.raises(UsageError, match="count >= 1"):
            parse_spec(bad)


def test_no_op_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    t = time.process_time()  # CPU time: not stretched by other processes on the machine
    for _ in range(100_000):
        fault_point("artifact.renamed")
    assert time.process_time() - t < 1.0  # ~1 us a call (measured ~0.3 us): free next to any file write
    monkeypatch.setenv(ENV, "sync.paused")
    fault_point("artifact.renamed")  # another point named: nothing happens either


def test_kills_the_process_at_the_nth_arrival(tmp_path):
    """A real publish in a fresh interpreter, killed between the rename and READY of its second
    artifact: the first is whole, the second renamed but invisible, and the next stage's cleanup
    (its writer is dead) removes it."""
    from slimectl.contract.rundir import RunDir

    code = (
        "import sys\n"
        "from slimectl.contract.rundir.artifacts import ArtifactStore\n"
        "store = ArtifactStore(sys.argv[1], 'rollouts', sys.argv[1] + '/.staging')\n"
        "for i in range(3):\n"
        "    with store.publish(i) as d:\n"
        "        (d / 'x').write_text(str(i))\n"
        "    print('published', i, flush=True)\n"
    )
    run = RunDir(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), ENV: "artifact.renamed:2"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "published 0\n"
    assert "slimectl: fault point artifact.renamed reached (time 2): kill -9 pid" in proc.stderr
    assert run.rollouts.ids() == [0] and run.rollouts.state(1) == "incomplete" and run.rollouts.state(2) == "absent"
    assert run.cleanup() == {"staging": [], "rollouts": [1]}
    assert run.rollouts.state(1) == "absent" and run.rollouts.get(0, verify="full").files["x"]["size"] == 1


def test_a_killed_stage_leaves_no_lock_or_engine_record_after_the_next_stage_starts(tmp_path, run_dir):
    """What the e2e audit found: a process killed holding locks (rl holds rl, train and serve) and
    with a registered engine left both behind when the next stage never needed those locks (a rerun
    with nothing to do). The next stage's start (RunDir.cleanup at its lock) now removes them."""
    code = (
        "import sys\n"
        "from slimectl.contract.faults import fault_point\n"
        "from slimectl.contract.rundir import RunDir\n"
        "from slimectl.contract.rundir.registry import EngineRecord\n"
        "run = RunDir.open(sys.argv[1])\n"
        "run.lock('serve').acquire(); run.lock('rl').acquire()\n"
        "run.engines.register(EngineRecord(url='http://127.0.0.1:9', backend='embedded'))\n"
        "fault_point('train.cursor_committed')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir.path)], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), ENV: "train.cursor_committed"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert sorted(p.name for p in (run_dir.path / "locks").glob("*.lock")) == ["rl.lock", "serve.lock"]
    with run_dir.lock("rl"):  # the rerun: takes only its own lock
        assert sorted(p.name for p in (run_dir.path / "locks").glob("*.lock")) == ["rl.lock"]
        assert run_dir.engines.list() == []
    assert not list((run_dir.path / "locks").glob("*.lock"))
