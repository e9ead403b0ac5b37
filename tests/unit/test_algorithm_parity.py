"""slime's defaults and switches, the config's refusals, OPSM, IcePop TIS and the custom hooks.

Every expected number is written out by hand (float64); the hooks are real functions in a module
written to tmp_path and imported by the config's loader (contract/imports.py), with slime's signatures.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from slimectl.algorithms.advantages import compute_advantages
from slimectl.algorithms.objective import ObjectiveBatch, compute_objective, slime_args
from slimectl.algorithms.policy_loss import opsm_mask
from slimectl.algorithms.reduce import loss_token_count, token_mean
from slimectl.algorithms.rewards import normalize_group_rewards
from slimectl.algorithms.tis import compute_tis_weights
from slimectl.contract.config import load_config
from slimectl.contract.config_schema import AlgorithmSection
from slimectl.contract.errors import ConfigError

D = torch.float64


def T(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- item 1: defaults


def test_slime_defaults_kl_k1_and_reward_norm_per_estimator():
    a = AlgorithmSection()
    assert a.kl_loss_type == "k1"
    assert a.reward_normalization is None and a.normalize_advantages is None and a.use_unbiased_kl is False
    # the config's null means slime's rule for the estimator
    modes = {e: AlgorithmSection(advantage_estimator=e).effective_reward_normalization for e in
             ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")}
    assert modes == {"grpo": "group_mean_std", "gspo": "group_mean_std", "cispo": "group_mean_std",
                     "reinforce_plus_plus": "none", "reinforce_plus_plus_baseline": "group_mean"}
    assert AlgorithmSection(advantage_estimator="reinforce_plus_plus",
                            reward_normalization="group_mean_std").effective_reward_normalization == "group_mean_std"
    # one group [1, 0, 0, 1]: mean 0.5; unbiased std sqrt(1/3)
    raw = [1.0, 0.0, 0.0, 1.0]
    close(normalize_group_rewards(raw, 4, modes["reinforce_plus_plus"]), raw)
    close(normalize_group_rewards(raw, 4, modes["reinforce_plus_plus_baseline"]), [0.5, -0.5, -0.5, 0.5])
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    close(normalize_group_rewards(raw, 4, modes["grpo"]), [s, -s, -s, s], tol=1e-6)  # float32


def test_normalize_advantages_switch_whitens_grpo_and_can_leave_reinforce_pp_raw():
    mask = T([[1, 1, 0], [1, 0, 0]])
    r = T([1.0, -2.0])
    raw = compute_advantages("grpo", r, mask)  # slime default for grpo: not whitened
    close(raw.advantages, [[1, 1, 0], [-2, 0, 0]])
    white = compute_advantages("grpo", r, mask, normalize_advantages=True)
    # tokens 1, 1, -2: mean 0, var (1+1+4)/3 * 3/2 = 3 -> 1/sqrt(3+1e-8)
    k = 1 / math.sqrt(3 + 1e-8)
    close(white.advantages, [[k, k, 0], [-2 * k, 0, 0]])
    rpp = compute_advantages("reinforce_plus_plus", r, mask, normalize_advantages=False)
    close(rpp.advantages, [[1, 1, 0], [-2, 0, 0]])  # G_t = reward at gamma 1
    close(compute_advantages("reinforce_plus_plus", r, mask).advantages, white.advantages)  # default: whitened


def test_unbiased_kl_weights_the_kl_loss_by_the_ratio():
    mask = T([[1.0, 1.0]])
    lp, old, ref = [[-1.0, -2.0]], [[-1.5, -2.0]], [[-1.2, -1.0]]
    cfg = AlgorithmSection(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1", eps_clip=10.0)
    b = dict(mask=mask, old_log_probs=T(old), advantages=T([[0.0, 0.0]]), ref_log_probs=T(ref))
    _, m = compute_objective(cfg, ObjectiveBatch(log_probs=T(lp, True), **b))
    close(m["train/kl_loss"], ((-1.0 + 1.2) + (-2.0 + 1.0)) / 2)  # k1 = lp - ref: 0.2, -1.0
    cfg_u = AlgorithmSection(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1", use_unbiased_kl=True, eps_clip=10.0)
    _, mu = compute_objective(cfg_u, ObjectiveBatch(log_probs=T(lp, True), **b))
    close(mu["train/kl_loss"], (math.exp(0.5) * 0.2 + 1.0 * -1.0) / 2)  # ratio exp(lp - old): e^0.5, 1


def test_per_token_mean_counts_an_empty_sample_as_one_token_like_slime():
    x, mask = T([[2.0, 4.0], [9.0, 9.0]]), T([[1, 1], [0, 0]])
    close(loss_token_count(mask), 3.0)  # slime: sum(clamp_min(loss_mask.sum(), 1)) = 2 + 1
    close(token_mean(x, mask), 6.0 / 3)


@pytest.mark.parametrize("sets, expected", [
    (["algorithm.kl_coef=0.1", "algorithm.advantage_estimator=reinforce_plus_plus"],
     "algorithm.kl_coef = 0.1 needs algorithm.use_kl_loss: true"),
    (["algorithm.kl_coef=0.1"], "algorithm.kl_coef = 0.1 does nothing with algorithm.advantage_estimator = grpo"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_loss_coef=0.1", "algorithm.use_kl_loss=true",
      "algorithm.advantage_estimator=reinforce_plus_plus"],
     "algorithm.kl_coef = 0.1 and algorithm.kl_loss_coef = 0.1 are both set"),
    (["algorithm.use_unbiased_kl=true"], "algorithm.use_unbiased_kl: true needs algorithm.use_kl_loss: true"),
    (["algorithm.tis_clip_low=3"], "algorithm.tis_clip_low = 3.0 is above algorithm.tis_clip = 2.0"),
    (["algorithm.custom_tis_function=m:f"], "algorithm.custom_tis_function is set but algorithm.use_tis is false"),
    (["algorithm.loss_type=custom_loss"], "algorithm.loss_type = custom_loss needs algorithm.custom_loss_function"),
    (["algorithm.custom_loss_function=m:f"], "algorithm.custom_loss_function is set but algorithm.loss_type"),
    (["algorithm.loss_type=sft_loss", "algorithm.use_opsm=true"], "algorithm.use_opsm acts on the policy loss"),
])
def test_config_refuses_contradictions_in_one_line_naming_both_keys(sets, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, sets)
    msg = str(err.value)
    assert "\n" not in msg and expected in msg and "algorithm = {" not in msg, msg


def test_config_accepts_slime_kl_reward_penalty_with_a_reference():
    cfg = load_config(None, ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.kl_coef=0.1",
                             "algorithm.use_kl_loss=true"])
    assert cfg.algorithm.kl_coef == 0.1 and cfg.algorithm.kl_loss_coef == 0.0


# ----------------------------------------------------------------------------- item 2: losses


def test_opsm_masks_drifted_negative_sequences_by_hand():
    mask = T([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    old = T([[-1.0, -1.0, 0], [-1.0, -1.0, -1.0], [-1.0, -1.0, 0]])
    # seq_kl = mean(old - lp): row0 (0.3 + 0.1)/2 = 0.2; row1 0.0; row2 (0.3+0.1)/2 = 0.2
    lp = T([[-1.3, -1.1, 0], [-1.0, -1.0, -1.0], [-1.3, -1.1, 0]])
    adv = T([[-1.0, -1.0, 0], [-1.0, -1.0, -1.0], [1.0, 1.0, 0]])
    out = opsm_mask(lp, old, adv, mask, opsm_delta=0.1)
    close(out.seq_kl, [0.2, 0.0, 0.2])
    close(out.keep, [[0, 0, 1], [1, 1, 1], [1, 1, 1]])  # only row 0: A < 0 and 0.2 > 0.1
    cfg = AlgorithmSection(use_opsm=True, opsm_delta=0.1, eps_clip=10.0)
    loss, m = compute_objective(cfg, ObjectiveBatch(log_probs=lp.clone().requires_grad_(), mask=mask,
                                                    old_log_probs=old, advantages=adv))
    close(m["train/opsm_clipfrac"], (1 + 0 + 0) / 3)
    # unclipped pg = -ratio * A; row0 masked; row1 ratio 1, A -1 -> +1; row2 ratios e^-0.3, e^-0.1, A 1
    close(loss, (0 + 1.0 - (math.exp(-0.3) + math.exp(-0.1)) / 2) / 3)
    loss_off, _ = compute_objective(AlgorithmSection(eps_clip=10.0), ObjectiveBatch(
        log_probs=lp, mask=mask, old_log_probs=old, advantages=adv))
    assert float(loss_off) != pytest.approx(float(loss.detach()))


def test_icepop_mask_mode_zeroes_out_of_range_tokens():
    mask = T([[1, 1, 1, 1]])
    ratios = [3.0, 0.5, 1.0, 0.05]
    old = T([[math.log(r) for r in ratios]])
    roll = T([[0.0, 0.0, 0.0, 0.0]])
    tr = compute_tis_weights(old, roll, mask, tis_clip=2.0, tis_clip_low=0.1, mode="truncate")
    close(tr.weights, [[2.0, 0.5, 1.0, 0.1]])
    ice = compute_tis_weights(old, roll, mask, tis_clip=2.0, tis_clip_low=0.1, mode="mask")
    close(ice.weights, [[0.0, 0.5, 1.0, 0.0]])
    close(ice.clipfrac, [[1, 0, 0, 1]])


def test_cispo_loss_matches_slime_formula():
    mask = T([[1, 1, 1]])
    old = T([[-1.0, -1.0, -1.0]])
    lp = T([[-1.0 + math.log(1.5), -1.0 + math.log(0.5), -1.0]], grad=True)
    adv = T([[1.0, 1.0, -1.0]])
    loss, m = compute_objective(AlgorithmSection(advantage_estimator="cispo", eps_clip=0.2, eps_clip_high=0.28),
                                ObjectiveBatch(log_probs=lp, mask=mask, old_log_probs=old, advantages=adv))
    # -sg(clamp(ratio, 0.8, 1.28)) * A * lp: 1.28*(1-log... ) written out per token
    lps = [-1.0 + math.log(1.5), -1.0 + math.log(0.5), -1.0]
    close(loss, (-1.28 * lps[0] - 0.8 * lps[1] + 1.0 * lps[2]) / 3)
    close(m["train/pg_clipfrac"], 2 / 3)
    loss.backward()
    close(lp.grad, [[-1.28 / 3, -0.8 / 3, 1.0 / 3]])  # the gradient flows through lp only


def test_entropy_coef_reaches_the_entropy_gradient():
    mask = T([[1, 1, 0]])
    ent = T([[2.0, 1.0, 5.0]], grad=True)
    lp = T([[-1.0, -1.0, 0.0]], grad=True)
    loss, m = compute_objective(AlgorithmSection(entropy_coef=0.1), ObjectiveBatch(
        log_probs=lp, mask=mask, entropy=ent, old_log_probs=T([[-1.0, -1.0, 0.0]]), advantages=T([[0.0, 0.0, 0.0]])))
    close(loss, -0.1 * 1.5)
    loss.backward()
    close(ent.grad, [[-0.05, -0.05, 0.0]])


# ----------------------------------------------------------------------------- item 2: hooks

HOOKS = '''
import torch

def tis_like_slime(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    # slime's vanilla_tis_function, plus: reject tokens whose ratio exceeds tis_clip (rejection sampling)
    r = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    w = torch.clamp(r, min=args.tis_clip_low, max=args.tis_clip)
    keep = (r <= args.tis_clip).to(loss_masks[0].dtype)
    masks = [m * k for m, k in zip(loss_masks, keep.split([len(m) for m in loss_masks]))]
    return pg_loss * w, masks, {"tis": r.detach(), "rejected": (1 - keep).detach()}

def dr_grpo_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    def reduce(x):  # Dr.GRPO: a constant denominator (4) instead of each sample's length
        return sum((xi * m).sum() / 4.0 for xi, m in zip(x.split(response_lengths), loss_masks))
    return reduce

def my_loss(args, batch, logits, sum_of_sample_mean):
    lp = torch.cat(batch["cur_log_probs"])
    adv = torch.cat(batch["advantages"])
    loss = sum_of_sample_mean(-lp * adv)
    return loss, {"my_metric": loss.detach() * 0 + len(batch["response_lengths"])}

def my_advantages(args, rollout_data):
    assert args.advantage_estimator == "grpo"
    rollout_data["advantages"] = [torch.full_like(m, 10.0 * r, dtype=torch.float64)
                                  for r, m in zip(rollout_data["rewards"], rollout_data["loss_masks"])]
    rollout_data["returns"] = [a.clone() for a in rollout_data["advantages"]]
'''


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    (tmp_path / "slime_hooks.py").write_text(textwrap.dedent(HOOKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "slime_hooks"


def _section(**kw):
    return load_config(None, [f"algorithm.{k}={v}" for k, v in kw.items()]).algorithm


def test_custom_tis_function_with_slime_signature(hooks):
    algo = _section(use_tis="true", custom_tis_function=f"{hooks}:tis_like_slime")
    cfg = algo
    assert cfg.hooks["custom_tis_function"] is not None
    mask = T([[1, 1, 0], [1, 0, 0]])
    old = T([[-1.0, -1.0, 0], [-1.0, 0, 0]])
    adv = T([[1.0, 1.0, 0], [1.0, 0, 0]])
    roll = T([[-1.0 - math.log(3.0), -1.0 - math.log(0.5), 0], [-1.0, 0, 0]])  # tis 3, 0.5, 1
    b = ObjectiveBatch(log_probs=old.clone().requires_grad_(), mask=mask, old_log_probs=old, advantages=adv,
                       trainer_old_log_probs=old, rollout_log_probs=roll)
    loss, m = compute_objective(cfg, b)
    # ratio 1 -> pg = -A = -1 per token; weights clamp(3)=2 (but rejected), 0.5, 1
    # sample 0: (0 + -0.5) / 2 (original denominators), sample 1: -1 -> mean over 2 samples
    close(loss, (-0.25 + -1.0) / 2)
    close(m["train/tis"], ((3.0 + 0.5) / 2 + 1.0) / 2)
    close(m["train/rejected"], (0.5 + 0.0) / 2)
    builtin, _ = compute_objective(AlgorithmSection(use_tis=True), b)
    close(builtin, ((-2.0 - 0.5) / 2 - 1.0) / 2)  # the vanilla weights, for contrast


def test_custom_pg_loss_reducer_and_custom_loss(hooks):
    mask = T([[1, 1, 0], [1, 0, 0]])
    old = T([[-1.0, -1.0, 0], [-1.0, 0, 0]])
    adv = T([[1.0, 2.0, 0], [-1.0, 0, 0]])
    b = ObjectiveBatch(log_probs=old.clone().requires_grad_(), mask=mask, old_log_probs=old, advantages=adv)
    cfg = _section(custom_pg_loss_reducer=f"{hooks}:dr_grpo_reducer")
    loss, _ = compute_objective(cfg, b)
    # pg = -A at ratio 1: sample sums -3 and 1, each / 4; slime's sum over the 2 samples -> / 2 here
    close(loss, ((-3.0 / 4) + (1.0 / 4)) / 2)
    cfg = _section(loss_type="custom_loss", custom_loss_function=f"{hooks}:my_loss")
    loss, m = compute_objective(cfg, b)
    # -lp * A per sample mean: sample0 (-(−1)(1) - (−1)(2))/2 = 1.5; sample1 -1 -> (1.5 - 1)/2
    close(loss, (1.5 - 1.0) / 2)
    close(m["train/my_metric"], 2 / 2)
    loss.backward()
    close(b.log_probs.grad, [[-0.25, -0.5, 0.0], [0.5, 0.0, 0.0]])


def test_custom_advantage_function_with_slime_signature(hooks):
    algo = _section(custom_advantage_function=f"{hooks}:my_advantages")
    fn = algo.hooks["custom_advantage_function"]
    mask = T([[1, 1, 0], [1, 0, 0]])
    res = compute_advantages("grpo", T([1.0, -0.5]), mask, custom_advantage_function=fn,
                             args=slime_args(algo))
    close(res.advantages, [[10, 10, 0], [-5, 0, 0]])
    res = compute_advantages("grpo", T([1.0, -0.5]), mask, custom_advantage_function=fn, normalize_advantages=True,
                             args=slime_args(AlgorithmSection()))
    # whitening follows the hook (slime's order): 10, 10, -5 -> mean 5, var (25+25+100)/3*3/2 = 75
    k = 1 / math.sqrt(75 + 1e-8)
    close(res.advantages, [[5 * k, 5 * k, 0], [-10 * k, 0, 0]])


def test_a_missing_hook_fails_at_load_in_one_line(hooks):
    algo = _section(custom_pg_loss_reducer=f"{hooks}:nope")
    with pytest.raises(ConfigError) as err:
        algo.hooks  # imported once, when the trainer builds its actor
    assert "algorithm.custom_pg_loss_reducer" in str(err.value) and "\n" not in str(err.value)
