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


def republish(run, version: int, header=None, blob=None) -> None:
    """weights/VERSION published again (sealed by a new READY manifest: the run directory's own check passes) with
    its delta's header or blob replaced, as a faulty publisher would leave it."""
    import shutil

    from slimectl.backends.hf.weight_delta import DELTA_FILE, DELTA_META

    src = run.weights.get(version).path
    keep = src.parent.parent / f"keep-{version}"
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(src, keep, ignore=shutil.ignore_patterns("READY", ".writer.json"))
    meta = run.weights.get(version).meta
    with run.weights.publish(version, meta=meta, overwrite=True) as d:
        for f in keep.iterdir():
            if f.name != "READY":
                shutil.copy2(f, d / f.name)
        if header is not None:
            (d / DELTA_META).write_text(__import__("json").dumps(header))
        if blob is not None:
            (d / DELTA_FILE).write_bytes(blob)
    shutil.rmtree(keep)


def test_unusable_deltas_are_refused_by_the_cli_with_exit_2_and_nothing_applied(engine):
    """Through `slimectl sync`: a delta whose blob is shorter than its header says, and one of an unknown encoding
    (each sealed by its READY manifest: the run directory's check passes) are refused before any engine is
    touched: exit 2, one line naming the version and the fix; the engine keeps every tensor of its version."""
    import json

    from slimectl.backends.hf.weight_delta import DELTA_FILE, DELTA_META

    run, url, _ = engine
    v = run.weights.ids()[-1]
    assert sync(run, url, v).returncode == 0
    publish(run, v + 1, seed=80)
    d = run.weights.get(v + 1).path
    header, blob = json.loads((d / DELTA_META).read_text()), (d / DELTA_FILE).read_bytes()
    for bad, words in (({"blob": blob[:-7]}, "truncated; republish"),
                       ({"header": {**header, "encoding": "bitplane"}}, "unknown delta encoding 'bitplane'")):
        republish(run, v + 1, **bad)
        res = sync(run, url, v + 1)
        lines = error_lines(res.stderr)
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert f"the delta of weight version {v + 1} is unusable" in lines[0] and words in lines[0], lines[0]
        assert verify(run, url, v) == []  # nothing applied, nothing half-applied
    republish(run, v + 1, header=header, blob=blob)
    assert sync(run, url, v + 1, "--verify").returncode == 0


def test_retention_keeps_what_the_chain_needs_and_no_more(engine):
    """sync.keep_weights 1, as train prunes after each publish: weights/N+1 still gets its delta (weights/N is there
    while N+1 is written), then weights/N goes. An engine on N applies N+1's delta with weights/N gone from the disk
    (its base is in its memory); an engine on another version gets the full weights/N+1, the one version kept."""
    from slimectl.backends.hf.weight_delta import DELTA_META

    run, url, _ = engine
    v = run.weights.ids()[-1]
    assert sync(run, url, v).returncode == 0
    run.weights.prune(1)
    assert run.weights.ids() == [v]
    publish(run, v + 1, seed=90)
    run.weights.prune(1)
    assert run.weights.ids() == [v + 1] and (run.weights.get(v + 1).path / DELTA_META).is_file()
    res = sync(run, url, v + 1, "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"] == read_header(
        run.weights.get(v + 1).path)["blob_bytes"]
    publish(run, v + 2, seed=91)
    run.weights.prune(1)
    assert sync(run, url, 0).returncode == 0  # the engine back on the model (version 0): off the chain
    res = sync(run, url, v + 2, "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"] > 50 * read_header(
        run.weights.get(v + 2).path)["blob_bytes"]  # the full weights
