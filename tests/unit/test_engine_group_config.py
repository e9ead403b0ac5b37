"""Named engine groups (``engine.groups``) and the judge reward's pieces: the config's checks (one line, exit 2),
a frozen group's engine section, the registry folders, the verdict parsers and the judge's error policy."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from slimectl.contract.config import build_config
from slimectl.contract.errors import ConfigError
from slimectl.rewards.judge import JudgeReward, parse_verdict, render

JUDGE = {"name": "judge", "model": "/models/judge", "num_engines": 2, "options": {"max_batch_size": 3}}


@pytest.mark.parametrize("engine,rollout,says", [
    ({"groups": [{"name": "judge"}, {"name": "judge"}]}, {}, "two groups are named 'judge'"),
    ({"groups": [{"name": "actor"}]}, {}, "engine.groups[actor] is frozen (update_weights: false) but 'actor' is the "
                                          "actor's group"),
    ({"groups": [{"name": "ref", "update_weights": True}]}, {}, "engine.groups[ref] has update_weights: true, but the "
                                                                "actor's group is engine: ('actor')"),
    ({"groups": [{"name": "actor", "update_weights": True, "num_engines": 2}]}, {}, "keep only name and update_weights"),
    ({}, {"teacher_group": "teacher"}, "rollout.teacher_group = teacher: no engine group has that name (groups: actor)"),
    ({"groups": [JUDGE]}, {"reward": "judge", "judge": {"group": "jdge"}}, "rollout.judge.group = jdge: no engine "
                                                                            "group has that name (groups: actor, judge)"),
    ({}, {"reward": "judge"}, "rollout.reward is judge but rollout.judge names no group and no urls"),
    ({"groups": [{"name": "x", "options": {"router": True}}]}, {}, "engine.groups[x].options may not set router"),
    ({"groups": [{"name": "x", "options": {"tp_sise": 2}}]}, {}, "engine.groups[x].options: tp_sise: not an engine key"),
    ({"groups": [{"name": "x", "backend": "external"}]}, {}, "engine.groups[x] is external (engines started elsewhere) "
                                                             "but lists no urls"),
    ({}, {"judge": {"template": "{question}"}}, "rollout.judge.template: unknown placeholder {question}"),
    ({}, {"judge": {"parser": "regex", "regex": "score"}}, "rollout.judge.regex has no group"),
])
def test_bad_group_configs_are_one_line(engine, rollout, says):
    with pytest.raises(ConfigError) as exc:
        build_config({"engine": engine, "rollout": rollout})
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_bad_group_config_exits_2_from_init(cli, tmp_path):
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"engine": {"groups": [{"name": "judge"}]}, "rollout": {"teacher_group": "teachr"}}))
    res = cli("init", tmp_path / "run", "-c", cfg, "--tiny-model", "qwen2")
    assert res.exit_code == 2 and "rollout.teacher_group = teachr: no engine group" in res.output
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_a_frozen_group_config_is_the_actors_engine_with_its_own_keys():
    cfg = build_config({"model": {"path": "/models/actor"},
                        "engine": {"port": 30000, "max_batch_size": 8, "env": {"A": "1"}, "gpu_ids": [0],
                                   "groups": [{"name": "actor", "update_weights": True}, JUDGE]},
                        "train": {"lora": {"rank": 4}}})
    assert cfg.engine.group_names() == ["actor", "judge"] and [g.name for g in cfg.engine.frozen_groups] == ["judge"]
    g = cfg.group_config("judge")
    assert g.model.path == "/models/judge" and g.train.lora is None  # its own model, full weights
    e = g.engine
    assert (e.name, e.num_engines, e.max_batch_size, e.env, e.port, e.gpu_ids, e.groups) == \
        ("judge", 2, 3, {"A": "1"}, 0, [], [])
    assert cfg.engine.port == 30000 and cfg.engine.max_batch_size == 8  # the actor's, untouched
    default = build_config({"model": {"path": "/m"}, "engine": {"groups": [{"name": "ref"}]}}).group_config("ref")
    assert default.model.path == "/m"  # a group's model defaults to the actor's initial weights


def test_frozen_groups_register_apart_from_the_actors_engines(tmp_path):
    from slimectl.contract.rundir import EngineRecord, RunDir

    run, _ = RunDir.create(tmp_path / "run", build_config({}))
    run.engines.register(EngineRecord(url="http://a:1", backend="embedded", id="engine-0"))
    run.engine_group("judge").register(EngineRecord(url="http://j:1", backend="embedded", id="judge-engine-0",
                                                    extra={"group": "judge"}))
    assert [r.url for r in run.engines.list()] == ["http://a:1"]  # what sync and rollouts see
    assert run.engine_group_names() == ["judge"] and [r.url for r in run.engine_group("judge").list()] == ["http://j:1"]


@pytest.mark.parametrize("parser,verdict,regex,want", [
    ("score", "Score: 0.75, confident", None, 0.75), ("score", "1", None, 1.0), ("score", "7 out of 10", None, None),
    ("score", "no idea", None, None), ("yes_no", " Yes, it is right", None, 1.0), ("yes_no", "INCORRECT.", None, 0.0),
    ("yes_no", "maybe", None, None), ("regex", "grade=4/5", r"grade=(\d)", 4.0), ("regex", "grade=?", r"grade=(\d)", None),
])
def test_verdict_parsers(parser, verdict, regex, want):
    assert parse_verdict(parser, verdict, regex) == want


def _judge(answers, **settings):
    cfg = build_config({"rollout": {"judge": {"urls": ["http://j:1"], **settings}}})

    async def ask(text):
        answer = answers[text]
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            await asyncio.sleep(5)
        return {"text": answer, "meta_info": {"engine_url": "http://j:1", "weight_version": "0"}}

    return JudgeReward(cfg.rollout.judge, ask)


def test_the_judge_records_each_verdict_and_scores_it_with_the_parser():
    from slimectl.web.errors import HttpError

    t = "{prompt}|{response}|{label}"
    samples = [SimpleNamespace(prompt=p, response=r, label=l, metadata=m, reward=None)
               for p, r, l, m in (("1+1", "2", "2", {}), ([{"role": "user", "content": "hi"}], "yo", None, None),
                                  ("q", "a", 3, {"k": 1}), ("slow", "", None, {}))]
    answers = {"1+1|2|2": "0.9", "user: hi|yo|": "nonsense", "q|a|3": HttpError("engine http://j:1: refused"),
               "slow||": None}
    judge = _judge(answers, template=t, timeout_s=0.2)
    asyncio.run(judge(samples))
    assert [s.reward for s in samples] == [0.9, 0.0, 0.0, 0.0]
    records = [s.metadata["judge"] for s in samples]
    assert records[0] == {"verdict": "0.9", "score": 0.9, "engine_url": "http://j:1", "weight_version": "0"}
    assert records[1]["verdict"] == "nonsense" and records[1]["error"] == "no score verdict in 'nonsense'"
    assert records[2]["error"] == "engine http://j:1: refused" and samples[2].metadata["k"] == 1
    assert records[3]["error"] == "no verdict within rollout.judge.timeout_s = 0.2 s"
    json.dumps(records)  # what samples.parquet stores
    assert render(t, "p", None, None) == "p||"


def test_the_judge_fails_the_rollout_when_told_to():
    from slimectl.rewards.errors import RewardError

    judge = _judge({"p|r": "so-so"}, template="{prompt}|{response}", on_error="fail")
    with pytest.raises(RewardError, match=r"judge: no score verdict in 'so-so' \(rollout.judge.on_error is fail"):
        asyncio.run(judge([SimpleNamespace(prompt="p", response="r", label=None, metadata={}, reward=None)]))


def test_a_frozen_group_restarts_on_its_model_never_on_the_actors_weights(tmp_path):
    """The heartbeat restarts a lost engine at its recorded version ("0" for a frozen group): that is its own model,
    even where the run has published the actor's weights/0 (a LoRA run does at start)."""
    from slimectl.contract.rundir import RunDir
    from slimectl.stages.serve import EngineProcesses, FrozenGroups

    cfg = build_config({"model": {"path": "/models/actor"}, "engine": {"groups": [JUDGE]}})
    run, _ = RunDir.create(tmp_path / "run", cfg)
    with run.weights.publish(0, meta={"weight_version": 0}) as d:
        (d / "model.safetensors").write_bytes(b"actor")
    judge = FrozenGroups(run, cfg).groups["judge"]
    assert judge.registry.dir == run.path / "engines" / "groups" / "judge" and judge.prefix == "judge-"
    assert judge._resolve_weights(0) == judge._resolve_weights() == ("/models/judge", "0")
    actor = EngineProcesses(run, cfg)
    assert actor._resolve_weights(0) == (str(run.weights.dir_for(0)), "0")  # the actor's group: weights/0


def test_the_judge_prompt_in_the_judge_models_chat_template(tmp_path):
    from slimectl.stages.rollout.judge import judge_prompt
    from slimectl.starter_models.tiny_models import build_tiny_model

    model = build_tiny_model("qwen2", tmp_path / "judge", seed=1)
    groups = {"groups": [{"name": "judge", "model": str(model)}]}
    raw = build_config({"engine": groups, "rollout": {"judge": {"group": "judge"}}})
    assert judge_prompt(raw)("Is 2 right?") == "Is 2 right?"
    for judge in ({"group": "judge"}, {"urls": ["http://j:1"], "tokenizer_path": str(model)}):
        cfg = build_config({"model": {"path": "/models/actor", "tokenizer_path": "/models/actor-tok"}, "engine": groups,
                            "rollout": {"judge": {**judge, "chat_template": True}}})
        text = judge_prompt(cfg)("Is 2 right?")  # the group's own tokenizer, not the actor's tokenizer_path
        assert "<|im_start|>user\nIs 2 right?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="needs rollout.judge.tokenizer_path"):
        build_config({"rollout": {"judge": {"urls": ["http://j:1"], "chat_template": True}}})
