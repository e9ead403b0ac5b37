"""`engine.router`: what is refused, in one line naming the key and the fix, before any engine starts.

(The real sglang-router in front of engines: tests/conformance/test_sglang_serve.py.)
"""

from __future__ import annotations

import sys

from tests.helpers import slimectl_in_process


def test_router_is_refused_for_external_engines(tmp_path, fake_model):
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={fake_model}",
                              "--set", "engine.backend=external", "--set", "engine.router=true")
    assert res.returncode == 2
    assert "engine.router starts sglang-router in front of the engines serve launches, not external" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_serve_refuses_a_router_interpreter_without_sglang_router(run_dir):
    res = slimectl_in_process("serve", "-r", run_dir.path, "--set", "engine.router=true",
                              "--set", f"engine.router_python={sys.executable}")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert f"engine.router is true but engine.router_python = {sys.executable} cannot run sglang-router: " \
           f"sglang_router is not installed for {sys.executable}; install it there" in line
    assert run_dir.engines.list() == [] and run_dir.routers.list() == []  # refused before any engine started
    missing = slimectl_in_process("serve", "-r", run_dir.path, "--set", "engine.router=true",
                                  "--set", "engine.router_python=/nonexistent/python")
    assert missing.returncode == 2 and "/nonexistent/python does not exist" in missing.stderr


def test_serve_refuses_a_router_in_front_of_engine_urls(run_dir):
    res = slimectl_in_process("serve", "-r", run_dir.path, "--set", "engine.router=true",
                              "--engine-url", "http://127.0.0.1:9")
    assert res.returncode == 2, res.stderr
    assert "engine.router starts sglang-router in front of the engines serve launches, not external ones" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_engine_group_refuses_a_router_in_front_of_external_engines(run_dir):
    from slimectl.contract.errors import UsageError
    from slimectl.stages.serve import EngineProcesses

    cfg = run_dir.config().model_copy(deep=True)
    cfg.engine.router = True  # set after validation: a library caller passing URLs of its own
    try:
        EngineProcesses(run_dir, cfg, ["http://127.0.0.1:9"]).start()
    except UsageError as exc:
        assert "not external ones (--engine-url): drop --engine-url, or set engine.router: false" in str(exc)
    else:
        raise AssertionError("EngineProcesses started external engines behind a router")


def test_rl_stops_a_router_that_a_killed_serve_left_running(run_dir):
    """kill -9 of serve/rl leaves its sglang-router running (no parent-death signal): the next rl
    that starts its own engines stops it and removes its record, as it does for engines."""
    import subprocess
    import sys

    from slimectl.contract.rundir.registry import EngineRecord
    from slimectl.orchestration.local_launcher import _kill_orphan_engines

    run = run_dir
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        rec = run.routers.register(EngineRecord(url="http://127.0.0.1:9", backend="sglang-router", pid=orphan.pid,
                                                id="router-x", extra={"workers": []}))
        assert rec.alive()
        _kill_orphan_engines(run)
        assert orphan.wait(timeout=20) is not None and run.routers.list() == []
    finally:
        orphan.kill()
