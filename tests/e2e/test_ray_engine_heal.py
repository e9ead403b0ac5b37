"""The heartbeat on the Ray launcher's engines (#48): ``rl --launcher ray`` watches its engine actors from the
driver; an engine ``kill -9``ed mid-rollout is healed by a new actor in its bundle, on its URL, at the weight
version it was on (weights checked), and the run loses no sample and trains each rollout once."""

from __future__ import annotations

import re
import threading

import psutil
import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import read_jsonl, write_config
from tests.integration.test_engine_heal import FAST, assert_rollouts_exact, kill_engine_1_at_rollout_1

pytestmark = pytest.mark.xdist_group("ray")  # one Ray instance at a time on a worker


@pytest.mark.slow
def test_rl_on_ray_heals_an_engine_killed_mid_rollout(tmp_path, stage_forks):
    n_rollout, batch, n = 3, 4, 4
    cfg = write_config(tmp_path, rollout={"num_rollout": n_rollout, "batch_size": batch, "n_samples_per_prompt": n,
                                          "max_response_len": 24},
                       engine={"num_engines": 2, "health_check": FAST})
    path = tmp_path / "run"
    killed: dict = {}
    killer = threading.Thread(target=kill_engine_1_at_rollout_1, args=(path, killed), daemon=True)
    killer.start()
    res = stage_forks.slimectl("rl", "-c", cfg, "-r", path, "--tiny-model", "qwen2", "--launcher", "ray",
                               out_dir=tmp_path, timeout=400)
    killer.join(timeout=5)
    err = res.stderr
    assert res.returncode == 0, err[-4000:]
    assert killed, "engine-1 was not killed"
    url = re.escape(killed["url"])
    assert re.search(rf"engine-1 at {url} is lost: (its process exited|GET /health_generate did not answer)"
                     rf".*killing its Ray actor", err), err[-3000:]
    back = re.search(rf"engine-1 at {url} is back at weight version 1 \(checked\) in actor \S+ \(pid (\d+)\)", err)
    assert back, err[-3000:]
    assert int(back.group(1)) != killed["extra"]["actor_pid"]  # a new actor, on the same URL
    assert not psutil.pid_exists(killed["extra"]["actor_pid"]) or \
        psutil.Process(killed["extra"]["actor_pid"]).status() == psutil.STATUS_ZOMBIE  # the old actor was killed
    run = RunDir.open(path)
    assert_rollouts_exact(run, n_rollout, batch, n)
    assert run.cursor("train").read().consumed == list(range(n_rollout))
    syncs = [(int(r["sync/weight_version"]), int(r["sync/num_engines"])) for r in read_jsonl(run.metrics_path("sync"))]
    assert syncs[-1] == (n_rollout, 2)  # the last sync reached both engines, the healed one among them
    assert run.engines.list() == []
