"""slime's ``--sglang-config`` YAML -> engine groups (``init --from-slime``;
slimectl.stages.init.slime_sglang_config), on hand-written YAML in slime's format."""

from __future__ import annotations

import pytest
import yaml

from slimectl.contract.config import build_config
from slimectl.contract.errors import ConfigError
from slimectl.stages.init.slime_launch import translate_slime_args

SLIME_YAML = """
sglang:
  - name: actor
    update_weights: true
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 2
        overrides: {context-length: 8192}
  - name: ref
    model_path: /models/ref
    server_groups:
      - {worker_type: regular, num_gpus: 2}
      - {worker_type: placeholder, num_gpus: 2}
  - name: judge
    model_path: /models/judge
    update_weights: false
    num_gpus_per_engine: 2
    engine_groups:
      - {worker_type: regular, num_gpus: 2, overrides: {mem_fraction_static: 0.5}}
"""


def translate(tmp_path, text, *flags):
    (tmp_path / "sg.yaml").write_text(text)
    argv = ["--hf-checkpoint", "/models/actor", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "1",
            "--sglang-config", "sg.yaml", *flags]
    return translate_slime_args(argv, base=tmp_path)


def test_the_actor_model_is_engine_and_the_frozen_ones_are_groups(tmp_path):
    tr = translate(tmp_path, SLIME_YAML)
    e = tr.data["engine"]
    assert (e["name"], e["num_engines"], e["tp_size"], e["sglang_args"]) == ("actor", 2, 2, {"context_length": 8192})
    assert e["groups"] == [
        {"name": "ref", "model": "/models/ref", "num_engines": 2, "options": {"tp_size": 1}, "update_weights": False},
        {"name": "judge", "model": "/models/judge", "num_engines": 1,
         "options": {"tp_size": 2, "sglang_args": {"mem_fraction_static": 0.5}}, "update_weights": False}]
    assert any("placeholder reserves GPUs only" in n for n in tr.notes)
    assert any("frozen group(s): ref, judge" in n for n in tr.notes)
    cfg = build_config(tr.data)  # a valid config as it stands
    assert cfg.engine.group_names() == ["actor", "ref", "judge"]
    assert cfg.group_config("judge").engine.sglang_args == {"mem_fraction_static": 0.5}


def test_update_weights_unset_follows_slimes_rule(tmp_path):
    text = "sglang:\n  - {name: policy, model_path: /models/actor}\n  - {name: teacher, model_path: /models/big}\n"
    e = translate(tmp_path, text).data["engine"]
    assert e["name"] == "policy" and [g["name"] for g in e["groups"]] == ["teacher"]  # --hf-checkpoint's: the actor


@pytest.mark.parametrize("text,says", [
    ("sglang:\n  - {name: a, update_weights: true}\n  - {name: b, update_weights: true}\n",
     "models a and b both take the trained weights"),
    ("sglang:\n  - {name: a, server_groups: [{worker_type: prefill, num_gpus: 2}]}\n",
     "worker_type prefill (PD or encoder disaggregation) is not supported"),
    ("sglang:\n  - {name: a, model_path: /models/x}\n", "no model takes the trained weights"),
    ("sglang:\n  - {name: a, server_groups: [{num_gpus: 3, num_gpus_per_engine: 2}]}\n",
     "num_gpus 3 does not split into engines of 2"),
    ("sglang:\n  - {name: a, gpus: 2}\n", "model a: unknown key(s) gpus"),
    ("models: []\n", "expected a top-level 'sglang:' list of models"),
])
def test_what_slimectl_cannot_serve_is_one_line(tmp_path, text, says):
    with pytest.raises(ConfigError) as exc:
        translate(tmp_path, text)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_init_from_slime_with_an_sglang_config(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sg.yaml").write_text(SLIME_YAML)
    script = tmp_path / "run.sh"
    script.write_text("python3 train.py --hf-checkpoint /models/actor --rollout-num-gpus 8 --sglang-config sg.yaml\n")
    res = cli("init", "--dry-run", "--from-slime", script)
    assert res.exit_code == 0, res.output
    engine = yaml.safe_load(res.stdout)["engine"]
    assert [g["name"] for g in engine["groups"]] == ["ref", "judge"] and engine["groups"][0]["model"] == "/models/ref"
    (tmp_path / "sg.yaml").write_text("sglang:\n  - {name: a, update_weights: true}\n  - {name: a, model_path: /m}\n")
    res = cli("init", tmp_path / "run", "--from-slime", script)
    assert res.exit_code == 2 and "two models are named a; give each its own name" in res.output and not (tmp_path / "run").exists()
