"""`sync --verify` after delta syncs (#47): every tensor the engine serves compared bit for bit with the full
``weights/N`` (the engine's ``/get_weights_checksums`` against ``weights/N``'s tensors), and an engine whose
apply went wrong without saying so is caught, in one line naming the tensor.

One embedded engine runs in this process (its server on a thread of its own), so the test can make its apply
faulty: a wrapper around its delta apply that also moves one element of one tensor, as a bug would.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from slimectl.backends.hf.checkpoint import HFCheckpoint
from slimectl.backends.hf.weight_delta import read_header
from slimectl.contract.metrics import read_metrics
from slimectl.contract.rundir import RunDir
from tests.helpers import slimectl_in_process
from tests.integration.test_delta_sync import error_lines, publish

# A tensor that the sampled read-back (8 tensors, first 4 rows) never reads: only the checksums can see it.
MOVED = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(run, url, server): a delta-mode run and one embedded engine on its model (version 0), in this process."""
    from slimectl.engines.embedded.server import EngineHTTPServer

    root = tmp_path_factory.mktemp("delta-verify")
    res = slimectl_in_process("init", root / "run", "--tiny-model", "qwen2", "--set", "logging.tensorboard=false",
                              "--set", "sync.mode=delta", "--set", "sync.keep_weights=null")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="delta-verify-engine", daemon=True)
    thread.start()
    server = EngineHTTPServer(str(run.config().model.path), port=0, weight_version="0")
    runner = asyncio.run_coroutine_threadsafe(server.start(), loop).result(120)
    try:
        yield run, server.url, server
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        server.shutdown()
        loop.call_soon_threadsafe(loop.stop)


def sync(run, url, version, *args):
    return slimectl_in_process("sync", "-r", run.path, "--version", str(version), "--engine-url", url, *args)


def verify(run, url, version):
    from slimectl.engines.client import EngineClient
    from slimectl.stages.sync.verify import verify_engines
    from slimectl.weight_formats import weight_format

    source = weight_format(run.config()).source_from_dir(version, run.weights.get(version).path)

    async def go():
        async with EngineClient(url) as c:
            return await verify_engines({url: c}, source)

    return asyncio.run(go())


def test_five_delta_syncs_then_verify_compares_every_tensor(engine):
    """Versions 1-5 as deltas (xor and overwrite in turn), each synced as a delta; `--verify` after the fifth
    passes, and it compared every tensor of weights/5 by checksum (and the sample by value)."""
    run, url, server = engine
    for v in range(1, 6):
        publish(run, v, seed=40 + v, encoding="xor" if v % 2 else "overwrite")
        res = sync(run, url, v, *(["--verify"] if v == 5 else []))
        assert res.returncode == 0, res.stderr[-2000:]
        moved = read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"]
        assert moved == read_header(run.weights.get(v).path)["blob_bytes"]  # the delta went, not the weights
    assert "verified" in res.stdout
    with HFCheckpoint(run.weights.get(5).path) as ckpt:
        names = ckpt.names()
    report = verify(run, url, 5)
    assert report == [] and report.verified and report.digests == len(names) and report.checked == 8
    # after the first apply the engine knows the digest of what it serves: later deltas skip the base checksums
    assert server.scheduler.weights.digest == read_header(run.weights.get(5).path)["digest"]


def test_verify_names_the_tensor_a_faulty_apply_moved(engine):
    """The engine's apply also moves one element of a tensor the sample does not read (a bug that reports
    success): `sync --verify` exits 1 with one line naming that tensor and its checksum; the by-value sample
    alone would pass. The next sync (full weights: the engine is no longer on the delta's base) repairs it."""
    run, url, server = engine
    weights = server.scheduler.weights
    v = run.weights.ids()[-1] + 1
    publish(run, v, seed=50)
    honest = weights.delta_applier

    def faulty(header, blob, weight_version):
        swap = honest(header, blob, weight_version)

        def swap_and_move():
            swap()
            with torch.no_grad():
                weights.targets()[MOVED][-1, -1] += 0.5

        return swap_and_move

    weights.delta_applier = faulty
    try:
        res = sync(run, url, v, "--verify")
    finally:
        del weights.delta_applier
    lines = error_lines(res.stderr)
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert f"engine {url}: weight {MOVED} differs from weight version {v} (xxh3-128 of its float32 bytes" in lines[0]
    report = verify(run, url, v)
    assert [p.split(" weight ")[1].split()[0] for p in report] == [MOVED] and report.checked == 8
    res = sync(run, url, v, "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert verify(run, url, v) == []
    assert weights.digest == read_header(run.weights.get(v).path)["digest"]  # recorded from weights/N's delta.json


def test_a_sync_killed_during_the_engines_apply_leaves_it_on_the_new_version(engine, stage_forks, tmp_path):
    """`sync` killed -9 while the engine applies its delta (the apply waits until the sync process is dead): the
    apply is the engine's, in its memory, so it completes; every tensor is then weights/N+1's (checksums), never a
    mix, and the engine is on N+1, still paused. The rerun continues it, verified."""
    import os
    import signal
    import time

    run, url, server = engine
    weights = server.scheduler.weights
    v = run.weights.ids()[-1]
    assert sync(run, url, v).returncode == 0
    publish(run, v + 1, seed=60)
    started, returned, honest = threading.Event(), threading.Event(), weights.delta_applier
    killed: dict = {}

    def killing_the_sync(header, blob, weight_version):
        swap = honest(header, blob, weight_version)  # checked and computed: the apply is under way
        assert started.wait(60)
        os.kill(killed["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _alive(killed["pid"]):
            time.sleep(0.05)
        killed["dead_before_swap"] = not _alive(killed["pid"])
        returned.set()
        return swap

    weights.delta_applier = killing_the_sync
    try:
        proc = stage_forks.run(["sync", "-r", run.path, "--version", str(v + 1), "--engine-url", url],
                               tmp_path / "out", tmp_path / "err")
        killed["pid"] = proc.pid
        started.set()
        assert proc.wait(timeout=120) == -signal.SIGKILL, (tmp_path / "err").read_text()[-2000:]
        assert returned.wait(60)
    finally:
        del weights.delta_applier
    assert killed["dead_before_swap"]
    deadline = time.monotonic() + 60
    while weights.version != str(v + 1) and time.monotonic() < deadline:  # the swap, queued after the apply
        time.sleep(0.05)
    assert verify(run, url, v + 1) == [] and weights.version == str(v + 1)  # whole: every tensor by checksum
    assert server.scheduler.paused  # the killed sync never continued it
    res = sync(run, url, v + 1, "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not server.scheduler.paused


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (the fork server reaps its children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_an_engine_killed_mid_apply_and_the_next_sync_converges(engine, tmp_path, encoding):
    """An engine killed -9 in the middle of a delta's apply (fault point engine.delta_checked: every tensor checked
    and computed, nothing swapped): the sync fails in one line naming it (exit 1). The engine is gone with its
    memory; the one that replaces it converges at the next sync: started on the delta's base it gets the delta,
    started anywhere else (the model, version 0) the full weights; every tensor verified."""
    from tests.helpers import start_engine, stop_engine, wait_healthy

    run, _, _ = engine
    v = run.weights.ids()[-1]
    publish(run, v + 1, seed=70 + len(encoding), encoding=encoding)
    log = tmp_path / "faulty.log"
    proc, url = start_engine(run.weights.get(v).path, log, "--weight-version", str(v),
                             env={"SLIMECTL_FAULT": "engine.delta_checked"})
    try:
        wait_healthy(url)
        res = sync(run, url, v + 1)
        assert proc.wait(timeout=60) != 0  # (the fork client cannot die by SIGKILL as its child did: exit 1)
    finally:
        stop_engine(proc)
    assert "slimectl: fault point engine.delta_checked reached (time 1): kill -9" in log.read_text()
    lines = error_lines(res.stderr)
    assert res.returncode == 1 and len(lines) == 1 and url in lines[0], res.stderr
    on_base = encoding == "xor"
    start = run.weights.get(v).path if on_base else run.config().model.path
    proc, url = start_engine(start, tmp_path / "fresh.log", "--weight-version", str(v) if on_base else "0")
    try:
        wait_healthy(url)
        res = sync(run, url, v + 1, "--verify")
        assert res.returncode == 0, res.stderr[-2000:]
        moved = read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"]
        blob = read_header(run.weights.get(v + 1).path)["blob_bytes"]
        assert moved == blob if on_base else moved > 50 * blob  # the delta on its base, else the full weights
        assert verify(run, url, v + 1) == []
    finally:
        stop_engine(proc)
