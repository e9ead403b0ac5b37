"""The critic section, algorithm.gamma / lambd, and advantage_estimator: ppo."""

from __future__ import annotations

import pytest

from slimectl.contract.config import apply_overrides, load_config
from slimectl.contract.config_checks import critic_layout_problem
from slimectl.contract.config_schema import STAGE_SECTIONS
from slimectl.contract.errors import ConfigError
from slimectl.stages.init.slime_launch import translate_slime_args
from tests.helpers import slimectl_in_process

def error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(None, list(overrides))
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_ppo_runs_on_the_actors_layout_outside_ray():
    assert load_config(None, ["algorithm.advantage_estimator=ppo"]).algorithm.advantage_estimator == "ppo"
    cfg = load_config(None, ["algorithm.advantage_estimator=ppo", "train.tp=2", "train.pp=2", "train.dp=2"])
    assert (cfg.critic.resolved(cfg.train).tp, cfg.critic.resolved(cfg.train).pp) == (2, 2)
    # a layout of its own is a valid config (rl --launcher ray runs it), refused where the critic shares the
    # trainer's ranks (tests/unit/test_critic_layout.py)
    own = load_config(None, ["algorithm.advantage_estimator=ppo", "train.tp=2", "train.dp=2", "critic.tp=1"])
    assert critic_layout_problem(own).startswith(
        "critic.tp x critic.pp x critic.dp = 1 x 1 x 2: outside Ray the critic runs on the actor's ranks and layout "
        "(train.tp x train.pp x train.dp = 2 x 1 x 2)")


def test_defaults_follow_slime_and_null_keys_take_the_actors():
    cfg = load_config(None, ["train.lr=3e-6", "train.min_lr=1e-7", "train.lr_decay_style=cosine",
                             "train.lr_warmup_steps=2", "rollout.num_rollout=10"])
    a, c = cfg.algorithm, cfg.critic
    assert (a.gamma, a.lambd) == (1.0, 1.0)  # slime --gamma 1.0 --lambd 1.0
    assert (c.path, c.value_clip, c.num_critic_only_steps) == (None, 0.2, 0)  # slime --value-clip 0.2
    assert (c.lr, c.tp, c.lr_decay_style) == (None, None, None)
    r = c.resolved(cfg.train)
    assert (r.lr, r.min_lr, r.lr_decay_style, r.lr_warmup_steps, r.tp, r.pp) == (3e-6, 1e-7, "cosine", 2, 1, 1)
    own = load_config(None, ["critic.lr=1e-5", "critic.lr_decay_style=linear", "critic.value_clip=0.5",
                             "critic.num_critic_only_steps=2", "algorithm.gamma=0.99", "algorithm.lambd=0.95",
                             "rollout.num_rollout=3"])
    r = own.critic.resolved(own.train)
    assert (r.lr, r.lr_decay_style, r.value_clip, r.num_critic_only_steps) == (1e-5, "linear", 0.5, 2)
    assert (own.algorithm.gamma, own.algorithm.lambd) == (0.99, 0.95)
    assert own.train.lr == 1e-6  # the actor's own keys are untouched


@pytest.mark.parametrize("overrides, expected", [
    (["algorithm.lambd=1.5"], "algorithm.lambd = 1.5: must be less than or equal to 1"),
    (["algorithm.lambd=-0.1"], "algorithm.lambd = -0.1: must be greater than or equal to 0"),
    (["critic.value_clip=0"], "critic.value_clip = 0: must be greater than 0"),
    (["critic.num_critic_only_steps=-1"], "critic.num_critic_only_steps = -1: must be greater than or equal to 0"),
    (["critic.tp=0"], "critic.tp = 0: must be greater than 0"),
    (["critic.lr=-1"], "critic.lr = -1: must be greater than or equal to 0"),
    (["critic.lr_decay_style=exp"], "critic.lr_decay_style = \"exp\": must be one of 'constant', 'linear' or 'cosine'"),
    (["critic.min_lr=1", "critic.lr=0.5"], "critic.min_lr = 1.0 must be <= critic.lr = 0.5"),
    (["critic.min_lr=1"], "critic.min_lr = 1.0 must be <= critic.lr (= train.lr) = 1e-06"),
    (["critic.num_critic_only_steps=3", "rollout.num_rollout=3"],
     "critic.num_critic_only_steps = 3 must be below rollout.num_rollout = 3, or the actor never trains"),
    (["critic.lr_decay_style=cosine", "critic.lr_warmup_steps=5", "rollout.num_rollout=5"],
     "critic.lr_warmup_steps = 5 must be below the run's 5 critic optimizer steps (rollout.num_rollout x "
     "train.num_steps_per_rollout x critic.num_steps_per_rollout) to decay the critic's LR (cosine); lower it or "
     "train longer"),
    (["critic.lr_decay_style=linear", "critic.lr_warmup_steps=10", "rollout.num_rollout=5",
      "critic.num_steps_per_rollout=2"],
     "critic.lr_warmup_steps = 10 must be below the run's 10 critic optimizer steps (rollout.num_rollout x "
     "train.num_steps_per_rollout x critic.num_steps_per_rollout) to decay the critic's LR (linear); lower it or "
     "train longer"),
    (["critic.num_steps_per_rollout=0"], "critic.num_steps_per_rollout = 0: must be greater than or equal to 1"),
])
def test_bad_critic_keys_fail_in_one_line(overrides, expected):
    assert error(*overrides) == f"config with --set overrides: {expected}"


def test_critic_steps_per_rollout_default_one_and_count_in_the_warmup_bound():
    assert load_config(None).critic.num_steps_per_rollout == 1
    cfg = load_config(None, ["critic.lr_decay_style=linear", "critic.lr_warmup_steps=5", "rollout.num_rollout=5",
                             "critic.num_steps_per_rollout=2"])  # 10 critic steps: a warm-up of 5 leaves a decay
    assert cfg.critic.resolved(cfg.train).num_steps_per_rollout == 2


def test_critic_sizes_that_divide_the_trainer_are_accepted():
    cfg = load_config(None, ["train.dp=4", "critic.tp=2", "critic.pp=2"])
    assert (cfg.critic.tp, cfg.critic.pp) == (2, 2)


def test_unknown_critic_key_suggests_the_right_one():
    assert error("critic.valueclip=1") == ("--set critic.valueclip=1: unknown config key 'critic.valueclip' "
                                           "(did you mean 'critic.value_clip'?)")


def test_critic_path_is_made_absolute_against_the_config_file(tmp_path):
    (tmp_path / "cfgdir").mkdir()
    p = tmp_path / "cfgdir" / "cfg.yaml"
    p.write_text("critic:\n  path: ../critic-init\n")
    assert load_config(p).critic.path == str(tmp_path / "critic-init")


def test_train_may_override_the_critic_and_rollout_may_not():
    assert "critic" in STAGE_SECTIONS["train"] and "critic" not in STAGE_SECTIONS["rollout"]
    data = load_config(None).to_dict()
    assert apply_overrides(data, ["critic.lr=0.5"], STAGE_SECTIONS["train"], "train")["critic"]["lr"] == 0.5
    with pytest.raises(ConfigError, match="slimectl rollout may only override"):
        apply_overrides(data, ["critic.lr=2e-6"], STAGE_SECTIONS["rollout"], "rollout")


def test_slime_lambd_flag_now_maps():
    tr = translate_slime_args(["--hf-checkpoint", "/m", "--gamma", "0.99", "--lambd", "0.95"])
    assert (tr.data["algorithm"]["gamma"], tr.data["algorithm"]["lambd"]) == (0.99, 0.95)
    assert "--lambd" not in dict(tr.unmapped)
