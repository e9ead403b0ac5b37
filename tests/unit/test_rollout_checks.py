"""The rollout stage's cheap checks: dataset keys before any engine, engine staleness, the run's
limit for --next, zero reward spread. No engine and no model runs here (tests/integration/
test_rollout_joints.py drives the same joints on real engines)."""

from __future__ import annotations

import json
import logging

import pytest

from slimectl.contract.config import build_config
from slimectl.contract.rundir import EngineRecord
from slimectl.contract.samples import Sample
from slimectl.rewards import RewardConfigError, needs_label
from slimectl.stages.rollout.data import DatasetError, load_prompts
from slimectl.stages.rollout.publish import rollout_metrics, zero_spread_warning
from slimectl.stages.rollout.stage import StaleEngine, check_staleness, max_staleness, run_rollout


def jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def cfg(**rollout):
    return build_config({"rollout": rollout})


# ------------------------------------------------------------------------ which rewards need a label

@pytest.mark.parametrize("reward,want", [("math", True), ("dapo", True), ("boxed_math", True), ("boxed_f1", True),
                                         ("deepscaler", True), ("f1", True), ("gpqa", True), ("random", False),
                                         ("boxed_random", False), ("remote", None), ("my_mod:reward", None),
                                         ("pkg.mod.reward", None)])
def test_which_rewards_grade_against_a_label(reward, want):
    assert needs_label(reward) is want


def test_an_unknown_reward_name_is_a_config_error():
    with pytest.raises(RewardConfigError, match="unknown reward type 'maths'"):
        needs_label("maths")


# ------------------------------------------------------------------------ dataset keys

def test_a_file_without_the_label_key_is_refused_naming_the_keys_it_has(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])
    with pytest.raises(DatasetError) as e:
        load_prompts(data, "question", "label", label_needed_by="math")
    assert str(e.value) == (f"prompt dataset {data}: key 'label' (data.label_key) is in no row, but reward 'math' "
                            f"grades against a label; its rows have keys: question, answer; set the answer's key with "
                            f"--set data.label_key=KEY")
    assert e.value.exit_code == 2
    rows, _ = load_prompts(data, "question", "answer", label_needed_by="math")
    assert [r.label for r in rows] == ["2", "4"]


def test_null_labels_everywhere_and_a_null_label_key_are_refused_too(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"input": "1+1?", "label": None}])
    with pytest.raises(DatasetError, match=r"key 'label' \(data.label_key\) is null in every row, but reward 'dapo'"):
        load_prompts(data, label_needed_by="dapo")
    with pytest.raises(DatasetError, match=r"reward 'math' grades against a label, but data.label_key is null; .*"
                                           r"\(keys: input, label\)"):
        load_prompts(data, label_key=None, label_needed_by="math")


def test_a_row_without_its_label_names_the_line(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "1"}, {"input": "b", "meta": 1}])
    with pytest.raises(DatasetError, match=r"d.jsonl line 2: no 'label' \(data.label_key\), which reward 'math' grades "
                                           r"against; this row has keys: input, meta \(or pass --skip-bad-rows"):
        load_prompts(data, label_needed_by="math")
    rows, skipped = load_prompts(data, skip_bad_rows=True, label_needed_by="math")
    assert len(rows) == 1 and skipped == 1


def test_rewards_without_labels_take_any_file_and_custom_ones_get_a_warning(tmp_path, caplog):
    data = jsonl(tmp_path / "d.jsonl", [{"input": "a"}])
    with caplog.at_level(logging.WARNING, logger="slimectl.rollout"):
        load_prompts(data)  # random: no label needed, no word
        assert not caplog.records
        rows, _ = load_prompts(data, label_maybe_used_by="my_mod:reward")
    assert rows[0].label is None
    assert [r.getMessage() for r in caplog.records] == [
        f"prompt dataset {data} has no key 'label' (data.label_key) in any row: reward 'my_mod:reward' gets label None "
        f"for every sample (set data.label_key: null if it needs none)"]


def test_a_file_without_the_input_key_is_refused_naming_the_keys_it_has(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}, {"prompt": "b", "label": "2", "id": 7}])
    with pytest.raises(DatasetError) as e:
        load_prompts(data)
    assert str(e.value) == (f"prompt dataset {data}: key 'input' (data.input_key) is in no row; its rows have keys: "
                            f"prompt, label, id; set the prompt's key with --set data.input_key=KEY")


def test_malformed_json_names_the_line_and_exits_2(tmp_path):
    data = jsonl(tmp_path / "d.jsonl", [{"input": "a", "label": "1"}, "", '{"input": "b", "label": ', {"input": "c"}])
    with pytest.raises(DatasetError, match=r"d.jsonl line 3: invalid JSON \(Expecting value\) \(or pass --skip-bad-rows"
                                           r" to skip and count such rows\)") as e:
        load_prompts(data)
    assert e.value.exit_code == 2


def test_the_cli_checks_the_dataset_before_the_tokenizer_and_any_engine(run_dir, tmp_path, cli):
    # The fake model has no tokenizer and the registered engine's port is closed: reaching either
    # would fail differently. The dataset check comes first.
    run_dir.engines.register(EngineRecord(url="http://127.0.0.1:9", backend="embedded", id="e0", weight_version="0"))
    data = jsonl(tmp_path / "d.jsonl", [{"input": "1+1?", "answer": "2"}])
    res = cli("rollout", "-r", run_dir.path, "--set", f"data.prompt_data={data}")
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == (
        f"Error: prompt dataset {data}: key 'label' (data.label_key) is in no row, but reward 'math' grades against a "
        f"label; its rows have keys: input, answer; set the answer's key with --set data.label_key=KEY")
    assert run_dir.rollouts.ids() == []


# ------------------------------------------------------------------------ staleness

def test_max_staleness_defaults_to_what_the_loop_mode_implies():
    assert max_staleness(cfg()) == 0
    assert max_staleness(cfg(async_mode="one_step_off")) == 1
    assert max_staleness(cfg(async_mode="one_step_off", max_staleness=0)) == 0
    assert max_staleness(cfg(max_staleness=3)) == 3
    assert max_staleness(cfg(async_mode="fully_async")) == 1


def test_fully_async_defaults_drop_stale_groups_and_retract_requests_for_the_update():
    from slimectl.contract.config_schema import SlimectlConfig

    off = SlimectlConfig()
    assert (off.effective_stale_samples, off.effective_pause_mode) == ("keep", "abort")
    fa = SlimectlConfig.model_validate({"rollout": {"async_mode": "fully_async"}})
    assert (fa.effective_stale_samples, fa.effective_pause_mode) == ("drop", "retract")
    chosen = SlimectlConfig.model_validate({"rollout": {"async_mode": "fully_async", "stale_samples": "keep"},
                                            "sync": {"pause_mode": "in_place"}})
    assert (chosen.effective_stale_samples, chosen.effective_pause_mode) == ("keep", "in_place")


def publish_weights(run, *ids: int) -> None:
    for i in ids:
        with run.weights.publish(i) as d:
            (d / "model.safetensors").write_bytes(b"x")


def test_engines_behind_the_newest_weights_are_refused_naming_engine_version_and_sync(run_dir):
    url = "http://127.0.0.1:4711"
    run_dir.engines.register(EngineRecord(url=url, backend="embedded", id="engine-a", weight_version="0"))
    check_staleness(run_dir, cfg(), {url: "0"})  # nothing published: nothing to be behind
    publish_weights(run_dir, 1, 3)
    with pytest.raises(StaleEngine) as e:
        check_staleness(run_dir, cfg(), {url: "0"})
    assert str(e.value) == (f"engine engine-a ({url}) serves weight version 0, 3 behind the newest published "
                            f"weights/000003 (rollout.max_staleness = 0, implied by rollout.async_mode = off); "
                            f"sync it first: slimectl sync -r {run_dir.path}")
    assert e.value.exit_code == 1
    with pytest.raises(StaleEngine, match=r"engine http://other:1 serves weight version 2, 1 behind .* "
                                          r"\(rollout.max_staleness = 0, implied"):
        check_staleness(run_dir, cfg(), {url: "3", "http://other:1": "2"})
    with pytest.raises(StaleEngine, match=r"serves weight version '3-incomplete', not one of this run's versions "
                                          r"\(newest: weights/000003\); sync it first"):
        check_staleness(run_dir, cfg(), {url: "3-incomplete"})
    check_staleness(run_dir, cfg(), {url: "3"})
    check_staleness(run_dir, cfg(async_mode="one_step_off"), {url: "2"})  # one step off: one behind is the design
    with pytest.raises(StaleEngine, match=r"rollout.max_staleness = 1, implied by rollout.async_mode = one_step_off"):
        check_staleness(run_dir, cfg(async_mode="one_step_off"), {url: "1"})
    check_staleness(run_dir, cfg(max_staleness=3), {url: "0"})
    with pytest.raises(StaleEngine, match=r"\(rollout.max_staleness = 2\); sync"):
        check_staleness(run_dir, cfg(max_staleness=2), {url: "0"})


# ------------------------------------------------------------------------ the run's limit

def publish_rollouts(run, *ids: int) -> None:
    for i in ids:
        with run.rollouts.publish(i) as d:
            (d / "samples.parquet").write_bytes(b"x")


def test_next_stops_at_the_runs_limit_with_a_line_and_exit_0(run_dir, cli, caplog):
    publish_rollouts(run_dir, 0, 1)
    c = run_dir.stage_config("rollout", ["rollout.num_rollout=2", "data.prompt_data=/nonexistent.jsonl"])
    result = run_rollout(run_dir, c)
    assert result.complete and result.path is None and run_dir.rollouts.ids() == [0, 1]
    caplog.clear()
    res = cli("rollout", "-r", run_dir.path, "--next", "--set", "rollout.num_rollout=2",
              "--set", "data.prompt_data=/nonexistent.jsonl")
    assert res.exit_code == 0 and res.stdout == ""  # no artifact path to print
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"the run is complete: all 2 rollouts (rollout.num_rollout) are published, so there is no rollout 2 to make; "
        f"to go on, extend the run: slimectl extend -r {run_dir.path} --num-rollout N"]
    res = cli("rollout", "-r", run_dir.path, "--id", "5", "--set", "rollout.num_rollout=2",
              "--set", "data.prompt_data=/nonexistent.jsonl")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == (
        f"Error: rollout 5 is past the run's end: rollout.num_rollout = 2 (ids 0-1); to go on, extend the run: "
        f"slimectl extend -r {run_dir.path} --num-rollout N")


# ------------------------------------------------------------------------ zero reward spread

def groups(*rewards: list[float]) -> list[list[Sample]]:
    return [[Sample(group_index=g, index=g * 10 + i, tokens=[1, 2], response_length=1, reward=r)
             for i, r in enumerate(rs)] for g, rs in enumerate(rewards)]


def test_zero_spread_share_is_a_metric_and_all_zero_spread_is_warned_about():
    c = cfg(reward="math", n_samples_per_prompt=2)
    mixed = groups([0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0])
    m = rollout_metrics([s for g in mixed for s in g], {}, 1.0, None, mixed, "0")
    assert m["rollout/zero_std_groups"] == 2 and m["rollout/zero_std_group_frac"] == 0.5
    assert zero_spread_warning(c, 4, mixed) is None
    flat = groups([0.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    assert rollout_metrics([s for g in flat for s in g], {}, 1.0, None, flat, "0")["rollout/zero_std_group_frac"] == 1.0
    assert zero_spread_warning(c, 4, flat) == (
        "rollout 4: all 3 groups have zero reward spread (each group's samples got the same reward; rewards seen: 0, 1), "
        "so group-relative advantages are 0 and grpo learns nothing from it; rollout.dynamic_filter=nonzero_std keeps "
        "only groups with spread (slime's dynamic sampling; set rollout.over_sampling_batch_size above batch_size), "
        "or give harder prompts (docs/rewards.md)")
    # nothing earned anything: the reward, not the prompts
    assert zero_spread_warning(c, 4, groups([0.0, 0.0], [0.0, 0.0])).endswith(
        "learns nothing from it; see what reward 'math' grades in docs/rewards.md")
    # every sample solved its prompt, with the filter already on: harder prompts are what is left
    solved = groups([1.0, 1.0], [1.0, 1.0])
    assert zero_spread_warning(cfg(reward="math", n_samples_per_prompt=2, dynamic_filter="nonzero_std"), 4,
                               solved).endswith("rewards seen: 1), so group-relative advantages are 0 and grpo learns "
                                                "nothing from it; give harder prompts (docs/rewards.md)")
    assert zero_spread_warning(cfg(n_samples_per_prompt=1), 0, groups([0.0], [0.0])) is None  # no groups to compare
    # only where zero spread zeroes the advantages
    for algorithm in ({"use_opd": True}, {"reward_normalization": "none"}, {"advantage_estimator": "reinforce_plus_plus"}):
        assert zero_spread_warning(build_config({"rollout": {"n_samples_per_prompt": 2}, "algorithm": algorithm}), 4,
                                   flat) is None, algorithm
    assert zero_spread_warning(build_config({"rollout": {"n_samples_per_prompt": 2},
                                             "algorithm": {"advantage_estimator": "gspo"}}), 4, flat).startswith(
        "rollout 4: all 3 groups have zero reward spread")


# ------------------------------------------------------------------------ one rollout producer

def test_one_place_builds_the_engine_pool_and_the_sampling_parameters_of_rollouts():
    """The one-shot rollout, --follow and eval take their pool, ``args`` and sampling parameters from
    ``RolloutProducer``: no other module of stages/rollout builds a pool or sampling parameters."""
    import ast
    from pathlib import Path

    import slimectl.stages.rollout as pkg

    builders = {"EnginePool", "sampling_params", "SimpleNamespace"}
    found = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in builders:
                found.add((path.name, node.func.id))
    judge = {("judge.py", "EnginePool")}  # the judge group's own pool (rollout.reward: judge), not the rollout's
    assert {name for name, _ in found - judge} == {"producer.py"}, found


def test_the_producer_gives_eval_its_own_sample_count_length_and_temperature(run_dir):
    import asyncio

    from slimectl.stages.rollout.producer import RolloutProducer

    c = run_dir.stage_config("rollout", ["rollout.max_response_len=7", "rollout.temperature=0.9", "rollout.n_samples_per_prompt=4",
                                         "rollout.eval_n_samples=2", "rollout.eval_max_response_len=5",
                                         "rollout.eval_temperature=0.3", "rollout.mask_offpolicy_in_partial_rollout=true"])

    async def opened(producer):
        async with producer as p:
            return p.params, vars(p.args), p.pool.router

    urls = ["http://127.0.0.1:9"]
    params, args, router = asyncio.run(opened(RolloutProducer.for_eval(run_dir, c, urls, None)))
    assert (params["max_new_tokens"], params["temperature"]) == (5, 0.3) and router is None
    assert (args["n_samples_per_prompt"], args["rollout_max_response_len"], args["rollout_id"]) == (2, 5, None)
    assert not args["mask_offpolicy"] and not args["return_routed_experts"]
    params, args, _ = asyncio.run(opened(RolloutProducer(run_dir, c, urls, None, 3)))
    assert (params["max_new_tokens"], params["temperature"]) == (7, 0.9)
    assert (args["n_samples_per_prompt"], args["rollout_max_response_len"], args["rollout_id"]) == (4, 7, 3)
    assert args["mask_offpolicy"] is True
