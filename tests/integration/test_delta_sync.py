"""sync.mode delta (#47): weights/N carries its delta against N-1 and the embedded engine applies it.

One `slimectl serve` of two embedded engines on a tiny qwen2 (fp32). Versions are published the way
train publishes them (:meth:`DeltaWeights.write_version`), each changing ~1% of the elements of
every tensor, as an RL step does; then the engines are synced by disk or over the gloo group and
read back in full, compared bit for bit with the full ``weights/N``.
"""

from __future__ import annotations

import re

import pytest
import torch

from slimectl.backends.hf.checkpoint import HFCheckpoint
from slimectl.backends.hf.weight_delta import DELTA_FILE, read_header
from slimectl.contract.metrics import read_metrics
from slimectl.contract.rundir import RunDir
from slimectl.weight_formats import weight_format
from tests.helpers import post, slimectl_in_process, start_serve

pytestmark = pytest.mark.xdist_group("delta_sync")


def publish(run: RunDir, version: int, seed: int, frac: float = 0.01, encoding: str = "xor") -> None:
    """weights/VERSION: weights/VERSION-1 (the model at 1) with ``frac`` of each tensor's elements nudged, its
    delta in ``encoding``."""
    cfg = run.config()
    form = weight_format(cfg)
    form.encoding = encoding
    base = run.weights.get(version - 1).path if run.weights.exists(version - 1) else cfg.model.path
    g = torch.Generator().manual_seed(seed)
    with HFCheckpoint(base) as ckpt:
        prev = dict(ckpt.iter_tensors())
    new = {}
    for k, v in prev.items():
        mask = torch.rand(v.shape, generator=g) < frac
        new[k] = torch.where(mask, v + 0.05 * torch.randn(v.shape, generator=g), v).to(v.dtype)
    with run.weights.publish(version, meta={"weight_version": version, **form.published_meta}) as d:
        form.write_version(run, version, iter(new.items()), d, cfg.model.path)


def served_tensors(url: str, names) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(post(url, "/get_weights_by_name", {"name": n, "truncate_size": 1 << 20})) for n in names}


def assert_engine_holds(run: RunDir, url: str, version: int) -> None:
    """Every tensor the engine serves is bit for bit weights/VERSION's (fp32: the read-back is exact)."""
    with HFCheckpoint(run.weights.get(version).path) as ckpt:
        want = dict(ckpt.iter_tensors())
    got = served_tensors(url, want)
    bad = [n for n in want if not torch.equal(got[n], want[n].float())]
    assert not bad, f"{url} differs from weights/{version} in {bad[:3]}"
    assert version_of(url) == str(version)


def version_of(url: str) -> str:
    import json
    import urllib.request

    with urllib.request.urlopen(url + "/get_model_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("delta")
    res = slimectl_in_process("init", root / "run", "--tiny-model", "qwen2", "--set", "logging.tensorboard=false",
                              "--set", "sync.mode=delta", "--set", "sync.keep_weights=null")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    proc, urls = start_serve(run, "--num-engines", "2")
    try:
        yield run, urls
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def sync(run, *args):
    return slimectl_in_process("sync", "-r", run.path, *args)


def last_bytes(run) -> float:
    return read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"]


def test_five_delta_syncs_by_disk_then_group_are_bit_identical_to_full_weights(served):
    """Versions 1-5 as deltas, xor and overwrite in turn, by disk (1, 2, 5) and over the gloo group (3, 4), both
    engines each time: each sync moves the delta only, and both engines hold weights/N bit for bit."""
    run, urls = served
    for v in range(1, 6):
        encoding = "xor" if v % 2 else "overwrite"
        publish(run, v, seed=v, encoding=encoding)
        header = read_header(run.weights.get(v).path)
        assert header["base_version"] == v - 1 and header["encoding"] == encoding
        full = sum(f.stat().st_size for f in run.weights.get(v).path.glob("*.safetensors"))
        res = sync(run, "--version", str(v), *(["--transport", "distributed"] if v in (3, 4) else []), "--verify")
        assert res.returncode == 0, res.stderr[-2000:]
        moved = last_bytes(run)
        assert 0 < moved <= 2 * header["blob_bytes"] < full / 5  # the delta crossed, not the model
        for u in urls:
            assert_engine_holds(run, u, v)
    # the chain: each delta names its base's digest, the digest of the version before
    assert read_header(run.weights.get(5).path)["base_digest"] == read_header(run.weights.get(4).path)["digest"]


def test_an_engine_off_the_base_gets_full_weights(served):
    """Engine 1 put back on version 2; weights/6's delta (against 5) goes to engine 0 only, engine 1 gets the
    full weights (disk); then the group: not every engine on the base, so a full broadcast to all."""
    run, urls = served
    assert sync(run, "--version", "2", "--engine-url", urls[1]).returncode == 0
    publish(run, 6, seed=6)
    res = sync(run, "--version", "6")
    assert res.returncode == 0, res.stderr[-2000:]
    full = sum(f.stat().st_size for f in run.weights.get(6).path.glob("*.safetensors"))
    assert last_bytes(run) == full + read_header(run.weights.get(6).path)["blob_bytes"]
    for u in urls:
        assert_engine_holds(run, u, 6)
    assert sync(run, "--version", "5", "--engine-url", urls[1]).returncode == 0
    publish(run, 7, seed=7)
    res = sync(run, "--version", "7", "--transport", "distributed")
    assert res.returncode == 0, res.stderr[-2000:]
    assert last_bytes(run) > 1.9 * full  # the tensors, to both engines
    for u in urls:
        assert_engine_holds(run, u, 7)


def error_lines(stderr: str) -> list[str]:
    """stderr's lines less the client's retry notices (a loaded machine may drop a keep-alive connection once:
    ``ServerDisconnectedError ...; retrying in 0.5 s``), which are logs, not the error."""
    return [ln for ln in stderr.strip().splitlines() if not re.search(r"; retrying in [\d.]+ s$", ln)]


def test_out_of_order_and_corrupt_deltas_are_refused_and_the_engine_stays(served, tmp_path):
    """Straight to the engine: a delta against another version is refused ``(base)``; a flipped byte in the
    blob is refused ``(corrupt)``; the engine stays on its version, its weights untouched. Through sync, the
    flipped byte fails loudly (exit 1, one line naming the tensor) and a truncated blob is refused by the run
    directory before any engine is touched (its READY manifest); then the next version converges."""
    import json
    import shutil
    import urllib.error

    run, urls = served
    assert sync(run, "--version", "7").returncode == 0
    publish(run, 8, seed=8)
    publish(run, 9, seed=9)

    def refused(path: str, version: str) -> str:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(urls[0], "/update_weights_from_delta", {"weight_version": version, "delta_path": path})
        assert e.value.code == 400
        return json.loads(e.value.read())["message"]

    msg = refused(str(run.weights.get(9).path), "9")  # engines on 7, the delta applies to 8
    assert "(base)" in msg and "serves weight version 7" in msg
    bad = tmp_path / "bad"
    shutil.copytree(run.weights.get(8).path, bad)
    blob = bytearray((bad / DELTA_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0x40
    (bad / DELTA_FILE).write_bytes(bytes(blob))
    msg = refused(str(bad), "8")
    assert "(corrupt)" in msg and "\n" not in msg
    assert_engine_holds(run, urls[0], 7)

    # through sync: the flipped byte in weights/8 itself (its READY manifest's size still matches)
    (run.weights.get(8).path / DELTA_FILE).write_bytes(bytes(blob))
    res = sync(run, "--version", "8")
    assert res.returncode == 1 and "corrupt" in error_lines(res.stderr)[0] and len(error_lines(res.stderr)) == 1, res.stderr
    for u in urls:
        assert_engine_holds(run, u, 7)
    (run.weights.get(8).path / DELTA_FILE).write_bytes(bytes(blob[:-10]))  # truncated: its manifest says no
    res = sync(run, "--version", "8")  # the run directory's own check (the delta format's: test_weight_delta.py)
    assert res.returncode == 1 and "delta.bin" in res.stderr and "modified after publishing" in res.stderr
    assert len(error_lines(res.stderr)) == 1, res.stderr
    for u in urls:
        assert_engine_holds(run, u, 7)
    # weights/9's delta is against 8, which no engine got: full weights, and they converge
    res = sync(run, "--version", "9", "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    for u in urls:
        assert_engine_holds(run, u, 9)


@pytest.mark.parametrize("fault", ["sync.paused:1", "sync.pushed:1"])
def test_a_sync_killed_around_the_apply_then_rerun_converges(served, tmp_path, stage_forks, fault):
    """`sync` killed (kill -9) with the engines paused before the delta moved, or after both applied it: the
    engines are on the base or the new version, never between, and the rerun leaves them on the new one
    (the delta where they are still on the base, the full weights where they already hold it)."""
    import signal

    run, urls = served
    v = run.weights.ids()[-1]
    assert sync(run, "--version", str(v)).returncode == 0
    publish(run, v + 1, seed=v + 1)
    rc = stage_forks.run(["sync", "-r", run.path, "--version", str(v + 1)], tmp_path / "out", tmp_path / "err",
                         env={"SLIMECTL_FAULT": fault}).wait(timeout=120)
    assert rc == -signal.SIGKILL, (tmp_path / "err").read_text()[-2000:]
    for u in urls:
        with HFCheckpoint(run.weights.get(v if fault.startswith("sync.paused") else v + 1).path) as ckpt:
            name, want = next(iter(ckpt.iter_tensors()))
        assert torch.equal(served_tensors(u, [name])[name], want.float())
    res = sync(run, "--version", str(v + 1), "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    for u in urls:
        assert_engine_holds(run, u, v + 1)
        assert post(u, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})["meta_info"][
            "weight_version"] == str(v + 1)  # continued, generating on the new version


def test_rl_fully_async_over_the_group_sends_deltas_of_its_live_weights(tmp_path):
    """`rl` with rollout.async_mode fully_async (the rollout follower beside train and sync) and the distributed
    transport: the first sync sends full weights, every later one the delta against the copy the trainer kept,
    each verified on the engine (sync.verify); the run ends with every rollout trained."""
    from tests.helpers import write_config

    cfg = write_config(tmp_path, rollout={"num_rollout": 3, "async_mode": "fully_async"},
                       sync={"mode": "delta", "transport": "distributed", "verify": True})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp_path / "run")
    recs = {int(r["sync/weight_version"]): r for r in read_metrics(run.metrics_path("sync"))}
    with HFCheckpoint(run.config().model.path) as ckpt:
        full = sum(t.numel() * t.element_size() for _, t in ckpt.iter_tensors())
    assert sorted(recs) == [0, 1, 2, 3] and recs[0]["sync/bytes"] == full  # the first: every tensor, once
    for v in (1, 2, 3):  # lr 1e-3 in fp32 moves every element: the XOR'd bytes compress to ~0.84x here
        assert 0 < recs[v]["sync/bytes"] < 0.9 * full and recs[v]["sync/verify_time"] > 0, recs[v]
