"""slimectl serve: embedded engines as supervised children, registered in the run dir, torn down on SIGTERM.

Two engines started, registered, healthy, logged, one serve per run dir, another run's serve using one
of them as an external engine, and the clean SIGTERM: test_sync.py checks these on the serve its sync
tests use (one serve start for both). Here: the failures and the SGLang backend's flags.
"""

from __future__ import annotations

import pytest

from slimectl.contract.rundir import RunDir
from tests.helpers import slimectl_in_process


@pytest.fixture
def tiny_run(tmp_path, cli):
    res = cli("init", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.exit_code == 0, res.output
    return RunDir.open(tmp_path / "run")


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
    from slimectl.stages.serve import EngineProcesses

    data = run_dir.config().to_dict()
    data["engine"].update(backend="sglang", tp_size=2, gpu_ids=[0, 1, 2, 3], sglang_args={"context_length": 4096})
    group = EngineProcesses(run_dir, build_config(data))
    argv, env, secrets = group._launch_argv(1, 30001)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--port") + 1] == "30001"
    assert argv[argv.index("--context-length") + 1] == "4096" and argv[argv.index("--weight-version") + 1] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and secrets == []
