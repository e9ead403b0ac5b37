"""The heartbeat on a real SGLang engine (#48): the server ``kill -9``ed, the watcher kills what is left of its
process tree (its scheduler and detokenizer processes), starts it again from its launch spec on the same URL at
the weight version its record holds, checks it and registers it again; it then reads back equal to
``weights/N`` and generates what it generated before. Then the same engine hung (its whole process group
``SIGSTOP``ped: alive, never answering): ``/health_generate`` does not answer within the heartbeat's timeout, the
stopped tree is killed (no process of it left, by pid and by process group) and the engine comes back the same way.
One SGLang start and two restarts (the suite's fifth to seventh SGLang starts: ~30-60 s each on an idle 2-core
machine), one engine group (the module's fixture) for both tests."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conformance.sglang_helpers import START_TIMEOUT, greedy, init_sglang_run, publish_weights, sglang_env

pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.slow]

HEARTBEAT_TIMEOUT_S = 20
"""The heartbeat's ``timeout``: far above a ``/health_generate`` of the tiny model on CPU (well under a second on
an idle machine), so a busy machine does not make the engine look hung; the hung test waits for it once."""


def _wait(what, cond, timeout: float):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


@pytest.fixture(scope="module")
def healing(tmp_path_factory, sglang_python, figures):
    """One real SGLang engine at weight version 1, started as ``slimectl serve`` starts it, watched with a fast
    heartbeat: (run, its config, the group)."""
    from slimectl.orchestration.heal_check import weights_check
    from slimectl.stages.serve import EngineProcesses

    with pytest.MonkeyPatch.context() as mp:
        for k, v in sglang_env(sglang_python).items():
            mp.setenv(k, v)
        run = init_sglang_run(tmp_path_factory.mktemp("heal"), "llama", sglang_python,
                              "engine.health_check.first_wait=0", "engine.health_check.interval=0.5",
                              f"engine.health_check.timeout={HEARTBEAT_TIMEOUT_S}")
        publish_weights(run, 1, seed=1)  # the engine starts at the newest weights, version 1
        cfg = run.config()
        t0 = time.monotonic()
        group = EngineProcesses(run, cfg, verify=weights_check(run, cfg)).start()  # what `slimectl serve` starts
        try:
            figures["start_s"] = round(time.monotonic() - t0, 1)
            yield run, cfg, group
        finally:
            group.stop()
    assert run.engines.list() == []


def _server(group) -> tuple[psutil.Process, list[psutil.Process]]:
    """The group's SGLang server process and its whole tree (the server, its scheduler and detokenizer)."""
    server = psutil.Process(group.engines[0].pid)
    assert "sglang.launch_server" in " ".join(server.cmdline())
    tree = [server, *server.children(recursive=True)]
    assert len(tree) >= 3, tree
    return server, tree


def test_a_killed_sglang_server_comes_back_whole_at_its_version(healing, figures):
    from slimectl.orchestration.heal_check import weights_check

    run, cfg, group = healing
    (url,) = group.urls
    ids, logprobs, version = greedy(url, (5, 6, 7, 8))
    assert version == "1"
    server, tree = _server(group)  # the server, its scheduler and its detokenizer
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


def test_a_hung_sglang_server_is_killed_whole_and_comes_back_at_its_version(healing, figures):
    run, cfg, group = healing
    (url,) = group.urls
    ids, _, version = greedy(url, (5, 6, 7, 8))
    server, tree = _server(group)
    pgid = os.getpgid(server.pid)
    assert pgid == server.pid and all(os.getpgid(p.pid) == pgid for p in tree)  # one process group: the tree
    losses = len(group.watcher.losses)
    os.killpg(pgid, signal.SIGSTOP)  # hung: alive, never answering
    t1 = time.monotonic()
    _wait("the tree stopped", lambda: all(p.status() == psutil.STATUS_STOPPED for p in tree), timeout=10)
    loss = _wait("the hung engine's loss", lambda: group.watcher.losses[losses:] and group.watcher.losses[losses],
                 timeout=HEARTBEAT_TIMEOUT_S + 60)
    figures["hung_found_s"] = round(loss.at - t1, 1)
    assert loss.url == url and loss.why == f"GET /health_generate did not answer 200 within {HEARTBEAT_TIMEOUT_S}s " \
                                           f"(hung)", loss
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == [], alive  # every process of the stopped tree, killed
    assert not [p for p in psutil.process_iter() if _pgid(p) == pgid]  # nothing left in its process group
    rec = _wait("the hung engine registered again", lambda: next(
        (r for r in run.engines.list() if r.pid != server.pid), None), timeout=START_TIMEOUT)
    figures["hung_restart_s"] = round(time.monotonic() - t1, 1)
    assert rec.url == url and rec.weight_version == version and group.lost == {}
    assert os.getpgid(rec.pid) != pgid and "sglang.launch_server" in " ".join(psutil.Process(rec.pid).cmdline())
    ids2, _, version2 = greedy(url, (5, 6, 7, 8))
    assert (ids2, version2) == (ids, version)  # it answers /generate, at its recorded version
    group.check_alive()


def _pgid(p: psutil.Process) -> int | None:
    """The process group of a live process (None once it is gone, or a zombie waiting to be reaped)."""
    try:
        return None if p.status() == psutil.STATUS_ZOMBIE else os.getpgid(p.pid)
    except (OSError, psutil.Error):  # gone meanwhile
        return None
