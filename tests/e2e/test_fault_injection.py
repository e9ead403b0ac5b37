"""Fault injection as a suite: each named fault point (slimectl/contract/faults.py, docs/run-directory.md
"Fault points") kills a real run there (`kill -9` of `rl`, of its engine, of `export`, of `convert`),
a rerun follows, and after the last, clean rerun the run directory is audited: every rollout trained
exactly once, every artifact's manifest and files valid, nothing incomplete, no debris in .staging,
no engine left, no lock, and the final weights/N equal, file for file (sha256), an uninterrupted run's.

Cheap by chaining: one run directory takes one fault per rerun (each rerun resumes where the last
was killed, so the chain walks through the loop once), the audit runs once at the end. The
uninterrupted run of the synchronous chain is the session's clean_rl_run (tests/conftest.py). The
runs that are killed are forked by one fork server for the module (tests/forkserver.py), which pays
the interpreter's imports once instead of once per kill; each is still a process of its own, killed by
its own SIGKILL at the fault point.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.artifacts import KINDS
from tests.helpers import assert_trained_once, engine_pids, slimectl_in_process, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def forks(stage_forks):
    """The worker's fork server for commands (tests/conftest.py's ``stage_forks``; tests/forkserver.py): each
    command a process of its own, its imports paid once."""
    return stage_forks


def _killed(forks, tmp_path, point: str, *argv) -> str:
    """`slimectl ARGV` as a process of its own (forked by the fork server) with SLIMECTL_FAULT=POINT:
    it must die by SIGKILL at that point (its own fault line on stderr); returns its stderr. Output
    goes to files: after a kill -9 an engine may keep an inherited descriptor open a while."""
    err = tmp_path / f"fault-{point}.err"
    rc = forks.run(argv, tmp_path / f"fault-{point}.out", err, env={"SLIMECTL_FAULT": point}).wait(timeout=300)
    text = err.read_text()
    name = point.split(",")[0].split(":")[0]
    assert rc == -signal.SIGKILL and f"fault point {name} reached" in text, (point, rc, text[-3000:])
    return text


def _rl_killed(forks, tmp_path, cfg, path, point: str) -> str:
    text = _killed(forks, tmp_path, point, "rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2")
    run = RunDir.open(path)
    deadline = time.monotonic() + 60  # a bound for a loaded machine: it is usually gone within a second
    while engine_pids(run) and time.monotonic() < deadline:  # the engine notices its parent died (0.5 s poll)
        time.sleep(0.2)
    assert engine_pids(run) == [], point
    return text


def _staging(run) -> list[str]:
    d = run.path / ".staging"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _weights_sha(run, version: int) -> dict[str, str]:
    return {f: rec["sha256"] for f, rec in run.weights.get(version, verify="full").files.items()}


def audit(run, n: int, want_weights: dict[str, str]) -> None:
    """The run after its last rerun: nothing lost, nothing twice, nothing half-written, nothing left running."""
    assert_trained_once(run, n)  # the cursor consumed 0..n-1 once each; the last checkpoint made n steps
    for kind in KINDS:
        store = run.artifacts(kind)
        for i in store.ids():
            store.get(i, verify="full")  # manifest checksum, kind/id, every file's size and sha256
        assert [i for i, _ in store._scan() if store.state(i) != "ready"] == [], kind  # nothing incomplete
    assert _staging(run) == []
    assert engine_pids(run) == [] and run.engines.list() == []
    assert not list((run.path / "locks").glob("*.lock"))
    assert _weights_sha(run, n) == want_weights  # the same final policy as a run never interrupted


def test_nine_faults_in_one_synchronous_rl_run(tmp_path, clean_rl_run, forks):
    """rl (2 rollouts, synchronous, disk sync), killed once per rerun, in the order the loop reaches
    the points, and once its engine, mid-rollout."""
    clean, clean_cfg = clean_rl_run
    cfg = write_config(tmp_path, rollout={"num_rollout": 2})
    assert cfg.read_text() == clean_cfg.read_text()
    path = tmp_path / "run"

    _rl_killed(forks, tmp_path, cfg, path, "rollout.files_written")  # rollout 0 written, not renamed
    run = RunDir.open(path)
    assert [n.split(".")[0] for n in _staging(run)] == ["rollouts"] and run.rollouts.state(0) == "absent"

    err = _rl_killed(forks, tmp_path, cfg, path, "artifact.renamed")  # rollout 0 renamed, no READY
    assert "leftover(s) of dead writers" in err and ".staging/rollouts.000000." in err  # the first fault's
    assert run.rollouts.state(0) == "incomplete" and _staging(run) == []

    _rl_killed(forks, tmp_path, cfg, path, "sync.paused")  # the first sync (version 0), engines paused
    # The checkpoint is written in the background (stages/train/writer.py CheckpointWriter) while the loop goes
    # on: weights/1 may already be written, rollout 1 generated, when the writer dies. The engine dies too, at
    # its second /generate of rollout 0: the heartbeat starts it again at version 0 and the rollout waits for it
    # (it is the only engine), its lost requests generated again whole.
    err = _rl_killed(forks, tmp_path, cfg, path, "train.state_saved,engine.generate:2")  # checkpoint 1's model
    assert run.rollouts.ids()[0] == 0 and "checkpoints" in [n.split(".")[0] for n in _staging(run)]  # + optimizer
    assert "is back at weight version 0 (checked)" in err, err[-3000:]
    assert not run.checkpoints.exists(1) and run.cursor("train").read().next == 0

    _rl_killed(forks, tmp_path, cfg, path, "train.checkpoint_published")  # checkpoints/1 READY, the cursor not
    assert run.checkpoints.ids() == [1] and run.cursor("train").read().next == 0
    assert [n for n in _staging(run) if n.startswith("checkpoints")] == []

    _rl_killed(forks, tmp_path, cfg, path, "train.resumed")  # the rerun loaded checkpoint 1, then died
    assert run.cursor("train").read().next == 0

    _rl_killed(forks, tmp_path, cfg, path, "sync.pushed")  # weights/1 in the engine, which is still paused
    assert run.cursor("train").read().consumed == [0] and run.weights.ids() == [1]

    _rl_killed(forks, tmp_path, cfg, path, "train.cursor_committed")  # rollout 1 trained and committed, not synced
    assert run.cursor("train").read().consumed == [0, 1] and run.weights.ids() == [1, 2]

    res = slimectl_in_process("rl", "-c", cfg, "-r", path)
    assert res.returncode == 0 and "nothing to do" in res.stderr, res.stderr[-3000:]
    audit(run, 2, _weights_sha(clean, 2))



def test_one_step_off_killed_with_a_rollout_in_flight(tmp_path, forks):
    """Async: killed right after rollout 1 was submitted beside the training of rollout 0; the rerun
    generates rollout 1 again on the same weights (version 0), so the final policy is the clean run's."""
    cfg = write_config(tmp_path, rollout={"num_rollout": 2, "async_mode": "one_step_off"})
    clean = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "clean", "--tiny-model", "qwen2")
    assert clean.returncode == 0, clean.stderr[-3000:]
    path = tmp_path / "run"
    _rl_killed(forks, tmp_path, cfg, path, "rl.rollout_in_flight")
    run = RunDir.open(path)
    assert run.rollouts.ids() == [0] and run.cursor("train").read().next == 0
    res = slimectl_in_process("rl", "-c", cfg, "-r", path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [run.rollouts.get(i).meta["weight_version"] for i in range(2)] == ["0", "0"]
    audit(run, 2, _weights_sha(RunDir.open(tmp_path / "clean"), 2))


def test_convert_and_export_killed_before_their_rename_then_rerun(tmp_path, forks):
    """convert -r killed with the torch_dist files written but not the tracker, export -r killed with
    the HF files written but not renamed into exports/0; each rerun leaves one whole result and no debris."""
    from safetensors.torch import load_file

    assert slimectl_in_process("init", tmp_path / "run", "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(tmp_path / "run")
    _killed(forks, tmp_path, "convert.before_tracker", "convert", "-r", run.path)
    assert not run.checkpoints.exists(0) and [n.split(".")[0] for n in _staging(run)] == ["checkpoints"]
    res = slimectl_in_process("convert", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert run.checkpoints.get(0, verify="full").meta["source"] == "convert"
    _killed(forks, tmp_path, "export.written", "export", "-r", run.path)
    assert not (run.path / "exports" / "000000").exists()
    res = slimectl_in_process("export", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _staging(run) == [] and sorted(p.name for p in (run.path / "exports").iterdir()) == ["000000"]
    assert not list((run.path / "locks").glob("*.lock"))
    model = Path(run.config().model.path)
    a, b = (load_file(str(d / "model.safetensors")) for d in (run.path / "exports" / "000000", model))
    assert sorted(a) == sorted(b) and all((a[k] == b[k]).all() for k in a)  # the round trip is exact
