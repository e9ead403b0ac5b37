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
    run, url, _ = engine
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
