"""slimectl sync: disk and distributed (gloo) weight handoff to live embedded engines, --verify, failures.

The module's one `slimectl serve` (two embedded engines) is also where serve's own lifecycle is
checked (first test and the fixture's teardown): registration, health, logs, one serve per run dir,
another run registering one of its engines as external, and a clean SIGTERM (exit 0, engines
unregistered, no child left). One serve start for both modules' checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest
import torch

from slimectl.contract.rundir import RunDir
from slimectl.stages.sync.distributed import buckets
from slimectl.stages.sync.verify import compare, pick_names
from tests.helpers import post, publish_weights, slimectl_in_process, start_serve

pytestmark = pytest.mark.xdist_group("sync")  # xdist: one worker, fixtures built once


def greedy(url, ids=(5, 6, 7, 8)):
    """(output ids + their log-probs rounded to 5 digits, weight version): a fingerprint of the weights."""
    out = post(url, "/generate", {"input_ids": list(ids), "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    lps = [round(x[0], 5) for x in out["meta_info"]["output_token_logprobs"]]
    return out["output_ids"] + lps, out["meta_info"]["weight_version"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A run with a tiny qwen2 model and `slimectl serve` with two engines, started on the initial
    model (weight version 0); then weights/1 and weights/2 are published. After the module, SIGTERM
    must stop serve cleanly: exit 0, the engines unregistered, none of its children left running."""

    root = tmp_path_factory.mktemp("sync")
    res = slimectl_in_process("init", root / "run", "--tiny-model", "qwen2", "--set", "logging.tensorboard=false")
    assert res.returncode == 0, res.stderr
    run = RunDir.open(root / "run")
    proc, urls = start_serve(run, "--num-engines", "2")
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        w1, w2 = publish_weights(run, 1, 1), publish_weights(run, 2, 2)
        yield run, urls, {1: w1, 2: w2}, proc, children
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # serve's clean stop (was test_serve.py::test_serve_two_embedded_engines_register_and_clean_up)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert run.engines.list() == []
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_serve_two_embedded_engines_register_and_another_run_uses_one_as_external(served, tmp_path, cli):
    """(Moved from test_serve.py, on this module's serve; its SIGTERM checks are the fixture's teardown.)
    Two embedded engines: registered at weight version 0, healthy, logged, one serve per run dir.
    Engine-0 doubles as another run's external engine: `serve --engine-url` registers it (no pid,
    the engine's weight version), checks its health, and unregisters it on SIGTERM without stopping it."""
    run, urls, _, _, children = served
    assert all(u.startswith("http://127.0.0.1:") for u in urls) and len(set(urls)) == 2
    recs = run.engines.list()
    assert sorted(r.url for r in recs) == sorted(urls)
    assert all(r.backend == "embedded" and r.weight_version == "0" and r.alive() for r in recs)
    assert len(children) >= 2
    st = json.loads(cli("status", "-r", run.path, "--json").output)
    assert [e["health"] for e in st["engines"]] == ["ok", "ok"]
    assert st["running"]["serve"]["stale"] is False
    for i in range(2):
        assert (run.path / "logs" / f"engine-{i}.log").stat().st_size > 0
    second = slimectl_in_process("serve", "-r", run.path)
    assert second.returncode == 1 and "already running" in second.stderr  # one serve per run dir

    other = cli("init", tmp_path / "other", "--set", f"model.path={run.config().model.path}")
    assert other.exit_code == 0
    other_run = RunDir.open(tmp_path / "other")
    ext, ext_urls = start_serve(other_run, "--engine-url", urls[0])
    try:
        (rec,) = other_run.engines.list()
        assert rec.url == urls[0] and rec.backend == "external" and rec.pid is None and rec.weight_version == "0"
    finally:
        ext.send_signal(signal.SIGTERM)
        ext.wait(timeout=30)
    assert other_run.engines.list() == []
    assert sorted(r.url for r in run.engines.list()) == sorted(urls)  # the external engine lives on
    assert greedy(urls[0])[1] == "0"


def test_disk_sync_changes_outputs_and_verifies(served):
    run, urls, *_ = served
    assert slimectl_in_process("sync", "-r", run.path, "--version", "0").returncode == 0
    before = [greedy(u) for u in urls]
    assert {v for _, v in before} == {"0"}
    res = slimectl_in_process("sync", "-r", run.path, "--version", "1", "--verify")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "weight version 1 ->" in res.stdout and "verified" in res.stdout
    after = [greedy(u) for u in urls]
    assert {v for _, v in after} == {"1"}
    assert after[0][0] == after[1][0] != before[0][0]  # the engines' outputs changed, identically
    assert {r.weight_version for r in run.engines.list()} == {"1"}
    from slimectl.contract.metrics import read_metrics

    rec = read_metrics(run.metrics_path("sync"))[-1]
    assert rec["step"] == 1 and rec["sync/time"] > 0 and rec["sync/bytes"] > 0


def test_distributed_sync_matches_disk_sync(served):
    run, urls, weights, *_ = served
    assert slimectl_in_process("sync", "-r", run.path, "--version", "2").returncode == 0
    by_disk = greedy(urls[0])
    assert slimectl_in_process("sync", "-r", run.path, "--version", "0").returncode == 0
    assert greedy(urls[0]) != by_disk
    # tiny buckets: the model crosses in many update_weights_from_distributed calls
    res = slimectl_in_process("sync", "-r", run.path, "--version", "2", "--transport", "distributed", "--verify",
                   "--set", "sync.bucket_size_mb=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(greedy(u) == by_disk for u in urls)  # same tokens as the disk path, version 2
    got = post(urls[1], "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3})
    assert torch.equal(torch.tensor(got), weights[2]["model.norm.weight"][:3])


def test_verify_detects_engines_holding_other_weights(served):
    from slimectl.engines.client import EngineClient
    from slimectl.stages.sync import WeightSource
    from slimectl.stages.sync.verify import verify_engines

    run, urls, *_ = served
    assert slimectl_in_process("sync", "-r", run.path, "--version", "1").returncode == 0

    async def check(version):
        clients = {u: EngineClient(u) for u in urls}
        try:
            return await verify_engines(clients, WeightSource.from_dir(version, run.weights.get(version).path))
        finally:
            for c in clients.values():
                await c.close()

    assert asyncio.run(check(1)) == []
    problems = asyncio.run(check(2))
    assert len(problems) >= 2 and all("differs from weight version 2" in p for p in problems)
    assert {p.split()[1].rstrip(":") for p in problems} == set(urls)


def test_a_dead_engine_is_named_and_the_live_one_is_not_left_paused(served):
    run, urls, *_ = served
    dead = "http://127.0.0.1:9"
    res = slimectl_in_process("sync", "-r", run.path, "--version", "2", "--engine-url", urls[0], "--engine-url", dead,
                   "--set", "sync.timeout_s=5")
    assert res.returncode == 1 and dead in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()[-1]) < 400
    ids, version = greedy(urls[0])  # would hang if the engine were left paused
    assert len(ids) == 24


def test_unpublished_version_and_no_engines(served, tmp_path):
    run, *_ = served
    res = slimectl_in_process("sync", "-r", run.path, "--version", "7")
    assert res.returncode == 2 and "weights/000007 is not published (published versions: 1, 2)" in res.stderr
    other = tmp_path / "other"
    assert slimectl_in_process("init", other, "--tiny-model", "llama").returncode == 0
    res = slimectl_in_process("sync", "-r", other)
    assert res.returncode == 1 and "no live engines registered" in res.stderr


def test_buckets_split_by_size_and_mark_the_last():
    t = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    out = list(buckets(iter(t), bucket_bytes=4 * 25))
    assert [[n for n, _ in b] for b, _ in out] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
    assert [last for _, last in out] == [False, False, False, False, True]
    assert list(buckets(iter([]), 10)) == []
    assert [last for _, last in buckets(iter(t[:1]), 10)] == [True]


def test_verify_compare_and_pick_names():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert compare(x, x.tolist(), "fp32") is None
    assert compare(x, (x + 1e-6).tolist(), "float32") == pytest.approx(1e-6, rel=0.2)
    assert compare(x, x.to(torch.bfloat16).float().tolist(), "bf16") is None  # rounding allowed across dtypes
    assert compare(x, [[1.0, 2.0]], "fp32") == float("inf")
    names = [f"n{i:02d}" for i in range(20)]
    picked = pick_names(names, 5)
    assert picked[0] == "n00" and picked[-1] == "n19" and len(picked) == 5
    assert pick_names(names[:3], 5) == names[:3]
