"""Engines that heal (#48) in every loop mode: an engine ``kill -9``ed in the middle of a rollout under
``rollout.async_mode: one_step_off`` (the rollout generating on its thread while the trainer trains) and
``fully_async`` (the follower generating all the time, weights updated with requests in flight) loses no sample
and duplicates none, and is back on the current weight version by the last sync; and an ``rl`` attached to a separate ``serve``
follows the engines that serve's heartbeat starts again."""

from __future__ import annotations

import asyncio
import re
import signal
import threading

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import post, slimectl_in_process, start_serve, write_config
from tests.integration.test_engine_heal import (FAST, _listener, _wait, assert_rollouts_exact,  # noqa: F401 (group)
                                                group, kill_engine_at_version, rl_with_engine_1_killed)

pytestmark = pytest.mark.xdist_group("engine_heal")


@pytest.mark.slow
def test_one_step_off_loses_no_sample_when_an_engine_is_killed_mid_rollout(tmp_path):
    rl_with_engine_1_killed(tmp_path, "one_step_off")


@pytest.mark.slow
def test_fully_async_loses_no_sample_when_an_engine_is_killed_mid_rollout(tmp_path):
    rl_with_engine_1_killed(tmp_path, "fully_async")


@pytest.mark.slow
def test_distributed_sync_takes_a_restarted_engine_into_a_new_group(tmp_path):
    """``sync.transport: distributed`` with a checkpoint every 2 rollouts: no ``weights/1`` on disk to start engine-1
    again at, so it comes back on the initial weights (version 0) and takes no request of the rollout under way (its
    weights are older than it had); the next sync builds the weight-update group again with it and sends it the
    trainer's weights: the last sync reaches both engines."""
    _, err = rl_with_engine_1_killed(tmp_path, "off", back_at="0", sync={"transport": "distributed"},
                                     train={"lr": 1e-3, "save_interval": 2})
    assert re.search(r"weights/000001 is not on disk; starting engine-1-\S+ at the initial weights \(version 0\)",
                     err), err[-3000:]
    assert re.search(r"engine\(s\) engine-1-\S+ started again or lost since the weight-update group was built; "
                     r"building it again", err), err[-3000:]
    assert "sending it requests again" not in err


@pytest.mark.slow
def test_rl_attached_to_a_serve_follows_its_heal(tmp_path):
    """``serve`` (2 engines, its heartbeat) in one process, ``rl`` attached to it in this one: engine-1 ``kill -9``ed
    once synced to weight version 1. serve starts it again (same id, new pid); rl's rollout retries
    the lost requests on engine-0, a sync that meets the restarting engine waits for its record to come back and
    is made again, and rl exits 0 with every rollout exact and both engines on the last version, read back."""
    from slimectl.orchestration.heal_check import weights_check

    n_rollout, batch, n = 3, 4, 4
    cfg = write_config(tmp_path, rollout={"num_rollout": n_rollout, "batch_size": batch, "n_samples_per_prompt": n,
                                          "max_response_len": 24},
                       engine={"num_engines": 2, "health_check": FAST})
    path = tmp_path / "run"
    assert slimectl_in_process("init", path, "-c", cfg, "--tiny-model", "qwen2").returncode == 0
    run = RunDir.open(path)
    serve_err = tmp_path / "serve.err"
    serve, urls = start_serve(run, "--num-engines", "2", stderr_file=serve_err)
    try:
        first = {r.id: r.pid for r in run.engines.list()}
        killed: list[int] = []
        killer = threading.Thread(target=kill_engine_at_version, args=(path, "engine-1", "1", killed), daemon=True)
        killer.start()
        res = slimectl_in_process("rl", "-r", path)
        killer.join(timeout=5)
        assert res.returncode == 0, res.stderr[-3000:]
        assert killed, "engine-1 was not killed"
        assert_rollouts_exact(run, n_rollout, batch, n)
        back = re.compile(r"engine-1 at \S+ is back at weight version [1-3] \(checked\)")  # (a sync of rl's may
        try:  # (reach it first: checked then)
            _wait("serve's heal of engine-1", lambda: back.search(serve_err.read_text()), timeout=300)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; serve's log ends: {serve_err.read_text()[-3000:]}") from None
        recs = {r.id: r for r in run.engines.list()}
        assert recs.keys() == first.keys()  # the same engines, engine-1 on a new process
        e1 = next(i for i in recs if i.startswith("engine-1-"))
        assert recs[e1].pid != first[e1] and recs[e1].alive()
        check = weights_check(run, run.config())
        for r in recs.values():  # every engine serves the last version, its weights read back against weights/N
            assert post(r.url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
                        )["meta_info"]["weight_version"] == str(n_rollout)
            assert check(r.url, str(n_rollout)) == [], r.id
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


@pytest.mark.slow
def test_the_pool_takes_back_an_engine_the_heartbeat_registered_again(group):
    """One pool across the heal (as ``fully_async``'s follower keeps one): engine-1 ``kill -9``ed with requests in
    flight, they finish on engine-0; once the heartbeat has registered it again the pool sends it requests again;
    with both engines killed, the requests wait for the heal instead of failing. Every request answered once."""
    from slimectl.engines.pool import EnginePool

    run, g, _ = group
    url0, url1 = g.urls

    def healed(url, before):
        return next((r for r in run.engines.list() if r.url == url and r.pid != before and r.alive()), None)

    async def batch(pool, ids, kill=()):
        async def one(i):
            out = await pool.generate(input_ids=[1 + i % 50, 2, 3], rid=f"r{i}",
                                      sampling_params={"max_new_tokens": 16, "temperature": 0})
            return i, out["meta_info"]["engine_url"]

        tasks = [asyncio.ensure_future(one(i)) for i in ids]
        while kill and not all(pool.inflight.get(u, 0) for u in kill):  # each has requests in flight
            await asyncio.sleep(0.001)
        for url in kill:
            _listener(url).kill()
        return await asyncio.gather(*tasks)

    async def go():
        pool = EnginePool(g.urls, registry=run.engines, timeout=60, heal_wait_s=120)
        try:
            pids = {r.url: r.pid for r in run.engines.list()}
            first = await batch(pool, range(0, 40), kill=[url1])
            assert url1 in pool.dead
            await asyncio.to_thread(_wait, "engine-1 registered again", lambda: healed(url1, pids[url1]))
            second = await batch(pool, range(40, 80))
            assert url1 not in pool.dead and url1 in {u for _, u in second}  # taken back
            pids = {r.url: r.pid for r in run.engines.list()}
            third = await batch(pool, range(80, 100), kill=[url0, url1])  # no engine left: wait for the heal
            # asked for the engines' versions with every engine out (both healed, then killed again): waits too
            await asyncio.to_thread(_wait, "both engines registered again",
                                    lambda: all(healed(u, pids[u]) for u in (url0, url1)))
            for url in (url0, url1):
                _listener(url).kill()
            versions = await pool.weight_versions()
            assert versions and set(versions) <= {url0, url1}, versions
            return first + second + third, pids
        finally:
            await pool.close()

    answered, pids = asyncio.run(go())
    assert sorted(i for i, _ in answered) == list(range(100))  # each once
    # the watcher heals one engine at a time: the third batch may be answered by the first engine healed before
    # the other one's loss is found
    _wait("both engines of the third batch found lost", lambda: len(g.watcher.losses) >= 3)
    assert not g.lost and [loss.url for loss in g.watcher.losses][:1] == [url1]
