"""Routing replay (slime's use_rollout_routing_replay, R3) end to end on a tiny Qwen3-MoE in fp32:
the embedded engine records the routes, the sample stores them, the Megatron actor replays them
(tests/scripts/routing_replay_check.py, one rank, in this process; and at EP=2 on the session's
two-rank worker). The engine's two rollouts are made once, in this process, and handed to both runs
as a file: the ranks never load the engine's transformers model."""

from __future__ import annotations

import json
import runpy

import pytest

from tests.helpers import SCRIPTS, in_process_stage, run_script_in_process

CHECK = SCRIPTS / "routing_replay_check.py"


def result(proc) -> dict:
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    print(res)
    return res


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    return build_tiny_model("qwen3-moe", tmp_path_factory.mktemp("hf") / "moe", seed=3)


@pytest.fixture(scope="module")
def rollouts(moe, tmp_path_factory) -> str:
    """The embedded engine's two rollouts (same and perturbed routers), with their routes, as a file."""
    path = tmp_path_factory.mktemp("rollouts") / "samples.pkl"
    with in_process_stage():
        runpy.run_path(str(CHECK), run_name="__in_process__")["write_rollouts"](str(moe), path)
    return str(path)


@pytest.fixture(scope="module")
def replay(moe, rollouts) -> dict:
    return result(run_script_in_process(CHECK, str(moe), rollouts))


def test_replay_step0_train_vs_rollout_within_1e5_with_the_recorded_routes(replay):
    same = replay["same_weights"]
    assert same["gap_replay_on"] <= 1e-5
    assert same["forced_equal_recorded"] and same["forced_rows_equal_samples"]
    assert same["replayed_positions"] > 100
    # the training forward and the reference model's forward replay them too
    assert same["train_and_ref_forced_equal_recorded"] and same["ref_routers"] == replay["moe_layers"]
    assert same["train_step_rollout_abs_diff_mean"] <= 1e-5  # the training forward's own log-probs


def test_routes_recorded_under_other_weights_are_the_ones_the_trainer_uses(replay):
    # the engine's routers perturbed: some routes differ from what the trainer's routers pick on
    # their own; with replay the trainer uses the recorded ones, and the log-prob gap shrinks to
    # what the perturbed gate weights alone make
    p = replay["perturbed_router"]
    assert p["own_routes_differ"] > 0
    assert p["forced_equal_recorded"] and p["forced_rows_equal_samples"]
    assert p["gap_replay_on"] * 10 < p["gap_replay_off"]


def test_a_sample_without_routes_is_one_clear_line(replay):
    msg = replay["missing_error"]
    assert msg is not None and "sample 7 has no rollout_routed_experts" in msg
    assert "rollout.return_routed_experts" in msg


@pytest.mark.xdist_group("two_ranks")
def test_replay_under_expert_parallelism(moe, rollouts, two_ranks):
    # EP=2 (two data-parallel ranks, two experts each, all-to-all dispatch): each rank's routers
    # replay its own micro-batches' rows; the worst rank's figures
    res = result(two_ranks.run(CHECK, str(moe), rollouts, timeout=600))
    assert res["ep"] == 2
    same, p = res["same_weights"], res["perturbed_router"]
    assert same["gap_replay_on"] <= 1e-5 and same["train_step_rollout_abs_diff_mean"] <= 1e-5
    assert same["forced_equal_recorded"] and same["forced_rows_equal_samples"]
    assert same["train_and_ref_forced_equal_recorded"]
    assert p["own_routes_differ"] > 0 and p["forced_equal_recorded"] and p["gap_replay_on"] * 10 < p["gap_replay_off"]
