"""The heartbeat on a real SGLang engine (#48): the server ``kill -9``ed, the watcher kills what is left of its
process tree (its scheduler and detokenizer processes), starts it again from its launch spec on the same URL at
the weight version its record holds, checks it and registers it again; it then reads back equal to
``weights/N`` and generates what it generated before. One SGLang start and one restart (the suite's fifth and
sixth SGLang starts: ~30-60 s each on an idle 2-core machine)."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.conformance.sglang_helpers import START_TIMEOUT, greedy, init_sglang_run, publish_weights, sglang_env

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]


def _wait(what, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def test_a_killed_sglang_server_comes_back_whole_at_its_version(tmp_path, sglang_python, monkeypatch, figures):
    from slimectl.orchestration.heal_check import weights_check
    from slimectl.stages.serve import EngineProcesses

    for k, v in sglang_env(sglang_python).items():
        monkeypatch.setenv(k, v)
    run = init_sglang_run(tmp_path, "llama", sglang_python, "engine.health_check.first_wait=0",
                          "engine.health_check.interval=0.5", "engine.health_check.timeout=60")
    publish_weights(run, 1, seed=1)  # the engine starts at the newest weights, version 1
    cfg = run.config()
    t0 = time.monotonic()
    group = EngineProcesses(run, cfg, verify=weights_check(run, cfg)).start()  # what `slimectl serve` starts
    try:
        figures["start_s"] = round(time.monotonic() - t0, 1)
        (url,) = group.urls
        ids, logprobs, version = greedy(url, (5, 6, 7, 8))
        assert version == "1"
        server = psutil.Process(group.engines[0].pid)
        assert "sglang.launch_server" in " ".join(server.cmdline())
        tree = [server, *server.children(recursive=True)]
        assert len(tree) >= 3, tree  # the server, its scheduler and its detokenizer
        server.kill()
        t1 = time.monotonic()
        loss = _wait("the loss", lambda: group.watcher.losses and group.watcher.losses[0], timeout=60)
        assert loss.url == url and loss.why == "its process exited (signal 9)", loss
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert alive == [], alive  # the whole tree, not only the server
        rec = _wait("the engine registered again", lambda: next(
            (r for r in run.engines.list() if r.pid != server.pid), None), timeout=START_TIMEOUT)
        figures["restart_s"] = round(time.monotonic() - t1, 1)
        assert rec.url == url and rec.weight_version == "1" and group.lost == {}
        assert "sglang.launch_server" in " ".join(psutil.Process(rec.pid).cmdline())
        assert weights_check(run, cfg)(url, "1") == []  # read back equal to weights/1
        ids2, logprobs2, version2 = greedy(url, (5, 6, 7, 8))
        assert (ids2, version2) == (ids, "1")
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) <= 1e-4, (logprobs, logprobs2)
        group.check_alive()
    finally:
        group.stop()
    assert run.engines.list() == []
