"""Artifact publish protocol: atomic, checksummed, crash-safe, multi-process safe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import run_py
from slimectl.contract.errors import ArtifactExists, ArtifactNotFound, CorruptArtifact, WaitTimeout
from slimectl.contract.rundir import READY
from slimectl.contract.rundir.artifacts import format_id


def publish_files(store, i, files, **kw):
    with store.publish(i, **kw) as d:
        for name, data in files.items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)


def test_publish_then_read_with_manifest(run_dir):
    publish_files(run_dir.rollouts, 7, {"a.bin": b"abc", "sub/b.json": b"{}"}, meta={"weight_version": 3}, stage="rollout")
    art = run_dir.rollouts.get(7, verify="full")
    assert art.path == run_dir.path / "rollouts" / "000007"
    assert art.meta == {"weight_version": 3}
    assert art.files["a.bin"]["size"] == 3
    assert art.files["a.bin"]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert set(art.files) == {"a.bin", "sub/b.json"}
    assert art.manifest["writer"]["stage"] == "rollout" and art.manifest["writer"]["pid"] == os.getpid()
    assert run_dir.rollouts.ids() == [7] and run_dir.rollouts.latest().id == 7
    assert not list((run_dir.path / ".staging").iterdir())


def test_exception_inside_publish_leaves_nothing(run_dir):
    with pytest.raises(RuntimeError):
        with run_dir.rollouts.publish(1) as d:
            (d / "half").write_bytes(b"x")
            raise RuntimeError("writer failed")
    assert run_dir.rollouts.state(1) == "absent"
    assert not list((run_dir.path / ".staging").iterdir())


def test_overwrite_needs_force(run_dir):
    publish_files(run_dir.weights, 1, {"w": b"old"})
    with pytest.raises(ArtifactExists, match="already published"):
        publish_files(run_dir.weights, 1, {"w": b"new"})
    publish_files(run_dir.weights, 1, {"w": b"newer"}, overwrite=True)
    assert run_dir.weights.get(1).file("w").read_bytes() == b"newer"


def test_missing_artifact_error_names_what_exists(run_dir):
    publish_files(run_dir.rollouts, 0, {"x": b"1"})
    with pytest.raises(ArtifactNotFound, match=r"rollouts/000005 is not published \(READY rollouts: 0\)"):
        run_dir.rollouts.get(5)


@pytest.mark.parametrize("damage", ["manifest-garbage", "manifest-edited", "file-truncated", "file-flipped", "file-missing"])
def test_corruption_is_detected(run_dir, damage):
    publish_files(run_dir.checkpoints, 2, {"model.safetensors": b"0123456789"})
    d = run_dir.checkpoints.dir_for(2)
    if damage == "manifest-garbage":
        (d / READY).write_text("{not json")
    elif damage == "manifest-edited":
        m = json.loads((d / READY).read_text())
        m["files"]["model.safetensors"]["size"] = 11
        (d / READY).write_text(json.dumps(m))
    elif damage == "file-truncated":
        (d / "model.safetensors").write_bytes(b"01234")
    elif damage == "file-flipped":
        (d / "model.safetensors").write_bytes(b"0123456780")
    else:
        (d / "model.safetensors").unlink()
    level = "full" if damage == "file-flipped" else "size"
    with pytest.raises(CorruptArtifact) as ei:
        run_dir.checkpoints.get(2, verify=level)
    assert "checkpoints" in str(ei.value)
    if damage == "file-flipped":
        run_dir.checkpoints.get(2, verify="size")  # same size: only the sha256 check catches it


def test_manifest_copied_to_another_id_is_rejected(run_dir):
    publish_files(run_dir.rollouts, 1, {"x": b"1"})
    publish_files(run_dir.rollouts, 2, {"x": b"2"})
    (run_dir.rollouts.dir_for(2) / READY).write_bytes((run_dir.rollouts.dir_for(1) / READY).read_bytes())
    with pytest.raises(CorruptArtifact, match="describes rollouts/1"):
        run_dir.rollouts.get(2)


KILLED_WRITER = r"""
import os, sys, time
from slimectl.contract.rundir import RunDir
import slimectl.contract.rundir.artifacts as A
run = RunDir.open(sys.argv[1]); phase = sys.argv[2]
if phase == "after-rename":
    real = A.atomic_write_json
    def die(path, obj):
        if str(path).endswith("READY"):
            os.kill(os.getpid(), 9)
        return real(path, obj)
    A.atomic_write_json = die
with run.rollouts.publish(3) as d:
    (d / "samples.bin").write_bytes(b"x" * 1000)
    if phase == "before-rename":
        print("WRITING", flush=True)
        os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize("phase", ["before-rename", "after-rename"])
def test_writer_killed_mid_publish_is_never_read_and_is_cleaned(run_dir, phase):
    proc = run_py(KILLED_WRITER, str(run_dir.path), phase)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    store = run_dir.rollouts
    assert store.ids() == []
    with pytest.raises(ArtifactNotFound):
        store.get(3)
    if phase == "before-rename":
        assert store.state(3) == "absent"
        assert len(list((run_dir.path / ".staging").iterdir())) == 1  # the leftover temp dir
    else:
        assert store.state(3) == "incomplete"  # renamed, never marked READY
    with pytest.raises(WaitTimeout):
        store.wait_for(3, timeout=0.2, poll=0.05)
    removed = run_dir.cleanup()
    assert removed["staging"] or removed.get("rollouts") == [3]
    assert store.state(3) == "absent" and not list((run_dir.path / ".staging").iterdir())
    publish_files(store, 3, {"samples.bin": b"ok"})  # a rerun publishes normally
    assert store.get(3, verify="full").file("samples.bin").read_bytes() == b"ok"


def test_publishing_over_an_incomplete_artifact_of_a_dead_writer(run_dir):
    proc = run_py(KILLED_WRITER, str(run_dir.path), "after-rename")
    assert proc.returncode == -signal.SIGKILL
    publish_files(run_dir.rollouts, 3, {"samples.bin": b"second try"})  # no cleanup() call needed
    assert run_dir.rollouts.get(3).file("samples.bin").read_bytes() == b"second try"


def test_live_writers_staging_dir_is_not_cleaned(run_dir):
    with run_dir.rollouts.publish(4) as d:
        (d / "x").write_bytes(b"1")
        assert run_dir.cleanup()["staging"] == []
        assert d.exists()
    assert run_dir.rollouts.exists(4)


CONCURRENT = r"""
import sys, time
from slimectl.contract.rundir import RunDir
from slimectl.contract.errors import ArtifactExists
run = RunDir.open(sys.argv[1]); tag = sys.argv[2]; start = float(sys.argv[3])
ok = exists = 0
for i in range(40):
    while time.time() < start: time.sleep(0.001)
    try:
        with run.rollouts.publish(i) as d:
            (d / "who").write_text(tag)
            (d / "payload").write_bytes(tag.encode() * 5000)
        ok += 1
    except ArtifactExists:
        exists += 1
print(ok, exists)
"""


def test_two_processes_publishing_the_same_ids_concurrently(run_dir):
    start = str(time.time() + 1.5)
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(run_dir.path), tag, start],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for tag in ("A", "B")]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    counts = [tuple(map(int, out.split())) for out, _ in outs]
    assert sum(c[0] for c in counts) == 40  # every id published exactly once...
    assert sum(c[1] for c in counts) == 40  # ...and the loser of each race was told so
    assert run_dir.rollouts.ids() == list(range(40))
    for i in range(40):
        art = run_dir.rollouts.get(i, verify="full")  # never a mix of two writers
        who = art.file("who").read_text()
        assert art.file("payload").read_bytes() == who.encode() * 5000
    assert not list((run_dir.path / ".staging").iterdir())


def test_waiter_sees_artifact_published_by_another_thread(run_dir):
    def later():
        time.sleep(0.3)
        publish_files(run_dir.evals, 9, {"r.json": b"{}"})

    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    art = run_dir.evals.wait_for(9, timeout=20, poll=0.05)
    t.join()
    assert art.id == 9 and 0.2 < time.monotonic() - t0 < 20


def test_waiter_timeout_names_the_artifact(run_dir):
    with pytest.raises(WaitTimeout, match=r"evals/000001 did not become READY within 0.1 s"):
        run_dir.evals.wait_for(1, timeout=0.1, poll=0.02)


def test_prune_keeps_newest_and_protected(run_dir):
    for i in range(5):
        publish_files(run_dir.weights, i, {"w": bytes([i])})
    assert run_dir.weights.prune(2, protect={0}) == [1, 2]
    assert run_dir.weights.ids() == [0, 3, 4]


def test_ids_are_zero_padded_and_numeric(run_dir):
    publish_files(run_dir.rollouts, 1234567, {"x": b"1"})
    assert (run_dir.path / "rollouts" / format_id(1234567)).is_dir()
    assert run_dir.rollouts.ids() == [1234567]


def test_full_disk_is_a_clear_error(run_dir, monkeypatch):
    import errno

    import slimectl.contract.rundir.artifacts as A
    from slimectl.contract.errors import RunDirError

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(A.os, "rename", full)
    with pytest.raises(RunDirError, match="no space left"):
        publish_files(run_dir.rollouts, 1, {"x": b"1"})
    monkeypatch.undo()
    assert run_dir.rollouts.state(1) == "absent"
    assert not list((run_dir.path / ".staging").iterdir())


def test_a_published_file_is_hashed_from_the_bytes_written_unless_it_changed(tmp_path):
    """The safetensors writer hashes what it writes (no read-back when the artifact is sealed); a file
    changed after that is read and hashed again, so the manifest always describes the file on disk."""
    import torch

    from slimectl.backends.hf.checkpoint import write_safetensors_file
    from slimectl.contract.rundir import atomic

    p = tmp_path / "model.safetensors"
    write_safetensors_file({"a": torch.arange(1000.0), "b": torch.ones(3, 4)}, p)
    key = atomic._identity(p)
    assert atomic._WRITTEN_DIGESTS[key] == atomic.sha256_file(p)
    assert atomic.manifest_sha256(p) == atomic.sha256_file(p) and key not in atomic._WRITTEN_DIGESTS
    write_safetensors_file({"a": torch.zeros(1000)}, p)
    recorded = atomic._WRITTEN_DIGESTS[atomic._identity(p)]
    with open(p, "ab") as f:  # changed behind the writer's back
        f.write(b"x")
    assert atomic.manifest_sha256(p) == atomic.sha256_file(p) != recorded


def test_a_writer_killed_before_its_record_was_renamed_is_known_dead_by_the_temp_record(run_dir):
    """Seen in CI: killed between writing `.writer.json` and renaming it, a writer leaves its staging dir
    with the record whole under its temp name only; that record names the dead writer (not the dir's fresh
    mtime, which would keep it as a live one's for minutes), so the next stage's cleanup removes it."""
    import json

    from slimectl.contract.rundir.artifacts import WRITER_FILE, writer_info

    d = run_dir.path / ".staging" / "rollouts.000001.deadbeef"
    d.mkdir(parents=True)
    dead = {**writer_info("rollout"), "pid": 2 ** 22 + 7, "create_time": 1.0}  # no such process
    (d / f".tmp-{WRITER_FILE}.{dead['pid']}.0a1b2c3d").write_text(json.dumps(dead))
    assert run_dir.cleanup()["staging"] == ["rollouts.000001.deadbeef"] and not d.exists()

    # the same with a live writer's temp record (this process): kept
    d.mkdir()
    live = writer_info("rollout")
    (d / f".tmp-{WRITER_FILE}.{live['pid']}.0a1b2c3d").write_text(json.dumps(live))
    assert run_dir.cleanup()["staging"] == [] and d.exists()
    # a torn temp record (not JSON): judged by how recently the dir changed, as with no record (kept: fresh)
    (d / f".tmp-{WRITER_FILE}.{live['pid']}.0a1b2c3d").write_text('{"host": ')
    assert run_dir.cleanup()["staging"] == [] and d.exists()
