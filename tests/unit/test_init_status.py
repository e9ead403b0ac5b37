"""slimectl init + status on a tiny config, through the CLI."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from slimectl.contract.rundir import EngineRecord, RunDir


def test_init_freezes_resolved_config_with_absolute_paths(cli, tmp_path, fake_model, monkeypatch):
    cfg_dir = tmp_path / "cfgs"
    cfg_dir.mkdir()
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n')
    (cfg_dir / "c.yaml").write_text("name: demo\nmodel:\n  path: ../model\ndata:\n  prompt_data: ../prompts.jsonl@[0:1]\n")
    monkeypatch.chdir(tmp_path)
    res = cli("init", "runs/a", "--config", cfg_dir / "c.yaml", "--set", "train.lr=5e-6")
    assert res.exit_code == 0, res.output
    run = RunDir.open(tmp_path / "runs" / "a")
    assert res.output.strip().splitlines()[-1] == str(run.path)
    cfg = run.config()
    assert cfg.model.path == str(fake_model.resolve())
    assert cfg.data.prompt_data == f"{data.resolve()}@[0:1]"
    assert cfg.train.lr == pytest.approx(5e-6)
    frozen = yaml.safe_load((run.path / "config.yaml").read_text())
    assert frozen["train"]["lr"] == pytest.approx(5e-6) and frozen["name"] == "demo"
    info = json.loads((run.path / "run.json").read_text())
    assert info["contract_version"] == 1 and info["config_fingerprint"] == cfg.fingerprint()


def test_init_is_idempotent_and_refuses_a_different_config(cli, tmp_path, fake_model):
    args = ("init", tmp_path / "r", "--set", f"model.path={fake_model}")
    assert cli(*args).exit_code == 0
    assert cli(*args).exit_code == 0
    res = cli(*args, "--set", "train.lr=1")
    assert res.exit_code == 2 and "different config (changed: train.lr)" in res.output
    assert cli(*args, "--set", "train.lr=1", "--force").exit_code == 0
    assert RunDir.open(tmp_path / "r").config().train.lr == 1


def test_force_never_replaces_the_config_of_a_run_with_artifacts(cli, run_dir):
    with run_dir.rollouts.publish(0) as d:
        (d / "x").write_text("1")
    model = run_dir.config().model.path
    res = cli("init", run_dir.path, "--set", f"model.path={model}", "--set", "train.lr=1", "--force")
    assert res.exit_code == 2 and "already has artifacts (1 rollouts)" in res.output


@pytest.mark.parametrize(
    "args, exit_code, needle",
    [
        (("--set", "model.path=/definitely/missing"), 2, "model.path = /definitely/missing: no such directory"),
        ((), 2, "model.path is not set"),
        (("--set", "train.lr=abc"), 2, "train.lr = \"abc\""),
    ],
)
def test_init_bad_input(cli, tmp_path, args, exit_code, needle):
    res = cli("init", tmp_path / "r", *args)
    assert res.exit_code == exit_code, res.output
    assert needle in res.output
    assert not (tmp_path / "r" / "run.json").exists()


def test_init_refuses_a_foreign_non_empty_directory(cli, tmp_path, fake_model):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("precious")
    res = cli("init", d, "--set", f"model.path={fake_model}")
    assert res.exit_code == 2 and "not a slimectl run directory" in res.output
    assert (d / "thesis.tex").read_text() == "precious" and not (d / "run.json").exists()


def test_init_dry_run_writes_nothing(cli, tmp_path, fake_model):
    res = cli("init", tmp_path / "r", "--set", f"model.path={fake_model}", "--dry-run")
    assert res.exit_code == 0
    assert yaml.safe_load(res.output)["model"]["path"] == str(fake_model)
    assert not (tmp_path / "r").exists()


def test_run_dir_version_is_checked(cli, run_dir):
    info = json.loads((run_dir.path / "run.json").read_text())
    info["contract_version"] = 99
    (run_dir.path / "run.json").write_text(json.dumps(info))
    res = cli("status", "-r", run_dir.path)
    assert res.exit_code == 1 and "contract v99" in res.output and "upgrade slimectl" in res.output


def test_hand_edited_config_is_detected(cli, run_dir):
    p = run_dir.path / "config.yaml"
    p.write_text(p.read_text().replace("lr: 1.0e-06", "lr: 0.5"))
    res = cli("status", "-r", run_dir.path, "--no-probe")
    assert res.exit_code == 0  # status still shows the run...
    assert "edited by hand" in res.output  # ...and says what is wrong with it
    res = cli("train", "-r", run_dir.path, "--dry-run")
    assert res.exit_code == 2 and "edited by hand" in res.output


def test_a_run_made_before_a_config_key_was_added_still_opens(cli, run_dir):
    """A newer slimectl adds keys with defaults: the run's frozen file lacks them, and that is not an edit."""
    import hashlib

    p = run_dir.path / "config.yaml"
    data = yaml.safe_load(p.read_text())
    del data["logging"]["wandb"], data["algorithm"]["use_unbiased_kl"]  # as an older slimectl wrote it
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    info = json.loads((run_dir.path / "run.json").read_text())
    info["config_fingerprint"] = hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (run_dir.path / "run.json").write_text(json.dumps(info))
    cfg = RunDir.open(run_dir.path).config()
    assert cfg.logging.wandb is False and cfg.algorithm.use_unbiased_kl is False  # today's defaults filled in
    res = cli("train", "-r", run_dir.path, "--dry-run")
    assert res.exit_code == 0, res.output
    p.write_text(p.read_text().replace("lr: 1.0e-06", "lr: 0.5"))  # a real edit is still caught
    res = cli("train", "-r", run_dir.path, "--dry-run")
    assert res.exit_code == 2 and "edited by hand" in res.output


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_status_shows_artifacts_cursor_engines_locks_metrics(cli, run_dir):
    from slimectl.contract.metrics import MetricsWriter

    for i in range(3):
        with run_dir.rollouts.publish(i, meta={"weight_version": i}) as d:
            (d / "samples.jsonl").write_text("{}\n")
    with run_dir.checkpoints.publish(1) as d:
        (d / "model.bin").write_bytes(b"x")
    with run_dir.lock("train") as lock:
        run_dir.cursor("train").commit(0, lock=lock)
        run_dir.cursor("train").commit(1, lock=lock)
    with MetricsWriter(run_dir.metrics_path("train")) as m:
        m.log(1, {"train/loss": 0.5})
    server = HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        run_dir.engines.register(EngineRecord(url=url, backend="embedded", id="e0", weight_version="3"))
        run_dir.engines.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", id="e1", pid=None))
        with run_dir.lock("serve"):
            res = cli("status", "-r", run_dir.path, "--json")
            text = cli("status", "-r", run_dir.path)
    finally:
        server.shutdown()
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["artifacts"]["rollouts"] == {"count": 3, "latest": 2}
    assert st["artifacts"]["checkpoints"] == {"count": 1, "latest": 1}
    assert st["consumed"]["train"]["next"] == 2 and st["rollouts_pending"] == 1
    health = {e["id"]: e["health"] for e in st["engines"]}
    assert health["e0"] == "ok" and health["e1"].startswith("unreachable")
    assert st["running"]["serve"]["stale"] is False
    assert st["last_metrics"]["train"]["train/loss"] == 0.5
    lines = text.output.splitlines()
    assert "training   trained through rollout 1 (2 of 10 rollouts); next to train: rollout 2" in lines
    assert "rollouts   3 generated (rollouts 0-2); 1 waiting to be trained" in lines
    assert "checkpoint newest 1: the policy after training on rollout 0; 1 kept" in lines
    assert "weights    none published yet (engines serve the initial model, version 0)" in lines
    assert any(line.startswith("engine     e0 ") and line.endswith("serving weight version 3; health ok")
               for line in lines), lines
    assert not any(line.startswith("extended") for line in lines)
    assert st["training"] == {"trained": 2, "trained_through": 1, "next_to_train": 2, "num_rollout": 10}
    assert "serve      running" in text.output and "train/loss=0.5" in text.output


def test_init_with_tiny_model_builds_and_status_shows_it(cli, tmp_path):
    res = cli("init", tmp_path / "r", "--tiny-model", "qwen2", "--set", "rollout.batch_size=2")
    assert res.exit_code == 0, res.output
    run = RunDir.open(tmp_path / "r")
    model = Path(run.config().model.path)
    assert model == run.path / "models" / "tiny-qwen2"
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
    assert not [p for p in model.parent.iterdir() if p.name.startswith(".tmp")]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(model).model_type == "qwen2"
    st = cli("status", "-r", run.path)
    assert f"model      {model} (fp32)" in st.output
    again = cli("init", tmp_path / "r", "--tiny-model", "qwen2", "--set", "rollout.batch_size=2")
    assert again.exit_code == 0  # idempotent, nothing rebuilt
    clash = cli("init", tmp_path / "r2", "--tiny-model", "qwen2", "--set", "model.path=/x")
    assert clash.exit_code == 2 and "conflicts with model.path" in clash.output


def test_status_shows_an_extended_run_and_engines_behind(cli, run_dir):
    import os

    for i in range(3):
        with run_dir.rollouts.publish(i, meta={"weight_version": i}) as d:
            (d / "samples.jsonl").write_text("{}\n")
        with run_dir.weights.publish(i + 1) as d:
            (d / "model.safetensors").write_bytes(b"x")
    with run_dir.checkpoints.publish(3) as d:
        (d / "model.bin").write_bytes(b"x")
    with run_dir.lock("train") as lock:
        for i in range(3):
            run_dir.cursor("train").commit(i, lock=lock)
    run_dir.engines.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", id="e0", weight_version="1"))
    base = run_dir.config()
    assert base.rollout.num_rollout == 10
    # `slimectl rl -r RUN --set rollout.num_rollout=12` extends the run: its effective config is saved last
    saved = run_dir.save_stage_config("rl", run_dir.stage_config("rl", ["rollout.num_rollout=12"]))
    later = (run_dir.path / "config.yaml").stat().st_mtime + 1
    os.utime(saved, (later, later))
    res = cli("status", "-r", run_dir.path, "--no-probe")
    st = json.loads(cli("status", "-r", run_dir.path, "--no-probe", "--json").output)
    lines = res.output.splitlines()
    assert "extended   to 12 rollouts by the last `slimectl rl` (--set rollout.num_rollout; config.yaml says 10)" in lines
    assert "training   trained through rollout 2 (3 of 12 rollouts); next to train: rollout 3" in lines
    assert any("12 rollouts x" in line for line in lines if line.startswith("algorithm"))
    assert "checkpoint newest 3: the policy after training on rollouts 0-2; 1 kept" in lines
    assert "weights    newest published version 3 (what engines sync to); 3 kept" in lines
    assert any("serving weight version 1 (2 behind the newest, 3)" in line for line in lines), lines
    assert st["config"]["num_rollout"] == 12 and st["config"]["num_rollout_frozen"] == 10
    assert st["training"]["num_rollout"] == 12
