"""Where rollout meets the other stages, on a real embedded engine with a tiny model: the dataset is
checked before any engine, an engine behind the newest weights is refused until `slimectl sync`,
`--next` stops at the run's end, and a rollout whose groups all have zero reward spread says so."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from slimectl.contract.rundir import EngineRecord, RunDir
from slimectl.contract.samples import SAMPLES_FILE, read_samples
from tests.helpers import slimectl_in_process, start_engine, wait_healthy

pytestmark = pytest.mark.xdist_group("rollout_joints")  # xdist: one worker, fixtures built once


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("joints")
    model = build_tiny_model("qwen2", root / "model", seed=5)
    data = root / "arith.jsonl"
    data.write_text("".join(json.dumps({"input": f"What is {a} + 1?", "label": str(a + 1)}) + "\n" for a in range(8)))
    proc, url = start_engine(model, root / "engine.log")
    wait_healthy(url)
    yield {"model": model, "data": data, "url": url, "pid": proc.pid}
    proc.kill()
    proc.wait()


def make_run(tmp_path, setup, cli, *sets) -> RunDir:
    res = cli("init", tmp_path / "run", "--set", f"model.path={setup['model']}", "--set",
              f"data.prompt_data={setup['data']}", "--set", "rollout.reward=random", "--set", "rollout.batch_size=2",
              "--set", "rollout.n_samples_per_prompt=2", "--set", "rollout.max_response_len=4",
              "--set", "logging.tensorboard=false", *[x for s in sets for x in ("--set", s)])
    assert res.exit_code == 0, res.output
    run = RunDir.open(tmp_path / "run")
    run.engines.register(EngineRecord(url=setup["url"], backend="embedded", pid=setup["pid"], id="e0",
                                      weight_version="0"))
    return run


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slimectl.rollout" and r.levelno >= logging.WARNING]


def last_line(res) -> str:
    return res.output.strip().splitlines()[-1]


def test_a_dataset_without_labels_is_refused_before_any_engine_by_rollout_and_rl(tmp_path, setup, cli):
    nolabel = tmp_path / "nolabel.jsonl"
    nolabel.write_text(json.dumps({"input": "What is 1 + 1?", "answer": "2"}) + "\n")
    run = make_run(tmp_path, setup, cli, "rollout.reward=math", f"data.prompt_data={nolabel}")
    want = (f"prompt dataset {nolabel}: key 'label' (data.label_key) is in no row, but reward 'math' grades against a "
            f"label; its rows have keys: input, answer; set the answer's key with --set data.label_key=KEY")
    res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 2 and last_line(res) == f"Error: {want}"
    assert run.rollouts.ids() == []
    # rl checks it before it starts a trainer or any engine of its own
    run.engines.unregister("e0")
    res = slimectl_in_process("rl", "-r", run.path)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == f"Error: {want}"
    assert "started engine" not in res.stderr and not list((run.path / "logs").glob("engine-*.log"))
    assert run.engines.list() == [] and run.rollouts.ids() == [] and run.checkpoints.ids() == []
    # the key named in the line is the fix
    res = cli("rollout", "-r", run.path, "--engine-url", setup["url"], "--set", "data.label_key=answer")
    assert res.exit_code == 0, res.output
    assert {s.label for s in read_samples(run.rollouts.get(0).file(SAMPLES_FILE))} == {"2"}


def test_every_group_without_reward_spread_is_warned_about_and_measured(tmp_path, setup, cli, caplog):
    # A tiny random model never writes \boxed{}: math gives every sample 0.
    run = make_run(tmp_path, setup, cli, "rollout.reward=math")
    with caplog.at_level(logging.WARNING, logger="slimectl.rollout"):
        res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 0, res.output
    metrics = json.loads(run.rollouts.get(0).file("metrics.json").read_text())
    assert metrics["rollout/zero_std_group_frac"] == 1.0 and metrics["rollout/zero_std_groups"] == 2
    assert warnings(caplog) == [
        "rollout 0: all 2 groups have zero reward spread (each group's samples got the same reward; rewards seen: 0), "
        "so group-relative advantages are 0 and grpo learns nothing from it; see what reward 'math' grades in "
        "docs/rewards.md"]


def test_next_stops_at_the_runs_end_with_a_line(tmp_path, setup, cli, caplog):
    run = make_run(tmp_path, setup, cli, "rollout.num_rollout=1")
    assert cli("rollout", "-r", run.path, "--next").exit_code == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slimectl.rollout"):
        res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 0 and res.stdout == "" and run.rollouts.ids() == [0]
    assert warnings(caplog) == [
        f"the run is complete: all 1 rollouts (rollout.num_rollout) are published, so there is no rollout 1 to make; "
        f"to go on, extend the run: slimectl extend -r {run.path} --num-rollout N"]
    # raising the limit is the way on
    res = cli("rollout", "-r", run.path, "--next", "--set", "rollout.num_rollout=2")
    assert res.exit_code == 0 and run.rollouts.ids() == [0, 1]


def test_an_engine_behind_the_newest_weights_is_refused_until_synced(tmp_path, setup, cli):
    run = make_run(tmp_path, setup, cli)
    assert cli("rollout", "-r", run.path, "--next").exit_code == 0  # no weights published yet: v0 is current
    with run.weights.publish(1, meta={"weight_version": 1}) as d:  # what `train` publishes after rollout 0
        for f in setup["model"].iterdir():
            shutil.copy(f, d / f.name)
    res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 1 and last_line(res) == (
        f"Error: engine e0 ({setup['url']}) serves weight version 0, 1 behind the newest published weights/000001 "
        f"(rollout.max_staleness = 0, implied by rollout.async_mode = off); sync it first: slimectl sync -r {run.path}")
    assert run.rollouts.ids() == [0]
    # one step off may run one version behind
    res = cli("rollout", "-r", run.path, "--next", "--set", "rollout.async_mode=one_step_off")
    assert res.exit_code == 0, res.output
    assert {s.weight_versions[0] for s in read_samples(run.rollouts.get(1).file(SAMPLES_FILE))} == {"0"}
    # the command in the line brings the engine up to date
    assert cli("sync", "-r", run.path).exit_code == 0
    res = cli("rollout", "-r", run.path, "--next")
    assert res.exit_code == 0, res.output
    assert {s.weight_versions[0] for s in read_samples(run.rollouts.get(2).file(SAMPLES_FILE))} == {"1"}
