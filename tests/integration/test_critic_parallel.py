"""PPO's critic (MegatronCritic) on the actor's layouts: TP=2, DP=2 and PP=2 match one rank.

tests/scripts/critic_check.py runs once in this process (one rank: the reference) and once per layout on the
session's two_ranks worker (tests/integration/conftest.py): the values of every response token before and
after training, three critic steps (one on a global batch of 8, then two of 4, several packed micro-batches
each, loss-masked tokens) and the whole trained critic gathered to rank 0 (TP shards, pipeline stages, value
head) must agree within 1e-5. The TP=2 run saves its torch_dist checkpoint after the first step; resumed at
TP=1 and at PP=2 it continues exactly as the one-rank run does (Adam moments, LR schedule, step).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from tests.helpers import SCRIPTS, run_script_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, one two_ranks launch

SCRIPT = SCRIPTS / "critic_check.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from slimectl.starter_models.tiny_models import build_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_model("qwen2", tmp_path_factory.mktemp("critic_parallel") / "qwen2", seed=3,
                                vocab_size=300, initializer_range=0.1)


def run_check(model_dir, out_pt, tp: int = 1, pp: int = 1, ranks=None, save=None, load=None) -> tuple[dict, dict]:
    args = [str(SCRIPT), str(model_dir), str(out_pt), str(tp), str(pp), str(save or "-"), *([str(load)] if load else [])]
    proc = run_script_in_process(*args) if ranks is None else ranks.run(*args)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), torch.load(out_pt, weights_only=True)


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory):
    return run_check(model_dir, tmp_path_factory.mktemp("critic_one") / "critic.pt")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_one_rank_critic_trains(one_rank, model_dir):
    from safetensors.torch import load_file

    res, weights = one_rank
    first = res["step"][0]
    assert first["critic/value_clipfrac"] == 0.0 and first["critic/value_loss"] > 0  # V == V_old at the first step
    assert [m["critic/step"] for m in res["step"] + res["steps2"]] == [1.0, 2.0, 3.0]
    assert max_diff(res["values1"], res["values0"]) > 1e-3  # the step moved the values
    init = load_file(str(model_dir / "model.safetensors"))
    moved = max(float((weights[k] - init[k]).abs().max()) for k in init if k in weights)
    assert moved > 1e-5  # the trunk learns too (the head is non-zero)
    assert "lm_head.weight" not in weights and {"value_head.weight", "value_head.bias"} <= set(weights)


@pytest.fixture(scope="module")
def two_rank_runs(model_dir, tmp_path_factory, two_ranks):
    """{layout: (result, weights, checkpoint dir saved after the first step)}, each run once."""
    cache: dict = {}

    def get(layout: str):
        if layout not in cache:
            d = tmp_path_factory.mktemp(f"critic_{layout}2")
            res, w = run_check(model_dir, d / "critic.pt", tp=2 if layout == "tp" else 1, pp=2 if layout == "pp" else 1,
                               ranks=two_ranks, save=d / "ckpt")
            cache[layout] = (res, w, d / "ckpt")
        return cache[layout]

    return get


def assert_matches(res2, w2, res1, w1, keys=("values0", "values1", "values2")):
    for k in keys:
        assert max_diff(res2[k], res1[k]) <= TOL, k
    steps1 = res1["step"] + res1["steps2"]
    for m2, m1 in zip(res2["step"] + res2["steps2"], steps1[len(steps1) - len(res2["step"] + res2["steps2"]):], strict=True):
        assert m2["critic/value_loss"] == pytest.approx(m1["critic/value_loss"], abs=TOL)
        assert m2["critic/value_clipfrac"] == m1["critic/value_clipfrac"]
        assert m2["critic/grad_norm"] == pytest.approx(m1["critic/grad_norm"], rel=TOL)
        assert m2["critic/step"] == m1["critic/step"]
        assert m2["critic/lr"] == m1["critic/lr"]
    assert sorted(w2) == sorted(w1)
    assert max(float((w2[k] - w1[k]).abs().max()) for k in w1) <= TOL


@pytest.mark.parametrize("layout", ["tp", "dp", "pp"])
def test_two_ranks_match_one(layout, one_rank, two_rank_runs, two_ranks):
    """TP=2 (trunk sharded, head replicated), DP=2 (each rank packs half of every global batch, DDP averages)
    and PP=2 (1F1B schedule, values from the last stage shared) give one rank's values, losses and weights."""
    res2, w2, ckpt = two_rank_runs(layout)
    assert res2["layout"] == {"tp": [1, 2, 1], "dp": [1, 1, 2], "pp": [2, 1, 1]}[layout]
    assert_matches(res2, w2, *one_rank)
    assert (ckpt / "state" / ".metadata").is_file()  # torch_dist, written by both ranks


def test_a_tp2_checkpoint_resumes_at_tp1_and_pp2(one_rank, two_rank_runs, model_dir, tmp_path, two_ranks):
    """The critic's torch_dist checkpoint reshards: saved at TP=2 after the first step, resumed on one rank and
    on two pipeline stages, the next two steps and the weights are the one-rank run's (Adam moments, LR
    schedule and step restored)."""
    _, _, ckpt = two_rank_runs("tp")
    res, w = run_check(model_dir, tmp_path / "one.pt", load=ckpt)
    assert res["step"] == [] and [m["critic/step"] for m in res["steps2"]] == [2.0, 3.0]
    assert_matches(res, w, *one_rank, keys=("values1", "values2"))
    res, w = run_check(model_dir, tmp_path / "pp.pt", pp=2, ranks=two_ranks, load=ckpt)
    assert_matches(res, w, *one_rank, keys=("values1", "values2"))
