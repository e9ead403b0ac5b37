"""`slimectl extend`: one way to change a run's length, honoured by rollout, train, rl and status."""

from __future__ import annotations

import json

import yaml

from slimectl.contract.rundir import RunDir


def _produce(run: RunDir, n_rollouts: int, n_trained: int) -> None:
    for i in range(n_rollouts):
        with run.rollouts.publish(i, meta={"weight_version": 0}) as d:
            (d / "samples.jsonl").write_text("{}\n")
    with run.lock("train") as lock:
        for i in range(n_trained):
            run.cursor("train").commit(i, lock=lock)


def test_extend_is_recorded_atomically_and_every_stage_reads_it(cli, run_dir):
    _produce(run_dir, 3, 2)
    res = cli("extend", "-r", run_dir.path, "--num-rollout", "25")
    assert res.exit_code == 0, res.output
    assert f"{run_dir.path}: 10 -> 25 rollouts (3 produced, 2 trained)" in res.output
    rec = json.loads((run_dir.path / "extend.json").read_text())
    assert rec["num_rollout"] == 25 and rec["previous"] == 10 and rec["frozen"] == 10
    assert not list(run_dir.path.glob("extend.json.*"))  # no temp file left behind
    assert run_dir.config().rollout.num_rollout == 10  # config.yaml stays frozen (and its fingerprint valid)
    for stage in (("rollout",), ("train",), ("rl",), ("sync",), ("rollout", "import", "x.jsonl")):
        out = cli(*stage, "-r", run_dir.path, "--dry-run")
        assert out.exit_code == 0, (stage, out.output)
        assert yaml.safe_load(out.output)["rollout"]["num_rollout"] == 25, stage
    # an explicit --set of this invocation still wins, for it alone
    out = cli("rollout", "-r", run_dir.path, "--dry-run", "--set", "rollout.num_rollout=4")
    assert yaml.safe_load(out.output)["rollout"]["num_rollout"] == 4
    lines = cli("status", "-r", run_dir.path, "--no-probe").output.splitlines()
    assert "extended   to 25 rollouts by `slimectl extend` (extend.json; config.yaml says 10)" in lines
    assert "training   trained through rollout 1 (2 of 25 rollouts); next to train: rollout 2" in lines
    st = json.loads(cli("status", "-r", run_dir.path, "--no-probe", "--json").output)
    assert st["training"]["num_rollout"] == 25 and st["config"]["num_rollout_from"] == "extend.json"
    again = cli("extend", "-r", run_dir.path, "--num-rollout", "30")
    assert again.exit_code == 0 and "25 -> 30 rollouts" in again.output
    rec = json.loads((run_dir.path / "extend.json").read_text())
    assert rec["num_rollout"] == 30 and rec["previous"] == 25 and [h["num_rollout"] for h in rec["history"]] == [25]


def test_extend_below_what_was_produced_or_trained_is_refused_with_exit_2(cli, run_dir):
    _produce(run_dir, 5, 4)
    res = cli("extend", "-r", run_dir.path, "--num-rollout", "3")
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == (
        f"Error: --num-rollout 3 is below what run {run_dir.path} already has: 5 produced (ids 0-4) and 4 trained "
        f"rollouts; pass --num-rollout 5 or more")
    assert not (run_dir.path / "extend.json").exists()
    shorter = cli("extend", "-r", run_dir.path, "--num-rollout", "5")  # shorter than config.yaml's 10, but not too short
    assert shorter.exit_code == 0 and "10 -> 5 rollouts" in shorter.output
    same = cli("extend", "-r", run_dir.path, "--num-rollout", "5")
    assert same.exit_code == 0 and "already 5 rollouts; nothing changed" in same.output


def test_train_and_rollout_hints_point_to_extend(cli, run_dir):
    _produce(run_dir, 10, 10)
    with run_dir.checkpoints.publish(10, meta={"source": "train", "next_rollout": 10}) as d:
        (d / "model.bin").write_bytes(b"x")
    res = cli("train", "-r", run_dir.path)
    assert res.exit_code == 2
    assert (f"all 10 rollouts (rollout.num_rollout) are trained; extend the run with "
            f"`slimectl extend -r {run_dir.path} --num-rollout N` or pass --allow-empty") in res.output
    res = cli("rollout", "-r", run_dir.path, "--id", "10", "--set", "data.prompt_data=/x.jsonl")
    assert res.exit_code == 2 and f"extend the run: slimectl extend -r {run_dir.path} --num-rollout N" in res.output
    assert cli("extend", "-r", run_dir.path, "--num-rollout", "12").exit_code == 0
    res = cli("train", "-r", run_dir.path)  # now past the end of the old length: rollout 10 is next
    assert res.exit_code == 1 and "rollouts/000010 is not published yet" in res.output
