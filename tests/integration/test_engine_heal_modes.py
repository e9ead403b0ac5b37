"""Engines that heal (#48) in every loop mode: an engine ``kill -9``ed in the middle of a rollout under
``rollout.async_mode: one_step_off`` (the rollout generating on its thread while the trainer trains) and
``fully_async`` (the follower generating all the time, weights updated with requests in flight) loses no sample
and duplicates none, and is back on the current weight version by the last sync; and an ``rl`` attached to a separate ``serve``
follows the engines that serve's heartbeat starts again."""

from __future__ import annotations

import re
import signal
import threading

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import post, slimectl_in_process, start_serve, write_config
from tests.integration.test_engine_heal import (FAST, _wait, assert_rollouts_exact, kill_engine_at_version,
                                                rl_with_engine_1_killed)

pytestmark = pytest.mark.xdist_group("engine_heal")


@pytest.mark.slow
def test_one_step_off_loses_no_sample_when_an_engine_is_killed_mid_rollout(tmp_path):
    rl_with_engine_1_killed(tmp_path, "one_step_off")


@pytest.mark.slow
def test_fully_async_loses_no_sample_when_an_engine_is_killed_mid_rollout(tmp_path):
    rl_with_engine_1_killed(tmp_path, "fully_async")


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
        _wait("serve's heal of engine-1", lambda: back.search(serve_err.read_text()))  # reach it first: checked then)
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
