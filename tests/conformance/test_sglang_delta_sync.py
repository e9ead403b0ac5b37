"""sync.mode delta with real SGLang (#47): SGLang cannot apply a delta, so the sync keeps a host-local copy of the
run's weights, applies each delta to it and has SGLang load the copy (``/update_weights_from_disk``): only the
delta is read from the run directory (slime's --update-weight-local-checkpoint-dir).

One `serve` of one SGLang engine (tiny Llama, fp32: its /get_weights_by_name reads every tensor back exactly;
SGLang's Qwen2 has none). weights/1 makes the copy from the full weights; weights/2-6 are five delta syncs, xor
and overwrite in turn, each with weights/N's safetensors zeroed while `slimectl sync` runs (so a read of them would
load garbage), then put back: after each, every tensor SGLang serves equals weights/N bit for bit, and the sync
read the delta's bytes only.
"""

from __future__ import annotations

import time

import pytest
import torch

from slimectl.backends.hf.checkpoint import HFCheckpoint
from slimectl.backends.hf.weight_delta import DELTA_META, read_header
from slimectl.contract.metrics import read_metrics
from tests.conformance.sglang_helpers import init_sglang_run, start_sglang_serve, stop_serve
from tests.helpers import slimectl_in_process
from tests.integration.test_delta_local_copy import full_bytes, safetensors_zeroed
from tests.integration.test_delta_sync import publish, served_tensors

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory, sglang_python, figures):
    root = tmp_path_factory.mktemp("conf-delta")
    run = init_sglang_run(root, "llama", sglang_python, "sync.mode=delta", "sync.keep_weights=null",
                          f"sync.local_copy_dir={root / 'copies'}")
    t0 = time.monotonic()
    proc, urls = start_sglang_serve(run, "--num-engines", "1", "--initial")
    figures["serve_1_engine_start_s"] = round(time.monotonic() - t0, 1)
    try:
        yield run, urls[0], root / "copies"
    finally:
        stop_serve(proc)


def assert_sglang_holds(run, url: str, version: int) -> None:
    with HFCheckpoint(run.weights.get(version).path) as ckpt:
        want = dict(ckpt.iter_tensors())
    got = served_tensors(url, want)
    bad = [n for n in want if not torch.equal(got[n], want[n].float())]
    assert not bad, f"SGLang differs from weights/{version} in {bad[:3]} ({len(bad)} of {len(want)} tensors)"


def test_five_delta_syncs_through_the_local_copy_leave_sglang_bit_identical(served, figures):
    run, url, copies = served
    publish(run, 1, seed=1)
    res = slimectl_in_process("sync", "-r", run.path, "--version", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_metrics(run.metrics_path("sync"))[-1]["sync/bytes"] > full_bytes(run.weights.get(1).path)
    assert_sglang_holds(run, url, 1)
    moved, seconds = [], []
    for v in range(2, 7):
        encoding = "xor" if v % 2 else "overwrite"
        publish(run, v, seed=v, encoding=encoding)
        d = run.weights.get(v).path
        header = read_header(d)
        assert (header["base_version"], header["encoding"]) == (v - 1, encoding)
        with safetensors_zeroed(d):  # only the delta can be read: a read of the safetensors would load zeros
            res = slimectl_in_process("sync", "-r", run.path, "--version", str(v))
        assert res.returncode == 0, res.stderr[-3000:]
        last = read_metrics(run.metrics_path("sync"))[-1]
        assert last["sync/bytes"] == header["blob_bytes"] + (d / DELTA_META).stat().st_size < full_bytes(d) / 5
        moved.append(int(last["sync/bytes"]))
        seconds.append(round(last["sync/time"], 2))
        assert_sglang_holds(run, url, v)
        assert {r.weight_version for r in run.engines.list()} == {str(v)}
        assert [p.name for p in next(copies.iterdir()).iterdir()] == [f"v{v:06d}"]  # the run's last copy only
    figures["delta_sync_bytes"] = moved
    figures["full_bytes"] = full_bytes(run.weights.get(6).path)
    figures["delta_sync_s"] = seconds
