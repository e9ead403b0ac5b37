"""Where PPO's critic runs: on the trainer's ranks at the actor's layout, except under
`rl --launcher ray`, where it is its own actor group at any critic.tp x pp x dp."""

from __future__ import annotations

import pytest

from slimectl.contract.config import load_config
from slimectl.contract.config_checks import critic_layout_problem
from tests.helpers import slimectl_in_process

REFUSED = ("critic.tp x critic.pp x critic.dp = 2 x 1 x 1: outside Ray the critic runs on the actor's ranks and "
           "layout (train.tp x train.pp x train.dp = 1 x 1 x 1); leave critic.tp, critic.pp and critic.dp unset, or "
           "run `slimectl rl --launcher ray`, where the critic is its own actor group at any layout")


def test_a_critic_layout_of_its_own_is_a_valid_config_refused_outside_ray_only():
    cfg = load_config(None, ["algorithm.advantage_estimator=ppo", "critic.tp=2"])  # a config Ray can run
    assert critic_layout_problem(cfg) == REFUSED
    assert critic_layout_problem(cfg, own_group=True) is None
    same = load_config(None, ["algorithm.advantage_estimator=ppo", "train.tp=2", "train.dp=2", "critic.pp=1"])
    assert critic_layout_problem(same) is None  # unset or equal keys: the actor's layout
    r = same.critic.resolved(same.train)
    assert (r.tp, r.pp, r.dp) == (2, 1, 2)
    assert critic_layout_problem(load_config(None, ["algorithm.advantage_estimator=ppo", "critic.dp=2"])) \
        .startswith("critic.tp x critic.pp x critic.dp = 1 x 1 x 2: outside Ray")
    assert critic_layout_problem(load_config(None, ["critic.tp=2"])) is None  # no critic without ppo


@pytest.mark.parametrize("stage", ["train", "rl"])
def test_train_and_local_rl_refuse_a_critic_layout_of_its_own_in_one_line(run_dir, stage):
    """Before the actor is built (`slimectl train`: with the cheap checks; `rl`: before any launch)."""
    from slimectl.contract.rundir import RunDir

    res = slimectl_in_process(stage, "-r", run_dir.path, "--set", "algorithm.advantage_estimator=ppo",
                              "--set", "critic.tp=2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [f"Error: {REFUSED}"], res.stderr[-2000:]
    assert not list((RunDir.open(run_dir.path).path / "locks").glob("*.lock"))
