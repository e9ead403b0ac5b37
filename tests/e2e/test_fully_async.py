"""Fully asynchronous RL: `rollout --follow`, `train --follow` and `sync --follow` as three processes on one run
directory (what three shells on one or several machines run), and `rl` with rollout.async_mode = fully_async;
each killed by `kill -9` at its named fault points and started again, and the run audited after: every rollout
trained exactly once, every prompt group in exactly one rollout, nothing half-written, nothing left running."""

from __future__ import annotations

import signal
import time

import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.rundir.artifacts import KINDS
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.helpers import assert_trained_once, engine_pids, slimectl_in_process, start_serve, write_config

pytestmark = pytest.mark.slow

N = 5
FULLY_ASYNC = {"num_rollout": N, "async_mode": "fully_async"}


def group_indices(run) -> list[list[int]]:
    """Each published rollout's prompt groups."""
    return [sorted({s.group_index for s in read_samples(run.rollouts.get(i).file(SAMPLES_FILE))})
            for i in run.rollouts.ids()]


def audit_fully_async(run, n: int, batch: int) -> None:
    """Every rollout trained once; each prompt group in one rollout only and none skipped (the groups past the
    last rollout are the ones its buffer carries); every artifact whole; no debris, lock or engine left."""
    from slimectl.stages.rollout.prompts import BUFFER_FILE

    assert_trained_once(run, n)
    groups = group_indices(run)
    assert all(len(g) == batch for g in groups)
    flat = [g for gs in groups for g in gs]
    assert len(flat) == len(set(flat)), groups  # no group trained in two rollouts
    last = run.rollouts.get(n - 1)
    carried = {s.group_index for s in read_samples(last.file(BUFFER_FILE))} if BUFFER_FILE in last.files else set()
    seen = set(flat) | carried
    assert seen == set(range(max(seen) + 1)), groups  # no prompt group lost (they are started in order)
    check_staleness_bound(run, n)
    for kind in KINDS:
        store = run.artifacts(kind)
        for i in store.ids():
            store.get(i, verify="full")
        assert [i for i, _ in store._scan() if store.state(i) != "ready"] == [], kind
    staging = run.path / ".staging"
    assert not staging.is_dir() or list(staging.iterdir()) == []
    assert not list((run.path / "locks").glob("*.lock"))


def check_staleness_bound(run, n: int, bound: int = 1) -> None:
    """No sample staler than the bound was trained on: the trainer dropped (masked out) exactly the groups
    holding one, and its metrics say so rollout by rollout."""
    from slimectl.contract.metrics import read_metrics

    train = {r["train/rollout_id"]: r for r in read_metrics(run.metrics_path("train")) if "train/rollout_id" in r}
    for rid in range(n):
        samples = read_samples(run.rollouts.get(rid).file(SAMPLES_FILE))
        staleness = {id(s): rid - s.oldest_version for s in samples}
        stale_groups = {s.group_index for s in samples if staleness[id(s)] > bound}
        assert train[rid]["rollout/stale_dropped"] == sum(s.group_index in stale_groups for s in samples), rid
        assert train[rid]["train/staleness_max"] == max(staleness.values()), rid
        assert min(staleness.values()) >= 0, rid


def _start(forks, tmp_path, name: str, argv: list, fault: str | None):
    env = {"SLIMECTL_FAULT": fault} if fault else None
    tag = f"{name}-{fault or 'clean'}".replace(":", "_")
    return forks.run(argv, tmp_path / f"{tag}.out", tmp_path / f"{tag}.err", env=env), tag


def test_three_followers_killed_at_their_fault_points_train_every_rollout_once(tmp_path, stage_forks):
    """rollout --follow killed after publishing rollout 1, again while writing the next and again with it
    renamed but not sealed; sync --follow killed with the engine paused on new weights, then paused before
    any weight moved; train --follow killed after committing rollout 1, then with weights/N published but
    not its checkpoint. Each is started again after each kill (clean after its last) and all three finish."""
    cfg = write_config(tmp_path, rollout=FULLY_ASYNC)
    assert slimectl_in_process("init", tmp_path / "run", "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(tmp_path / "run")
    serve, _ = start_serve(run)
    try:
        plans = {"rollout": (["rollout", "-r", run.path, "--follow"],
                             ["rollout.follow_published:2", "rollout.files_written:1", "artifact.renamed:1"]),
                 "sync": (["sync", "-r", run.path, "--follow"], ["sync.pushed:2", "sync.paused:1"]),
                 "train": (["train", "-r", run.path, "--follow"],
                           ["train.cursor_committed:2", "train.weights_published:1"])}
        procs = {name: _start(stage_forks, tmp_path, name, argv, faults.pop(0)) for name, (argv, faults) in plans.items()}
        deadline, done = time.monotonic() + 420, {}
        while len(done) < len(plans) and time.monotonic() < deadline:
            for name, (proc, tag) in list(procs.items()):
                rc = proc.poll(timeout=0.2)
                if rc is None or name in done:
                    continue
                err = (tmp_path / f"{tag}.err").read_text()
                argv, faults = plans[name]
                if rc == -signal.SIGKILL:
                    assert "fault point" in err, (tag, err[-2000:])
                    procs[name] = _start(stage_forks, tmp_path, name, argv, faults.pop(0) if faults else None)
                else:
                    assert rc == 0, (tag, err[-3000:])
                    assert not faults, (tag, "finished before its fault points", faults)
                    done[name] = tag
        assert len(done) == len(plans), (done, {n: (tmp_path / f"{t}.err").read_text()[-1500:] for n, (_, t) in procs.items()})
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    audit_fully_async(run, N, 2)
    assert engine_pids(run) == [] and run.engines.list() == []
    assert run.weights.ids()[-1] == N


def test_rl_fully_async_killed_after_a_publish_then_rerun(tmp_path, stage_forks):
    """`rl` fully_async killed (kill -9) with rollout 2 just published and the groups of rollout 3 in
    flight; the rerun continues them from rollout 2's buffer and trains every rollout once."""
    cfg = write_config(tmp_path, rollout=FULLY_ASYNC)
    path = tmp_path / "run"
    err = tmp_path / "killed.err"
    rc = stage_forks.run(["rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2"], tmp_path / "killed.out", err,
                         env={"SLIMECTL_FAULT": "rollout.follow_published:3"}).wait(timeout=300)
    assert rc == -signal.SIGKILL and "fault point rollout.follow_published reached" in err.read_text()
    run = RunDir.open(path)
    assert run.rollouts.ids() == [0, 1, 2]
    deadline = time.monotonic() + 60
    while engine_pids(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    res = slimectl_in_process("rl", "-c", cfg, "-r", path)
    assert res.returncode == 0, res.stderr[-3000:]
    audit_fully_async(run, N, 2)
    rl = [r for r in _jsonl(run.metrics_path("rl"))]
    assert all(r["rl/staleness"] <= 1 for r in rl if "rl/staleness" in r), rl


def _jsonl(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_stops_each_follower_cleanly_and_the_rerun_finishes(tmp_path, stage_forks):
    """SIGTERM to `rollout --follow` (waiting for newer weights, two rollouts ahead) and to `sync --follow`
    (waiting for the first weights/N): each stops at its next safe point, exits 143 with the command that
    resumes it and leaves no lock; the three followers started again finish the run, every rollout once."""
    n = 3
    cfg = write_config(tmp_path, rollout={**FULLY_ASYNC, "num_rollout": n})
    assert slimectl_in_process("init", tmp_path / "run", "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(tmp_path / "run")
    serve, _ = start_serve(run)
    try:
        rollout, _ = _start(stage_forks, tmp_path, "rollout", ["rollout", "-r", run.path, "--follow"], None)
        sync, _ = _start(stage_forks, tmp_path, "sync", ["sync", "-r", run.path, "--follow"], None)
        deadline = time.monotonic() + 120
        while run.rollouts.ids() != [0, 1] and time.monotonic() < deadline:  # max_staleness 1: then it waits
            time.sleep(0.2)
        assert run.rollouts.ids() == [0, 1]
        for name, proc in (("rollout", rollout), ("sync", sync)):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 143, name
            err = (tmp_path / f"{name}-clean.err").read_text()
            assert f"interrupted; resume with: slimectl {name} -r {run.path} --follow" in err, err[-2000:]
        assert [p.name for p in (run.path / "locks").glob("*.lock")] == ["serve.lock"]  # the followers' are gone
        assert run.rollouts.ids() == [0, 1]
        procs = [stage_forks.run([stage, "-r", run.path, "--follow"], tmp_path / f"{stage}-2.out",
                                 tmp_path / f"{stage}-2.err") for stage in ("rollout", "sync", "train")]
        for stage, proc in zip(("rollout", "sync", "train"), procs):
            assert proc.wait(timeout=300) == 0, (stage, (tmp_path / f"{stage}-2.err").read_text()[-3000:])
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    audit_fully_async(run, n, 2)
