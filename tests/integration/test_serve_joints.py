"""Where serve meets the other stages: it starts engines on the newest published weights, and it
never takes a server it did not start (a port already in use) for its own engine."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import urllib.request

import pytest
import torch

from slimectl.contract.rundir import RunDir
from tests.helpers import post, slimectl_in_process, start_engine, start_serve, wait_healthy, write_config

pytestmark = pytest.mark.xdist_group("serve_joints")  # xdist: one worker, fixtures built once

PROBE = "model.layers.0.self_attn.q_proj.weight"  # a tensor training changes


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def _tensor(model_dir, name: str) -> torch.Tensor:
    from slimectl.backends.hf.checkpoint import HFCheckpoint

    with HFCheckpoint(str(model_dir)) as ckpt:
        return ckpt.get(name).to(torch.float32)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> RunDir:
    """A real run after one rl step: weights/000001 published by train, the engines stopped."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = write_config(tmp, rollout={"num_rollout": 1})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    run = RunDir.open(tmp / "run")
    assert run.weights.ids()[-1] == 1
    return run


@pytest.fixture(scope="module")
def other_engine(trained_run, tmp_path_factory):
    """Another embedded engine (as if another run's), listening on a port serve will be asked for."""
    log = tmp_path_factory.mktemp("other") / "engine.log"
    proc, url = start_engine(trained_run.config().model.path, log, own_process=True)  # its pid listens
    try:
        wait_healthy(url)
        yield proc, url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------------- newest published weights
def test_serve_starts_engines_on_the_newest_published_weights(trained_run):
    run = trained_run
    w1 = run.weights.get(1).path
    proc, (url,) = start_serve(run)
    try:
        (rec,) = run.engines.list()
        assert rec.weight_version == "1"  # was "0": rollout --next then generated on stale weights
        assert _get(url, "/get_model_info")["weight_version"] == "1"
        served = torch.tensor(post(url, "/get_weights_by_name", {"name": PROBE, "truncate_size": 4}))
        assert torch.equal(served, _tensor(w1, PROBE)[:4])  # the engine holds weights/1's tensors
        assert not torch.equal(served, _tensor(run.config().model.path, PROBE)[:4])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    assert "serving weights/000001 (weight version 1)" in (run.path / "logs" / "serve.log").read_text()


def test_serve_weight_choice_initial_or_given_version(trained_run):
    from slimectl.stages.serve import EngineProcesses

    run, cfg = trained_run, trained_run.config()
    w1 = str(run.weights.get(1).path)
    assert EngineProcesses(run, cfg)._resolve_weights() == (w1, "1")
    assert EngineProcesses(run, cfg, weight_version=1)._resolve_weights() == (w1, "1")
    assert EngineProcesses(run, cfg, weight_version="initial")._resolve_weights() == (cfg.model.path, "0")
    if not run.weights.exists(0):  # version 0 is the initial model unless weights/0 was published
        assert EngineProcesses(run, cfg, weight_version=0)._resolve_weights() == (cfg.model.path, "0")
    missing = slimectl_in_process("serve", "-r", run.path, "--weight-version", "7")
    assert missing.returncode == 2
    assert "weights/000007 is not published" in missing.stderr and "published versions: " in missing.stderr
    both = slimectl_in_process("serve", "-r", run.path, "--weight-version", "1", "--initial")
    assert both.returncode == 2 and "pass one of them" in both.stderr
    assert run.engines.list() == []


# ---------------------------------------------------------------------- port already in use
def _assert_refused_port(run: RunDir, port: int) -> None:
    logs = run.path / "logs"
    before = {p.name: p.stat().st_size for p in logs.glob("engine-*.log")}
    res = slimectl_in_process("serve", "-r", run.path, "--port", port)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert errors == [f"Error: port {port} on 127.0.0.1 is already in use (another engine or program listens there); "
                      f"pick a free port with --port, or omit --port (--port 0) to let serve choose free ports"]
    assert "healthy after" not in res.stderr and " ready at " not in res.stderr and not res.stdout  # nothing probed
    assert {p.name: p.stat().st_size for p in logs.glob("engine-*.log")} == before  # nothing was launched
    assert run.engines.list() == []


def test_serve_refuses_a_port_a_plain_listener_holds(trained_run):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        _assert_refused_port(trained_run, s.getsockname()[1])


def test_serve_refuses_a_port_another_engine_holds(trained_run, other_engine):
    _, url = other_engine
    _assert_refused_port(trained_run, int(url.rsplit(":", 1)[1]))


def test_health_wait_never_takes_a_foreign_engine_for_ours(trained_run, other_engine, tmp_path):
    """The race after the port check: our engine is launched on a port another engine holds; the
    health probe reaches the other engine, which must not be accepted as ours."""
    from slimectl.engines.supervisor import ENGINE_NONCE_ENV, LaunchError, ProcessSupervisor

    other, url = other_engine
    port = url.rsplit(":", 1)[1]
    model = trained_run.config().model.path
    with ProcessSupervisor() as sup:
        # the embedded engine, given a nonce: the other engine does not report it
        argv = [sys.executable, "-m", "slimectl.engines.embedded.server", "--model-path", model, "--port", port]
        sup.start("engine-0", argv, env={**os.environ, ENGINE_NONCE_ENV: "ours"}, url=url,
                  log_path=tmp_path / "engine-0.log", nonce="ours")
        with pytest.raises(LaunchError, match=r"answered by another server.*it reports no instance nonce"):
            sup.wait_all_healthy([url], timeout=60, interval=0.2)
        sup.stop(names=["engine-0"])
        # a server that cannot report a nonce (real SGLang): ours must be the process listening
        sup.start("engine-1", [sys.executable, "-c", "import time; time.sleep(60)"], url=url,
                  log_path=tmp_path / "engine-1.log")
        with pytest.raises(LaunchError, match=rf"answered by another server.*pid {other.pid} listens there"):
            sup.wait_all_healthy([url], timeout=60, interval=0.2)


def test_each_embedded_engine_binds_a_port_the_system_picks(trained_run, monkeypatch):
    """Without engine.port, serve used to probe a port free and hand it to the engine, which bound it seconds
    later: whatever took the port in between (another serve's engine, an outgoing connection's ephemeral
    port) made the engine exit. The engine now binds port 0 and reports the system's pick (--port-file);
    here the probe is made to return a port another socket holds, and no engine goes near it."""
    from slimectl.contract.config import build_config
    from slimectl.stages import serve as serve_mod

    data = trained_run.config().to_dict()
    data["engine"].update(num_engines=2, port=0)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(serve_mod, "free_port", lambda host="127.0.0.1": taken)
        with serve_mod.EngineProcesses(trained_run, build_config(data)) as group:
            ports = [int(u.rsplit(":", 1)[1]) for u in group.urls]
            assert len(set(ports)) == 2 and taken not in ports
            assert sorted(r.url for r in trained_run.engines.list()) == sorted(group.urls)
            for url in group.urls:
                assert _get(url, "/get_model_info")["weight_version"] == "1"
            for p in group.supervisor.processes:  # the argv each engine was started with
                assert p.argv_display[p.argv_display.index("--port") + 1] == "0" and "--port-file" in p.argv_display
    assert trained_run.engines.list() == []


def test_an_engine_that_exits_before_binding_its_port_is_named_with_its_log(tmp_path):
    from slimectl.engines.supervisor import ExitedBeforeHealthy, ProcessSupervisor

    with ProcessSupervisor() as sup:
        p = sup.start("engine-0", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"],
                      log_path=tmp_path / "engine-0.log")
        with pytest.raises(ExitedBeforeHealthy, match=r"engine-0 exited \(exit code 3\) before it bound a port; "
                                                      r"log: .*engine-0.log; last lines: .*no model here"):
            sup.wait_port_file(p, tmp_path / "port", timeout=60)
        p = sup.start("engine-1", [sys.executable, "-c", f"open({str(tmp_path / 'p1')!r}, 'w').write('4321\\n'); "
                                   "import time; time.sleep(60)"], log_path=tmp_path / "engine-1.log")
        assert sup.wait_port_file(p, tmp_path / "p1", timeout=60) == 4321
