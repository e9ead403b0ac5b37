"""The real sglang-router 0.3.2 (CPU) in front of engines `slimectl serve` launches (`engine.router: true`).

The router fronts two *embedded* engines here (they speak SGLang's protocol): this needs only the router
package, not an SGLang build, and starts in seconds. Its interpreter: ``$SLIMECTL_ROUTER_PYTHON``, else the
suite's SGLang venv (scripts/sglang_cpu/requirements.txt pins sglang-router). One serve start for the module:
serve starts the router after the engines and waits for both workers in ``GET /workers``; status shows it;
a rollout goes through it; the router does not forward pause (404), so sync updates each engine directly and
the next rollout through the router serves the new version; a dead router makes the pool go to the engines;
serve stops the router and removes its record.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request

import psutil
import pytest

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.conformance.sglang_helpers import publish_weights, stop_serve
from tests.helpers import ARITH, free_port, post, slimectl_in_process, start_serve

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]


@pytest.fixture(scope="module")
def router_python(sglang_python) -> str:
    return os.environ.get("SLIMECTL_ROUTER_PYTHON") or sglang_python


@pytest.fixture(scope="module")
def routed(tmp_path_factory, router_python, figures):
    root = tmp_path_factory.mktemp("conf-router")
    sets = ["logging.tensorboard=false", "engine.router=true", f"engine.router_python={router_python}",
            f"data.prompt_data={ARITH}", "rollout.reward=random", "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_response_len=4", "model.dtype=fp32"]
    res = slimectl_in_process("init", root / "run", "--tiny-model", "llama", *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(root / "run")
    t0 = time.monotonic()
    proc, urls = start_serve(run, "--num-engines", "2")
    figures["serve_2_embedded_plus_router_start_s"] = round(time.monotonic() - t0, 1)
    try:
        yield {"run": run, "urls": urls, "proc": proc}
    finally:
        stop_serve(proc)


def test_serve_starts_records_and_shows_the_router(routed):
    run, urls = routed["run"], routed["urls"]
    (rec,) = run.routers.list()
    assert rec.backend == "sglang-router" and rec.alive() and sorted(rec.extra["workers"]) == sorted(urls)
    assert psutil.Process(rec.pid).name().startswith("sglang")  # sglang-router names its process sglang::router
    assert sorted(r.url for r in run.engines.list()) == sorted(urls)  # the router is no engine: sync skips it
    assert run.live_router(urls) == rec.url and run.live_router(urls[:1]) is None
    with urllib.request.urlopen(rec.url + "/workers", timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    assert sorted(w["url"] for w in workers) == sorted(urls) and all(w["is_healthy"] for w in workers)
    st = json.loads(slimectl_in_process("status", "-r", run.path, "--json").stdout)
    assert [(r["url"], r["health"], sorted(r["workers"])) for r in st["routers"]] == [(rec.url, "ok", sorted(urls))]
    text = slimectl_in_process("status", "-r", run.path).stdout
    assert f"router     {rec.id} {rec.url} [sglang-router]" in text and "routes /generate to 2 engine(s)" in text


def test_rollout_goes_through_the_router_and_sync_goes_to_each_engine(routed):
    run = routed["run"]
    (rec,) = run.routers.list()
    res = slimectl_in_process("rollout", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    samples = read_samples(run.rollouts.get(0).path / SAMPLES_FILE)
    assert samples and {s.metadata["engine_url"] for s in samples} == {rec.url}
    # the router does not forward weight-update/pause/continue calls: they must go to each engine
    with pytest.raises(urllib.error.HTTPError) as e:
        post(rec.url, "/pause_generation", {})
    assert e.value.code == 404
    publish_weights(run, 1, seed=3)
    res = slimectl_in_process("sync", "-r", run.path, "--version", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert {r.weight_version for r in run.engines.list()} == {"1"}
    res = slimectl_in_process("rollout", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    samples = read_samples(run.rollouts.get(1).path / SAMPLES_FILE)
    assert {s.metadata["engine_url"] for s in samples} == {rec.url}
    assert {v for s in samples for v in s.weight_versions} == {"1"}  # generated through the router, new weights


def test_a_dead_router_sends_generate_to_the_engines(routed):
    from slimectl.stages.rollout.generate import EnginePool

    urls = routed["urls"]

    async def go():
        pool = EnginePool(urls, router=f"http://127.0.0.1:{free_port()}")  # nothing listens there
        try:
            out = await pool.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0})
            return out["meta_info"]["engine_url"], pool.router
        finally:
            await pool.close()

    url, router = asyncio.run(go())
    assert url in urls and router is None


def test_serve_stops_the_router_and_removes_its_record(routed):
    run = routed["run"]
    (rec,) = run.routers.list()
    assert stop_serve(routed["proc"]) == 0
    assert run.routers.list() == []
    assert not psutil.pid_exists(rec.pid) or psutil.Process(rec.pid).status() == psutil.STATUS_ZOMBIE
