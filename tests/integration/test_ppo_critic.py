"""PPO with a critic in `slimectl train`: values, GAE, the actor's and the critic's steps,
critic-only warm-up, ``critic_checkpoints/N`` and a bit-exact resume (real Megatron, gloo, one rank).

The rollouts are made up (random response tokens, a reward the critic can learn: the first response
token's parity), so no engine runs. Single-rank trains run in this process; the kill -9 victim is a
subprocess; the TP=2 train runs the command on the session's two_ranks worker."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, write_samples
from tests.helpers import ENV, slimectl_in_process
from tests.integration._cli_rank import slimectl_on_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, fixtures built once, the two_ranks worker shared

PPO = ("algorithm.advantage_estimator=ppo", "critic.lr=1e-2")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from slimectl.contract.samples import Sample, Status
    from slimectl.starter_models.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("ppo")
    model = build_tiny_model("qwen2", root / "model", seed=7, initializer_range=0.1)
    g = torch.Generator().manual_seed(0)
    out = []
    for rid in range(3):
        samples = []
        for idx in range(8):
            prompt = [5 + rid, 6 + idx // 2, 7, 8]
            resp = torch.randint(10, 60, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            s = Sample(group_index=idx // 2, index=idx, rollout_id=rid, tokens=list(prompt), prompt="p")
            s.append_response_tokens(resp, [-1.0] * len(resp), True, {"weight_version": "0"})
            s.status = Status.COMPLETED
            s.reward = float(resp[0] % 2 == 0)
            samples.append(s)
        out.append(samples)
    return model, out


def make_run(tmp_path, model, rolls, *sets):
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={model}", "--set", "rollout.num_rollout=3",
                              "--set", "train.lr=1e-3", "--set", "train.save_interval=1", "--set", "train.keep_checkpoints=5",
                              "--set", "sync.keep_weights=5", "--set", "logging.tensorboard=false",
                              *[x for s in (*PPO, *sets) for x in ("--set", s)])
    assert res.returncode == 0, res.stderr
    run = RunDir.open(tmp_path / "run")
    for rid in range(3):
        with run.rollouts.publish(rid, meta={"weight_version": "0"}) as d:
            write_samples(rolls[rid], d / SAMPLES_FILE)
    return run


def critic_state(run, n):
    """critic_checkpoints/N: {"step", "model": the torch_dist tensors (read without a process group), "files"}."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    art = run.artifacts("critic_checkpoints").get(n)
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(art.path / "state", f"{tmp}/all.pt")
        flat = torch.load(f"{tmp}/all.pt", weights_only=False)  # our own file, just written
    model = {k: v for k, v in flat.items() if k.startswith(("gpt.", "value_head.")) and "_extra_state" not in k}
    return {"step": art.meta["critic_step"], "model": model, "all": flat}


def same_model(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                    for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, rollouts):
    """An uninterrupted 3-rollout PPO train with critic.num_critic_only_steps=1: (train result, run)."""
    model, rolls = rollouts
    run = make_run(tmp_path_factory.mktemp("straight"), model, rolls, "critic.num_critic_only_steps=1")
    return slimectl_in_process("train", "-r", run.path), run


def test_ppo_trains_critic_alone_first_then_both(straight, rollouts):
    from slimectl.contract.metrics import read_metrics

    model, _ = rollouts
    res, run = straight
    assert res.returncode == 0, res.stderr[-3000:]
    assert run.cursor("train").read().consumed == [0, 1, 2]
    assert run.checkpoints.ids() == [1, 2, 3] and run.artifacts("critic_checkpoints").ids() == [1, 2, 3]
    recs = read_metrics(run.metrics_path("train"))
    by_rollout = {}
    for r in recs:
        by_rollout.setdefault(r["train/rollout_id"], []).append(r)
    assert sorted(by_rollout) == [0, 1, 2]
    assert all("train/loss" not in r for r in by_rollout[0])  # rollout 0: the critic only
    assert all("train/loss" in r for r in by_rollout[1] + by_rollout[2])
    firsts = [by_rollout[i][0] for i in range(3)]
    assert all("critic/value_loss" in r and "critic/explained_variance" in r for r in firsts)
    assert firsts[0]["critic/explained_variance"] == 0.0  # V_old = 0 (zero value head): a constant
    assert "value_loss" in res.stderr and "explained_variance" in res.stderr  # the step log line
    # the actor did not move on rollout 0, the critic did
    base = load_file(str(model / "model.safetensors"))
    w1, w2 = (load_file(str(run.weights.get(v).file("model.safetensors"))) for v in (1, 2))
    assert same_model(w1, base) and not same_model(w2, base)
    c1 = critic_state(run, 1)
    assert c1["step"] == 1 and float(c1["model"]["value_head.weight"].abs().sum()) > 0
    assert run.checkpoints.get(1).meta["actor_step"] == 0 and run.checkpoints.get(2).meta["actor_step"] == 1
    print("explained variance by rollout:", [round(r["critic/explained_variance"], 3) for r in firsts])


def test_ppo_resume_is_bit_exact_for_actor_and_critic(tmp_path, rollouts, straight):
    model, rolls = rollouts
    res, one = straight
    assert res.returncode == 0, res.stderr[-3000:]
    split = make_run(tmp_path, model, rolls, "critic.num_critic_only_steps=1")
    first = slimectl_in_process("train", "-r", split.path, "--max-rollouts", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    second = slimectl_in_process("train", "-r", split.path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming at rollout 2, 1 to go" in second.stderr
    a = load_file(str(one.weights.get(3).file("model.safetensors")))
    b = load_file(str(split.weights.get(3).file("model.safetensors")))
    assert same_model(a, b)
    ca, cb = critic_state(one, 3), critic_state(split, 3)
    assert ca["step"] == cb["step"] == 3 and same_model(ca["all"], cb["all"])  # Adam moments too


def test_kill_9_between_critic_and_actor_checkpoint_then_resume(tmp_path, rollouts, straight):
    """Killed after critic_checkpoints/2 is READY and before checkpoints/2 is: the rerun resumes both
    from checkpoint 1 (the orphan critic 2 is rewritten), and ends where the straight run does."""
    model, rolls = rollouts
    res, one = straight
    assert res.returncode == 0, res.stderr[-3000:]
    run = make_run(tmp_path, model, rolls, "critic.num_critic_only_steps=1")
    env = dict(ENV, SLIMECTL_FAULT="train.critic_published:2")
    proc = subprocess.run([sys.executable, "-m", "slimectl", "train", "-r", str(run.path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert run.checkpoints.ids() == [1] and run.artifacts("critic_checkpoints").ids() == [1, 2]
    res = slimectl_in_process("train", "-r", run.path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming at rollout 1, 2 to go" in res.stderr
    assert run.cursor("train").read().consumed == [0, 1, 2]
    a = load_file(str(one.weights.get(3).file("model.safetensors")))
    b = load_file(str(run.weights.get(3).file("model.safetensors")))
    assert same_model(a, b)  # nothing trained twice, nothing skipped
    ca, cb = critic_state(one, 3), critic_state(run, 3)
    assert cb["step"] == 3 and same_model(ca["model"], cb["model"])


def test_ppo_on_several_ranks_is_accepted_but_a_critic_layout_of_its_own_is_refused(run_dir):
    from slimectl.contract.config import build_config

    cfg = build_config({"algorithm": {"advantage_estimator": "ppo"}, "train": {"tp": 2, "pp": 2, "dp": 2}})
    assert cfg.critic.resolved(cfg.train).tp == 2  # the critic takes the actor's layout
    # (a valid config: `rl --launcher ray` runs the critic as its own group; `train` refuses it)
    res = slimectl_in_process("train", "-r", run_dir.path, "--set", "algorithm.advantage_estimator=ppo",
                              "--set", "critic.tp=2")
    assert res.returncode == 2
    assert ("critic.tp x critic.pp x critic.dp = 2 x 1 x 1: outside Ray the critic runs on the actor's ranks and "
            "layout (train.tp x train.pp x train.dp = 1 x 1 x 1)") in res.stderr
    assert "`slimectl rl --launcher ray`" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_rl_with_ppo_runs_three_rollouts_and_logs_the_critic(tmp_path):
    from tests.helpers import assert_trained_once, read_jsonl, write_config

    cfg = write_config(tmp_path, algorithm={"advantage_estimator": "ppo"}, critic={"lr": 1e-2})
    res = slimectl_in_process("rl", "-c", cfg, "-r", tmp_path / "run", "--tiny-model", "qwen2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "trained rollouts 0-2; weight version 3" in res.stdout
    run = RunDir.open(tmp_path / "run")
    assert_trained_once(run, 3)
    assert run.artifacts("critic_checkpoints").ids() == run.checkpoints.ids()[-len(run.artifacts("critic_checkpoints").ids()):]
    recs = [r for r in read_jsonl(run.metrics_path("train")) if "critic/explained_variance" in r]
    assert [r["train/rollout_id"] for r in recs] == [0, 1, 2]
    assert all("critic/value_loss" in r and "train/loss" in r for r in recs)


def test_a_pickle_payload_in_a_critic_checkpoint_is_refused_and_runs_nothing(tmp_path):
    import pickle

    from slimectl.backends.megatron.critic_trainer import read_critic_state
    from slimectl.contract.errors import SlimectlError

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            import os
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "critic.pt"
    with open(bad, "wb") as f:
        pickle.dump({"model": Payload()}, f)
    with pytest.raises(SlimectlError, match="cannot be loaded safely"):
        read_critic_state(bad)
    assert not marker.exists()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SlimectlError, match="cannot be loaded safely"):
        read_critic_state(tmp_path / "junk.pt")


def test_ppo_train_on_two_tp_ranks_matches_one_process(tmp_path, rollouts, straight, two_ranks):
    """`slimectl train` with ppo and train.tp=2 on two gloo ranks of torchrun, as its relaunch runs it (the
    session's two_ranks worker runs the command on both ranks: tests/integration/_cli_rank.py): the critic
    is sharded like the actor, its metrics and the published weights match the one-process run, and its
    torch_dist checkpoint resumes at train.tp=1. (Last in this module: the two ranks stay up for
    test_routing_replay.py's expert-parallel test.)"""
    from slimectl.contract.metrics import read_metrics

    model, rolls = rollouts
    res, one = straight
    assert res.returncode == 0, res.stderr[-3000:]
    run = make_run(tmp_path, model, rolls, "critic.num_critic_only_steps=1", "train.tp=2")
    ranks = slimectl_on_ranks(two_ranks, "train", "-r", run.path, "--max-rollouts", "2")
    assert [r["code"] for r in ranks] == [0, 0], [r["stderr"][-3000:] for r in ranks]
    assert "value_loss" in ranks[0]["stderr"]  # rank 0's step log line
    assert run.cursor("train").read().consumed == [0, 1]
    got = [r for r in read_metrics(run.metrics_path("train")) if "critic/value_loss" in r]
    want = [r for r in read_metrics(one.metrics_path("train")) if "critic/value_loss" in r][:len(got)]
    assert [r["train/rollout_id"] for r in got] == [0, 1]
    for g, w in zip(got, want, strict=True):
        for k in ("critic/value_loss", "critic/value_clipfrac", "critic/explained_variance", "critic/values_mean"):
            if k in w:
                assert g[k] == pytest.approx(w[k], abs=1e-4), k
        assert g["critic/grad_norm"] == pytest.approx(w["critic/grad_norm"], rel=1e-4)
    a = load_file(str(one.weights.get(2).file("model.safetensors")))
    b = load_file(str(run.weights.get(2).file("model.safetensors")))
    assert set(a) == set(b) and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-4
    assert critic_state(run, 2)["step"] == 2 and critic_state(one, 2)["step"] == 2
    # the TP=2 critic checkpoint (torch_dist) resumes on one process: rollout 2 ends where the straight run does
    res = slimectl_in_process("train", "-r", run.path, "--set", "train.tp=1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming at rollout 2, 1 to go" in res.stderr
    ca, cb = critic_state(one, 3), critic_state(run, 3)
    assert ca["step"] == cb["step"] == 3 and set(ca["model"]) == set(cb["model"])
    assert max(float((ca["model"][k] - cb["model"][k]).abs().max()) for k in ca["model"]) <= 1e-4
    a = load_file(str(one.weights.get(3).file("model.safetensors")))
    b = load_file(str(run.weights.get(3).file("model.safetensors")))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-4
