"""slimectl.backends.megatron.actor: MegatronActor on rollouts from the embedded engine (TP=1, CPU).

The one-rank check (tests/scripts/train_actor_check.py) runs once in this process
(tests.helpers.run_script_in_process: Megatron's CPU shim applied once per session) and several
tests share its RESULT; the two-rank checks (TP, DP, PP) run one after another on the session's
long-lived two_ranks worker (tests/integration/conftest.py: one torchrun launch for all of them).
The two-rank tests come first and the pure ones last, so the ranks stay up from the previous module.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest

from slimectl.algorithms.rewards import normalize_rewards_by_group
from slimectl.backends.megatron.lr_schedule import lr_scheduler
from slimectl.contract.config import build_config
from slimectl.contract.config_schema import TrainSection
from slimectl.contract.errors import ConfigError
from tests.helpers import SCRIPTS, run_script_in_process

pytestmark = pytest.mark.xdist_group("two_ranks")  # xdist: one worker, one two_ranks launch

SCRIPT = SCRIPTS / "train_actor_check.py"
PROMPTS = ["one two three", "the cat sat on", "2 + 2 =", "why is the sky"]
PER_GROUP, NEW_TOKENS = 2, 12
REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.9]  # every group has a non-zero std


# ----------------------------------------------------------------------------- Megatron run


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from slimectl.engines.embedded.requests import GenRequest
    from slimectl.engines.embedded.sampling_params import SamplingParams
    from slimectl.engines.embedded.scheduler import GenerationScheduler
    from slimectl.starter_models.tiny_models import build_tiny_model

    d = tmp_path_factory.mktemp("train_actor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_dir = build_tiny_model("qwen2", d / "qwen2", seed=3, vocab_size=300, initializer_range=0.1)
    scheduler = GenerationScheduler(str(model_dir))
    scheduler.start()
    try:
        tok = scheduler.tokenizer
        reqs = [(g, tok.encode(p)) for g, p in enumerate(PROMPTS) for _ in range(PER_GROUP)]
        futs = [scheduler.submit(GenRequest(f"r{i}", ids, SamplingParams(
            max_new_tokens=NEW_TOKENS, temperature=1.0, sampling_seed=200 + i, ignore_eos=True), return_logprob=True))
            for i, (_, ids) in enumerate(reqs)]
        outs = [f.result(timeout=120) for f in futs]
    finally:
        scheduler.stop()
    samples = [{"group_index": g, "index": i, "tokens": ids + list(o.output_ids), "response_length": len(o.output_ids),
                "rollout_log_probs": list(o.output_token_logprobs), "reward": REWARDS[i]}
               for i, ((g, ids), o) in enumerate(zip(reqs, outs))]
    path = d / "samples.json"
    path.write_text(json.dumps(samples))
    res = run_check(model_dir, path, tp=1)
    res["_paths"] = (str(model_dir), str(path))
    return res


def run_check(model_dir, samples_json, tp: int, dp: int = 1, pp: int = 1, ranks=None,
              parts: str = "grpo,sft,accum,multi,resume") -> dict:
    """The check on one rank (in this process) or on RANKS (the session's two_ranks worker); PARTS:
    the script's parts to run (a two-rank run computes only what its test compares)."""
    args = [str(SCRIPT), str(model_dir), str(samples_json), str(tp), str(pp), parts]
    if tp * dp * pp == 1:
        proc = run_script_in_process(*args)
    else:
        assert ranks.nproc == tp * dp * pp
        proc = ranks.run(*args)
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    print(f"tp={tp} dp={dp} pp={pp}", {k: round(v["seconds"], 2) for k, v in res.items() if isinstance(v, dict)},
          "import", round(res["import_s"], 2), "total", round(res["total_s"], 2))
    return res


KEYS = {"train/loss", "train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/kl_loss", "train/entropy",
        "train/grad_norm", "train/lr", "train/train_rollout_logprob_abs_diff", "train/tis", "perf/train_time",
        "perf/tokens_per_s"}


def test_tp2_matches_tp1(result, two_ranks):
    """(The two-rank tests come first in this module: the two ranks are still up from
    test_routing_replay.py's expert-parallel test.)"""
    tp2 = run_check(*result["_paths"], tp=2, ranks=two_ranks, parts="grpo,sft,accum")
    m1, m2 = result["grpo"]["step0"][0], tp2["grpo"]["step0"][0]
    assert m2["train/train_rollout_logprob_abs_diff"] <= 1e-4 and m2["train/kl_loss"] == 0.0
    assert abs(m2["train/ppo_kl"]) < 1e-6 and m2["train/pg_clipfrac"] == 0.0
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert tp2["grpo"]["pos_delta"] == pytest.approx(result["grpo"]["pos_delta"], abs=1e-4)
    assert tp2["sft"]["loss"] == pytest.approx(result["sft"]["loss"], abs=1e-4)
    assert tp2["accum"]["max_weight_diff"] <= 1e-5
    assert tp2["grpo"]["hf_count"] == result["grpo"]["hf_count"]


@pytest.mark.parametrize("axis", ["dp", "pp"])
def test_two_ranks_match_one(result, axis, two_ranks):
    """Two data-parallel ranks (each packing half of every global batch) or two pipeline stages
    (Megatron's 1F1B schedule over packed micro-batches of different lengths, tied embeddings
    split between first and last stage), torchrun over gloo, train exactly like one rank: same
    losses and metrics, gradient norm and resulting log-probs, and the whole model comes back to
    rank 0 as HF tensors."""
    two = run_check(*result["_paths"], tp=1, **{axis: 2}, ranks=two_ranks, parts="grpo,sft,accum,multi")
    m1, m2 = result["grpo"]["step0"][0], two["grpo"]["step0"][0]
    for k in ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy", "train/ppo_kl", "train/pg_clipfrac",
              "train/train_rollout_logprob_abs_diff", "train/tis"):
        assert m2[k] == pytest.approx(m1[k], abs=1e-5), k
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert two["grpo"]["step1"][0]["train/loss"] == pytest.approx(result["grpo"]["step1"][0]["train/loss"], abs=1e-5)
    assert two["grpo"]["delta"] == pytest.approx(result["grpo"]["delta"], abs=1e-4)
    assert two["grpo"]["ref_moved"] == 0.0
    assert two["sft"]["loss"] == pytest.approx(result["sft"]["loss"], abs=1e-4)
    # micro-batches per rank: the pipeline runs both; each data-parallel rank packs its half into one
    assert two["accum"]["two"]["train/num_micro_batches"] == (2.0 if axis == "pp" else 1.0)
    assert two["accum"]["max_weight_diff"] <= 1e-5 and two["accum"]["max_weight_move"] > 0
    assert two["grpo"]["hf_count"] == result["grpo"]["hf_count"] and two["grpo"]["hf_keys"] == result["grpo"]["hf_keys"]
    assert [m["train/loss"] for m in two["multi"]["metrics"]] == pytest.approx(
        [m["train/loss"] for m in result["multi"]["metrics"]], abs=1e-5)  # per-token loss, 2 steps per rollout


def test_grpo_step0_invariants(result):
    g = result["grpo"]
    (m,) = g["step0"]
    print({k: m[k] for k in sorted(KEYS)})
    assert KEYS <= set(m)
    assert m["train/train_rollout_logprob_abs_diff"] <= 1e-4
    assert abs(m["train/ppo_kl"]) < 1e-6 and m["train/pg_clipfrac"] == 0.0
    assert m["train/kl_loss"] == 0.0 and g["ref_eq_actor_before"] == 0.0  # ref == actor before any update
    assert abs(m["train/tis"] - 1.0) < 1e-3
    assert m["train/grad_norm"] > 0 and m["train/lr"] == 1e-3 and m["train/entropy"] > 0
    assert m["perf/tokens_per_s"] > 0


def test_grpo_step_moves_logprobs_and_ref_stays(result):
    g = result["grpo"]
    print("pos_delta", g["pos_delta"], "neg_delta", g["neg_delta"])
    assert g["pos_delta"] > 0 and g["neg_delta"] < 0
    assert g["ref_moved"] == 0.0  # the reference is frozen
    (m1,) = g["step1"]
    assert m1["train/kl_loss"] > 0  # actor moved away from the reference
    assert m1["train/train_rollout_logprob_abs_diff"] > 1e-4  # rollout log-probs are now stale
    assert g["hf_count"] > 0 and all(k.startswith("model.") or k == "lm_head.weight" for k in g["hf_keys"])


def test_sft_loss_decreases(result):
    loss = result["sft"]["loss"]
    print("sft loss", loss)
    assert all(b < a for a, b in itertools.pairwise(loss))
    assert loss[-1] < loss[0] - 0.05


def test_gradient_accumulation_matches_single_micro_batch(result):
    a = result["accum"]
    print("budget", a["budget"], "max weight diff", a["max_weight_diff"], "max move", a["max_weight_move"])
    assert a["one"]["train/num_micro_batches"] == 1 and a["two"]["train/num_micro_batches"] == 2
    assert abs(a["one"]["train/loss"] - a["two"]["train/loss"]) < 1e-6
    assert a["one"]["train/grad_norm"] == pytest.approx(a["two"]["train/grad_norm"], rel=1e-5)
    assert a["max_weight_move"] > 1e-4  # the step did update the weights
    assert a["max_weight_diff"] <= 1e-5


def test_two_steps_per_rollout_per_token_loss_and_schedule(result):
    ms = result["multi"]["metrics"]
    assert len(ms) == 4  # 2 calls x num_steps_per_rollout=2
    assert [m["train/step"] for m in ms] == [1.0, 2.0, 3.0, 4.0]
    # Megatron's schedule: warm-up over 1 step from 0 (the first update runs at LR 0) to 1e-3, then
    # cosine to min_lr 1e-4 at total_steps=3
    assert [round(m["train/lr"], 7) for m in ms] == [0.0, 1e-3, 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi / 2)), 1e-4]
    m0 = ms[0]
    assert abs(m0["train/ppo_kl"]) < 1e-6 and m0["train/pg_clipfrac"] == 0.0
    assert abs(ms[1]["train/ppo_kl"]) < 1e-6  # the LR-0 step left the weights where they were
    assert ms[3]["train/ppo_kl"] != 0.0  # second step of a rollout is off-policy (old log-probs fixed)
    # a fresh actor resumed from the checkpoint saved after the first call continues the schedule
    assert [m["train/lr"] for m in result["multi"]["resumed"]] == [m["train/lr"] for m in ms[2:]]
    assert [m["train/loss"] for m in result["multi"]["resumed"]] == [m["train/loss"] for m in ms[2:]]
    assert all(m["train/entropy"] > 0 and m["train/grad_norm"] > 0 for m in ms)


def test_checkpoint_restores_every_random_generator(result, tmp_path):
    proc = run_script_in_process(SCRIPTS / "actor_rng_check.py", result["_paths"][0], tmp_path / "state")
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])
    assert res["loaded"] == res["saved"]  # python, torch CPU and Megatron's tracker continue exactly
    assert len(set(res["saved"])) == len(res["saved"])


# ----------------------------------------------------------------------------- pure helpers


class _Groups:
    """What megatron-core's scheduler touches of an optimizer: its param groups."""

    def __init__(self):
        self.param_groups = [{"wd_mult": 1.0}, {"wd_mult": 0.0}]  # Megatron's: decayed / biases and norms


def lrs(n: int, total_steps=None, **train) -> list[float]:
    """The LR of optimizer steps 0..n-1 (each step a successful update)."""
    opt = _Groups()
    sched = lr_scheduler(opt, TrainSection(**train), total_steps)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        sched.step(1)
    return out


def test_lr_schedule_is_megatrons():
    assert lrs(3, lr=1e-3) == [1e-3] * 3
    # warm-up: LR = lr * n / warmup at update count n <= warmup, so the first update runs at 0
    assert lrs(6, lr=1.0, lr_warmup_steps=4) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    # linear to min_lr 0.1 at step 10: 0.1 + (1 - 4/10) * 0.9 = 0.64 at step 4; min_lr from 10 on
    lin = lrs(12, 10, lr=1.0, min_lr=0.1, lr_decay_style="linear")
    assert lin[4] == pytest.approx(0.64) and lin[10] == lin[11] == pytest.approx(0.1)
    # cosine: 0.5 * (1 + cos(pi * 5/10)) = 0.5 at step 5
    cos = lrs(12, 10, lr=1.0, lr_decay_style="cosine")
    assert cos[5] == pytest.approx(0.5) and cos[11] == 0.0
    # warm-up 2 then cosine over steps 2..6: 0.1 + 0.5 * (1 + cos(pi * (n - 2)/4)) * 0.9 at step n
    assert lrs(5, 6, lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay_style="cosine") == pytest.approx(
        [0.0, 0.5, 1.0, 0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9, 0.1 + 0.5 * (1 + math.cos(math.pi / 2)) * 0.9])
    with pytest.raises(ConfigError, match="decay horizon"):
        lrs(1, None, lr=1.0, lr_decay_style="cosine")
    with pytest.raises(ConfigError, match="lr_warmup_steps"):  # Megatron needs warm-up < decay horizon
        lrs(1, 3, lr=1.0, lr_warmup_steps=3, lr_decay_style="linear")
    assert lrs(2, 3, lr=1.0, lr_warmup_steps=3) == [0.0, 1 / 3]  # a constant LR has no horizon
    # the config refuses it up front
    with pytest.raises(ConfigError, match=r"train.lr_warmup_steps \(6\) must be below the run's 6 optimizer steps"):
        build_config({"rollout": {"num_rollout": 3}, "train": {"num_steps_per_rollout": 2, "lr_warmup_steps": 6,
                                                                "lr_decay_style": "cosine"}})


def test_lr_scheduler_sets_megatrons_weight_decay_per_group():
    opt = _Groups()
    lr_scheduler(opt, TrainSection(lr=1e-3, weight_decay=0.1), None)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on biases and norms


def test_group_normalized_rewards_uneven_groups():
    from slimectl.contract.samples import Sample

    s = [Sample(group_index=g, reward=r) for g, r in [(0, 1.0), (0, 0.0), (1, 2.0), (1, 2.0), (1, 5.0), (2, 3.0)]]
    raw, ids = [x.reward_value(None) for x in s], [x.group_index for x in s]
    r = normalize_rewards_by_group(raw, ids, "group_mean_std").tolist()
    assert r[0] == pytest.approx(0.7071, abs=1e-3) and r[1] == pytest.approx(-0.7071, abs=1e-3)
    assert sum(r[2:5]) == pytest.approx(0.0, abs=1e-6) and r[4] > 0 and r[5] == 0.0
    assert normalize_rewards_by_group(raw, ids, "none").tolist() == [1.0, 0.0, 2.0, 2.0, 5.0, 3.0]
