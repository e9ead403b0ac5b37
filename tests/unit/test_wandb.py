"""logging.wandb: metrics go to W&B (offline by default, under the run) with TensorBoard's names."""

from __future__ import annotations

import sys

import pytest

from slimectl.contract import metrics
from slimectl.contract.metrics import WANDB_MISSING, MetricsWriter, WandbSink, configure_wandb, read_metrics, sink_for
from slimectl.stages.init import init_run
from tests.helpers import slimectl_in_process


@pytest.fixture(autouse=True)
def no_sinks_left():
    yield
    metrics.set_sink_factory(None)


def test_offline_wandb_gets_every_metric_under_the_tensorboard_names(tmp_path, fake_model, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    res = init_run(tmp_path / "run", overrides=[f"model.path={fake_model}", "logging.wandb=true", "name=demo"])
    run, cfg = res.run, res.config
    assert cfg.logging.wandb_mode == "offline" and cfg.logging.wandb_dir == "wandb"
    assert configure_wandb(cfg, run.path)
    for step in (0, 1):  # a stage that opens a writer per step (rollout) still logs into one W&B run
        with MetricsWriter(run.metrics_path("rollout"), None) as m:
            m.log(step, {"rollout/reward_mean": 0.5 + step, "perf/rollout_time": 2.0, "rollout/note": "text"})
    sink = sink_for("rollout")
    assert isinstance(sink, WandbSink) and sink.run.name == "demo-rollout" and sink.run.group == "demo"
    jsonl_names = {k for r in read_metrics(run.metrics_path("rollout")) for k in r} - {"step", "time", "rollout/note"}
    logged = {k for k in sink.run.summary.keys() if not k.startswith("_")}
    assert logged == jsonl_names == {"rollout/reward_mean", "perf/rollout_time"}
    assert sink.run.summary["rollout/reward_mean"] == 1.5 and sink.run.summary["_step"] == 1
    metrics.set_sink_factory(None)  # finishes the W&B run
    assert sink.run._is_finished
    assert len(list((run.path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1  # offline, under the run


def test_wandb_on_without_wandb_installed_is_one_warning_and_metrics_still_flow(tmp_path, fake_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={fake_model}", "--set", "logging.wandb=true")
    assert res.returncode == 0
    assert res.stderr.count(WANDB_MISSING) == 1, res.stderr
    run = init_run(tmp_path / "run", overrides=[f"model.path={fake_model}", "logging.wandb=true"]).run
    assert not configure_wandb(run.config(), run.path)
    with MetricsWriter(run.metrics_path("train"), None) as m:
        m.log(0, {"train/loss": 1.0})
    assert read_metrics(run.metrics_path("train"))[0]["train/loss"] == 1.0


def test_stages_switch_the_sink_from_their_config(cli, run_dir, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cli("train", "-r", run_dir.path, "--set", "logging.wandb=true")  # stops at "not published", after configuring
    assert metrics._factory is not None
    cli("train", "-r", run_dir.path)
    assert metrics._factory is None
