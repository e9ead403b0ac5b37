"""slimectl serve: embedded engines as supervised children, registered in the run dir, torn down on SIGTERM."""

from __future__ import annotations

import json
import signal

import psutil
import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import slimectl_in_process, start_serve


@pytest.fixture
def tiny_run(tmp_path, cli):
    res = cli("init", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.exit_code == 0, res.output
    return RunDir.open(tmp_path / "run")


def test_serve_two_embedded_engines_register_and_clean_up(tiny_run, cli):
    proc, urls = start_serve(tiny_run, "--num-engines", "2")
    try:
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and len(set(urls)) == 2
        recs = tiny_run.engines.list()
        assert sorted(r.url for r in recs) == sorted(urls)
        assert all(r.backend == "embedded" and r.weight_version == "0" and r.alive() for r in recs)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        st = json.loads(cli("status", "-r", tiny_run.path, "--json").output)
        assert [e["health"] for e in st["engines"]] == ["ok", "ok"]
        assert st["running"]["serve"]["stale"] is False
        for i in range(2):
            assert (tiny_run.path / "logs" / f"engine-{i}.log").stat().st_size > 0
        second = slimectl_in_process("serve", "-r", tiny_run.path)
        assert second.returncode == 1 and "already running" in second.stderr  # one serve per run dir
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    assert tiny_run.engines.list() == []
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_serve_registers_external_engines_and_checks_their_health(tiny_run, tmp_path, cli):
    proc, urls = start_serve(tiny_run)
    try:
        other = cli("init", tmp_path / "other", "--set", f"model.path={tiny_run.config().model.path}")
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
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_serve_fails_cleanly_on_a_dead_external_engine(tiny_run):
    res = slimectl_in_process("serve", "-r", tiny_run.path, "--engine-url", "http://127.0.0.1:9",
                              "--set", "engine.startup_timeout_s=2")
    assert res.returncode == 1 and "http://127.0.0.1:9" in res.stderr and "Traceback" not in res.stderr
    assert tiny_run.engines.list() == []


def test_serve_refuses_a_missing_model(tmp_path, cli, fake_model):
    cli("init", tmp_path / "r", "--set", f"model.path={fake_model}")
    res = slimectl_in_process("serve", "-r", tmp_path / "r", "--set", "engine.startup_timeout_s=30")
    assert res.returncode == 1 and "engine-0" in res.stderr and "engine-0.log" in res.stderr
    assert RunDir.open(tmp_path / "r").engines.list() == []


def test_sglang_passthrough_flags_reach_the_config(cli, run_dir):
    import yaml

    res = cli("serve", "-r", run_dir.path, "--backend", "sglang", "--sglang-context-length", "4096",
              "--sglang-enable-dp-attention", "--sglang-python", "/opt/sg/bin/python", "--dry-run")
    assert res.exit_code == 0, res.output
    eng = yaml.safe_load(res.output)["engine"]
    assert eng["backend"] == "sglang" and eng["sglang_python"] == "/opt/sg/bin/python"
    assert eng["sglang_args"] == {"context_length": 4096, "enable_dp_attention": True}
    bad = cli("serve", "-r", run_dir.path, "--bogus", "--dry-run")
    assert bad.exit_code == 2 and "--bogus" in bad.output


def test_sglang_backend_argv_from_the_run_config(run_dir):
    from slimectl.contract.config import build_config
    from slimectl.stages.serve import EngineGroup

    data = run_dir.config().to_dict()
    data["engine"].update(backend="sglang", tp_size=2, gpu_ids=[0, 1, 2, 3], sglang_args={"context_length": 4096})
    group = EngineGroup(run_dir, build_config(data))
    argv, env, secrets = group._launch_argv(1, 30001)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--port") + 1] == "30001"
    assert argv[argv.index("--context-length") + 1] == "4096" and argv[argv.index("--weight-version") + 1] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and secrets == []
