"""slimectl train with stale samples (real Megatron, gloo, one rank in this process): the staleness filter's
dropped groups contribute no gradient, and the decoupled objective trains through the actor.

Two rollouts of 4 groups of 2 from the embedded engine's scheduler. Rollout 0 was sampled at version 0 and
trained at version 0; rollout 1 is trained at version 1, its groups 0 and 1 sampled at version 1 and its
groups 2 and 3 at version 0: staleness 1, beyond the default bound of rollout.async_mode off (0).
"""

from __future__ import annotations

import dataclasses

import pytest
from safetensors.torch import load_file

from slimectl.contract.metrics import read_metrics
from slimectl.contract.rundir import RunDir
from slimectl.contract.samples import SAMPLES_FILE, write_samples
from tests.helpers import scheduler_rollouts, slimectl_in_process

STALE_GROUPS = (2, 3)
DECOUPLED = ("algorithm.use_decoupled_loss=true", "algorithm.behav_imp_weight_cap=2.0")


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    model = build_tiny_model("qwen2", tmp_path_factory.mktemp("staleness") / "model", seed=7, initializer_range=0.1)
    return model, scheduler_rollouts(model, 2, lambda rid, g: "0" if rid == 0 or g in STALE_GROUPS else "1")


def train(tmp_path, model, rolls, *sets) -> RunDir:
    res = slimectl_in_process("init", tmp_path / "run", "--set", f"model.path={model}", "--set", "rollout.num_rollout=2",
                              "--set", "train.lr=1e-2", "--set", "logging.tensorboard=false",
                              *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 0, res.stderr
    run = RunDir.open(tmp_path / "run")
    for rid, samples in enumerate(rolls):
        with run.rollouts.publish(rid, meta={"weight_version": samples[0].weight_versions[0]}) as d:
            write_samples(samples, d / SAMPLES_FILE)
    res = slimectl_in_process("train", "-r", run.path)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def weights(run: RunDir):
    return load_file(str(run.weights.get(2).file("model.safetensors")))


def test_dropped_groups_contribute_no_gradient(tmp_path, rollouts):
    """Under drop the stale groups' samples train like samples whose loss mask is all zero: the same weights
    (bit for bit) as a keep run on a rollout whose stale samples carry loss_mask [0, ...]; kept, they move
    the weights elsewhere. The metrics of rollout 1's step count them."""
    model, (r0, r1) = rollouts
    dropped = train(tmp_path / "drop", model, [r0, r1], "rollout.stale_samples=drop", *DECOUPLED)
    zeroed = [dataclasses.replace(s, loss_mask=[0] * s.response_length) if s.group_index in STALE_GROUPS else s
              for s in r1]
    masked = train(tmp_path / "masked", model, [r0, zeroed], "rollout.stale_samples=keep", *DECOUPLED)
    kept = train(tmp_path / "keep", model, [r0, r1], "rollout.stale_samples=keep", *DECOUPLED)
    a, b, c = weights(dropped), weights(masked), weights(kept)
    assert set(a) == set(b) and all(bool((a[k] == b[k]).all()) for k in a)
    assert max(float((a[k] - c[k]).abs().max()) for k in a) > 1e-6

    m0, m1 = read_metrics(dropped.metrics_path("train"))
    assert (m0["train/rollout_id"], m1["train/rollout_id"]) == (0, 1)
    assert m0["train/staleness_max"] == 0.0 and m0["rollout/stale_dropped"] == 0.0
    # rollout 1 at version 1: 4 of its 8 samples sampled at version 0
    assert (m1["train/staleness_mean"], m1["train/staleness_max"], m1["train/stale_samples"],
            m1["rollout/stale_dropped"]) == (0.5, 1.0, 4.0, 4.0)
    k1 = read_metrics(kept.metrics_path("train"))[1]
    assert (k1["train/stale_samples"], k1["rollout/stale_dropped"]) == (4.0, 0.0)
    # the decoupled objective ran: its behaviour weight about 1 on rollout 0 (the engine's weights were the
    # trainer's), off 1 on rollout 1 (every sample of it came from the initial weights, the trainer is a step on)
    assert abs(m0["train/behav_imp_weight"] - 1.0) < 1e-3 and m0["train/tis_clipfrac"] == 0.0
    assert abs(k1["train/tis"] - 1.0) > 1e-3
