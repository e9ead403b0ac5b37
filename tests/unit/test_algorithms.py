"""slimectl.algorithms against small hand-computed tensors.

Every expected number is written out with its arithmetic in a comment; none is produced by
calling the formula under test. float64 throughout so tolerances can be tight.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimectl.algorithms.advantages import (
    compute_advantages,
    discounted_cumsum,
    grpo_advantages,
    last_valid_index,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    whiten_advantages,
)
from slimectl.algorithms.kl import compute_approx_kl, kl_loss
from slimectl.algorithms.opd import apply_opd_kl
from slimectl.algorithms.policy_loss import (
    clipped_surrogate,
    entropy_bonus,
    gspo_policy_loss,
    gspo_sequence_kl,
    ppo_policy_loss,
    sft_loss,
)
from slimectl.algorithms.reduce import per_sample_mean, reduce_masked, sample_mean, token_mean
from slimectl.contract.algorithm_names import KL_TYPES
from slimectl.algorithms.rewards import normalize_group_rewards, normalize_rewards_by_group
from slimectl.contract.config_schema import AlgorithmSection
from slimectl.algorithms.tis import apply_tis, compute_tis_weights, logprob_abs_diff

D = torch.float64
INF = float("inf")



# The reference log-prob and entropy of logits (the trainer computes them vocab-parallel in backends/megatron).
def log_probs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[token]`` for ``logits [..., V]`` and ``tokens [...]``
    (slime always divides by ``--rollout-temperature`` first)."""
    if temperature != 1.0:
        logits = logits / temperature
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum softmax(z) * z`` of ``logits [..., V]``."""
    if temperature != 1.0:
        logits = logits / temperature
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)

def T(x):
    return torch.tensor(x, dtype=D)


def M(x):
    return torch.tensor(x, dtype=torch.bool)


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- rewards

def test_grpo_reward_norm_2x3_known_mean_and_std():
    raw = [[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]]
    # group 0: mean 2 -> [-1, 0, 1]; unbiased var (1+0+1)/2 = 1 -> std 1
    # group 1: mean 1 -> [-1, -1, 2]; unbiased var (1+1+4)/2 = 3 -> std sqrt(3)
    s0, s1 = 1.0 + 1e-6, math.sqrt(3.0) + 1e-6
    expected = [[-1 / s0, 0.0, 1 / s0], [-1 / s1, -1 / s1, 2 / s1]]
    close(normalize_group_rewards(T(raw), mode="group_mean_std"), expected)
    # the same rewards flat [6] with n_samples_per_prompt=3, shape preserved
    flat = normalize_group_rewards(T(raw).flatten(), n_samples_per_prompt=3)
    assert flat.shape == (6,)
    close(flat, T(expected).flatten())
    # eps 1e-6 is added to the std (not the variance): -1/(1.7320508 + 0.000001) = -0.5773499
    close(flat[3], -0.5773499, tol=1e-7)


def test_reward_norm_modes_group_mean_none_and_single_group():
    raw = T([1.0, 2.0, 3.0, 0.0, 0.0, 3.0])
    close(normalize_group_rewards(raw, 3, mode="group_mean"), [-1.0, 0.0, 1.0, -1.0, -1.0, 2.0])
    close(normalize_group_rewards(raw, 3, mode="none"), raw)
    # n=None: one group of everything. mean 9/6 = 1.5; centered [-.5, .5, 1.5, -1.5, -1.5, 1.5]
    # unbiased var = (.25+.25+2.25+2.25+2.25+2.25)/5 = 9.5/5 = 1.9
    s = math.sqrt(1.9) + 1e-6
    close(normalize_group_rewards(raw, None), [-0.5 / s, 0.5 / s, 1.5 / s, -1.5 / s, -1.5 / s, 1.5 / s])
    # groups of one: std division skipped (slime forces it off), r - r = 0, never nan
    out = normalize_group_rewards(T([0.3, 0.7]), 1)
    assert not torch.isnan(out).any()
    close(out, [0.0, 0.0])
    # lists work; ints become float
    close(normalize_group_rewards([1, 3], 2, mode="group_mean"), [-1.0, 1.0])
    with pytest.raises(ValueError):
        normalize_group_rewards(raw, 4)
    with pytest.raises(ValueError):
        normalize_group_rewards(raw, 3, mode="bogus")


def test_reward_norm_default_follows_slime_per_estimator():
    """A null algorithm.reward_normalization is slime's rule for the estimator (its flags, translated by
    ``init --from-slime``, set the key: tests/unit/test_slime_launch.py)."""
    expect = {"grpo": "group_mean_std", "gspo": "group_mean_std", "cispo": "group_mean_std",
              "reinforce_plus_plus_baseline": "group_mean", "reinforce_plus_plus": "none", "ppo": "none"}
    for estimator, mode in expect.items():
        assert AlgorithmSection(advantage_estimator=estimator).effective_reward_normalization == mode
    assert AlgorithmSection(reward_normalization="none").effective_reward_normalization == "none"
    # slime forces the std division off for groups of one: group_mean_std there is group_mean
    close(normalize_group_rewards([3.0, 5.0], 1, mode="group_mean_std"), normalize_group_rewards([3.0, 5.0], 1, mode="group_mean"))


def test_rewards_normalized_per_group_id_uneven_and_interleaved():
    # groups by id: 0 -> [1, 0], 1 -> [2, 2, 5], 2 -> [3] (interleaved in the input order)
    raw = T([1.0, 2.0, 0.0, 2.0, 3.0, 5.0])
    ids = [0, 1, 0, 1, 2, 1]
    # group 0: mean .5, centered [.5, -.5], unbiased std sqrt(.5) = 0.70710678 -> +-.5/(0.70710678+1e-6)
    s0 = math.sqrt(0.5) + 1e-6
    # group 1: mean 3, centered [-1, -1, 2], unbiased var (1+1+4)/2 = 3
    s1 = math.sqrt(3.0) + 1e-6
    # group 2: one sample -> r - r = 0 (no std division)
    close(normalize_rewards_by_group(raw, ids), [0.5 / s0, -1 / s1, -0.5 / s0, -1 / s1, 0.0, 2 / s1])
    close(normalize_rewards_by_group(raw, ids, "group_mean"), [0.5, -1.0, -0.5, -1.0, 0.0, 2.0])
    close(normalize_rewards_by_group(raw, ids, "none"), raw)
    # None is a group id like any other (samples without a group form one group)
    close(normalize_rewards_by_group([1, 3], [None, None], "group_mean"), [-1.0, 1.0])
    with pytest.raises(ValueError, match="one reward per id"):
        normalize_rewards_by_group(raw, ids[:5])


# ----------------------------------------------------------------------------- advantages

def test_grpo_and_gspo_broadcast_over_mask():
    mask = M([[1, 1, 0], [1, 0, 0]])
    expected = [[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]
    close(grpo_advantages(T([0.5, -1.0]), mask), expected)
    close(compute_advantages("gspo", T([0.5, -1.0]), mask).advantages, expected)
    # [G, n] rewards flatten row-major to the sample order
    close(grpo_advantages(T([[0.5, -1.0]]), mask), expected)
    with pytest.raises(ValueError):
        grpo_advantages(T([1.0, 2.0, 3.0]), mask)


def test_last_valid_index_and_discounted_cumsum():
    assert last_valid_index(M([[1, 1, 0], [1, 0, 1], [0, 1, 0]])).tolist() == [1, 2, 1]
    with pytest.raises(ValueError):
        last_valid_index(M([[1, 0], [0, 0]]))
    # G_t = r_t + 0.5 G_{t+1}: r = [1, 0, 4] -> G2 = 4, G1 = 0 + 2 = 2, G0 = 1 + 1 = 2
    close(discounted_cumsum(T([[1.0, 0.0, 4.0]]), 0.5), [[2.0, 2.0, 4.0]])


def rpp_inputs():
    mask = M([[1, 1, 1], [1, 1, 0]])
    ref = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    # lp - ref: row0 [0.1, -0.2, 0.3]; row1 [0.5, 0.1, <padding garbage>]
    lp = ref + T([[0.1, -0.2, 0.3], [0.5, 0.1, 0.0]])
    lp[1, 2] = -INF
    return mask, lp, ref


def test_reinforce_plus_plus_returns_by_hand():
    mask, lp, ref = rpp_inputs()
    G = reinforce_plus_plus_returns(T([1.0, 2.0]), mask, lp, ref, kl_coef=0.5, gamma=0.9, kl_type="k1")
    # row0: r = -0.5*[0.1,-0.2,0.3] = [-0.05, 0.1, -0.15]; last += 1 -> [-0.05, 0.1, 0.85]
    #   G2 = 0.85; G1 = 0.1 + 0.9*0.85 = 0.865; G0 = -0.05 + 0.9*0.865 = 0.7285
    # row1: r = -0.5*[0.5, 0.1] = [-0.25, -0.05]; last(t=1) += 2 -> [-0.25, 1.95]
    #   G1 = 1.95; G0 = -0.25 + 0.9*1.95 = 1.505; padding 0
    close(G, [[0.7285, 0.865, 0.85], [1.505, 1.95, 0.0]])

    A = compute_advantages("reinforce_plus_plus", T([1.0, 2.0]), mask, log_probs=lp, ref_log_probs=ref, kl_coef=0.5,
                           gamma=0.9).advantages  # whitened: slime requires it for REINFORCE++
    # whitening over the 5 valid tokens: sum 5.8985, mean 1.1797
    # deviations -0.4512, -0.3147, -0.3297, 0.3253, 0.7703; squares sum 1.1105018
    # unbiased var 1.1105018/4; A = dev / sqrt(var + 1e-8)
    sd = math.sqrt(1.1105018 / 4 + 1e-8)
    close(A, [[-0.4512 / sd, -0.3147 / sd, -0.3297 / sd], [0.3253 / sd, 0.7703 / sd, 0.0]])
    # no whitening -> the masked returns
    close(compute_advantages("reinforce_plus_plus", T([1.0, 2.0]), mask, log_probs=lp, ref_log_probs=ref, kl_coef=0.5,
                             gamma=0.9, normalize_advantages=False).advantages, G)
    # kl_coef = 0 ignores the log-probs entirely: reward on the last valid token, discounted
    # mask [1,1,0,0], gamma 0.5, reward 4 -> G = [2, 4, 0, 0]
    close(reinforce_plus_plus_returns(T([4.0]), M([[1, 1, 0, 0]]), gamma=0.5), [[2.0, 4.0, 0.0, 0.0]])


def test_reinforce_plus_plus_response_mask_reproduces_slime_on_tool_tokens():
    # multi-turn: token 1 is a tool-output token (in the response, loss-masked)
    mask = M([[1, 0, 1]])
    ref = T([[0.0, 0.0, 0.0]])
    lp = T([[0.2, 0.4, 0.6]])
    # default (KL only on trained tokens): r = [-0.2, 0, -0.6 + 1] = [-0.2, 0, 0.4], gamma 1
    #   G = [0.2, 0.4, 0.4]; returns are zeroed off the mask -> [0.2, 0, 0.4]
    close(reinforce_plus_plus_returns(T([1.0]), mask, lp, ref, kl_coef=1.0), [[0.2, 0.0, 0.4]])
    # slime: KL on every response token: r = [-0.2, -0.4, 0.4] -> G = [-0.2, 0.0, 0.4]
    resp = M([[1, 1, 1]])
    close(reinforce_plus_plus_returns(T([1.0]), mask, lp, ref, kl_coef=1.0, response_mask=resp), [[-0.2, 0.0, 0.4]])


def test_reinforce_plus_plus_baseline_by_hand():
    mask = M([[1, 1], [1, 0]])
    ref = T([[0.0, 0.0], [0.0, 0.0]])
    lp = T([[1.0, 2.0], [0.0, -INF]])  # k1 = lp - ref; padding garbage
    # raw rewards [1, 3], group of 2: mean 2 -> [-1, 1]
    # row0: -1 - 0.1*[1, 2] = [-1.1, -1.2]; row1: 1 - 0.1*0 = [1.0]
    raw = reinforce_plus_plus_baseline_advantages(T([1.0, 3.0]), mask, lp, ref, kl_coef=0.1, group_size=2, normalize=False)
    close(raw, [[-1.1, -1.2], [1.0, 0.0]])
    # already-centered rewards, group_size=None, give the same
    close(reinforce_plus_plus_baseline_advantages(T([-1.0, 1.0]), mask, lp, ref, 0.1, normalize=False), raw)
    # whitened: values [-1.1, -1.2, 1.0], mean -13/30
    # deviations -2/3 (=-20/30), -23/30, 43/30; sum sq (400+529+1849)/900 = 2778/900; var = that/2
    sd = math.sqrt(2778 / 900 / 2 + 1e-8)
    A = reinforce_plus_plus_baseline_advantages(T([1.0, 3.0]), mask, lp, ref, kl_coef=0.1, group_size=2)
    close(A, [[(-20 / 30) / sd, (-23 / 30) / sd], [(43 / 30) / sd, 0.0]])


def test_whitening_invariants_and_errors():
    adv = T([[3.0, 5.0, 100.0], [7.0, 100.0, 100.0]])
    mask = M([[1, 1, 0], [1, 0, 0]])
    # valid values 3, 5, 7: mean 5, unbiased var (4+0+4)/2 = 4, std 2 -> [-1, 0, 1]
    w = whiten_advantages(adv, mask, eps=0.0)
    close(w, [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # shift_mean=False adds the mean back: [4, 5, 6]
    close(whiten_advantages(adv, mask, eps=0.0, shift_mean=False), [[4.0, 5.0, 0.0], [6.0, 0.0, 0.0]])
    with pytest.raises(ValueError):
        whiten_advantages(adv, torch.zeros_like(mask))


def test_compute_advantages_dispatch_order():
    mask = M([[1, 1, 0], [1, 0, 0]])
    student = T([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    teacher = T([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    # grpo + OPD (coef 0.5): reverse kl = student - teacher = [[0.5, -1, -], [0, -, -]]
    # A = [[0.5 - 0.25, 0.5 + 0.5, 0], [-1 - 0, 0, 0]]; grpo is not whitened by default
    res = compute_advantages("grpo", T([0.5, -1.0]), mask, log_probs=student, teacher_log_probs=teacher, opd_kl_coef=0.5)
    close(res.advantages, [[0.25, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    close(res.returns, [[0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]])  # returns are pre-OPD
    close(res.opd_reverse_kl, [[0.5, -1.0, 0.0], [0.0, 0.0, 0.0]])
    close(res.kl, torch.zeros(2, 3))  # kl_coef 0 -> no KL reward
    # grpo + explicit whitening: valid [0.25, 1.0, -1.0], mean 0.25/3 = 1/12
    # deviations 1/6, 11/12, -13/12; sum sq (4 + 121 + 169)/144 = 294/144; var = that/2
    sd = math.sqrt(294 / 144 / 2 + 1e-8)
    res = compute_advantages("grpo", T([0.5, -1.0]), mask, log_probs=student, teacher_log_probs=teacher,
                             opd_kl_coef=0.5, normalize_advantages=True)
    close(res.advantages, [[(1 / 6) / sd, (11 / 12) / sd, 0.0], [(-13 / 12) / sd, 0.0, 0.0]])
    # REINFORCE++ whitens by default, returns stay unwhitened
    m2, lp, ref = rpp_inputs()
    res = compute_advantages("reinforce_plus_plus", T([1.0, 2.0]), m2, log_probs=lp, ref_log_probs=ref, kl_coef=0.5, gamma=0.9)
    close(res.returns, [[0.7285, 0.865, 0.85], [1.505, 1.95, 0.0]])
    sd = math.sqrt(1.1105018 / 4 + 1e-8)
    close(res.advantages[0, 0], -0.4512 / sd)
    close(res.kl, [[0.1, -0.2, 0.3], [0.5, 0.1, 0.0]])
    with pytest.raises(ValueError):
        compute_advantages("ppo", T([1.0, 2.0]), m2)


# ----------------------------------------------------------------------------- KL

def test_kl_kinds_at_known_points():
    ref = T([0.0, 0.0, 0.0])
    lp = T([0.5, -1.0, -3.0])  # log-ratio lr = lp - ref
    close(compute_approx_kl(lp, ref, "k1"), [0.5, -1.0, -3.0])  # k1 = lr
    close(compute_approx_kl(lp, ref, "k2"), [0.125, 0.5, 4.5])  # lr^2/2: .25/2, 1/2, 9/2
    # k3 = exp(-lr) - 1 + lr:
    #   lr=0.5: 0.6065306597 - 0.5 = 0.1065306597
    #   lr=-1 : 2.7182818285 - 2   = 0.7182818285
    #   lr=-3 : 20.0855369232 - 4  = 16.0855369232
    close(compute_approx_kl(lp, ref, "k3"), [0.1065306597, 0.7182818285, 16.0855369232], tol=1e-9)
    # low_var_kl = k3 clamped to [-10, 10]
    close(compute_approx_kl(lp, ref, "low_var_kl"), [0.1065306597, 0.7182818285, 10.0], tol=1e-9)
    # unbiased-KL importance ratio multiplies BEFORE the clamp: 16.0855369232 * 0.5 = 8.0427684616
    ratio = T([2.0, 1.0, 0.5])
    close(compute_approx_kl(lp, ref, "low_var_kl", importance_ratio=ratio), [0.2130613194, 0.7182818285, 8.0427684616])
    close(compute_approx_kl(lp, ref, "k1", importance_ratio=ratio), [1.0, -1.0, -1.5])
    with pytest.raises(ValueError):
        compute_approx_kl(lp, ref, "k4")


def test_kl_of_identical_distributions_is_exactly_zero():
    lp = T([[-0.1, -2.3, -7.0], [-0.7, -1e-4, -30.0]])
    for kind in KL_TYPES:
        kl = compute_approx_kl(lp, lp.clone(), kind)
        assert torch.equal(kl, torch.zeros_like(kl)), kind


def test_kl_mask_blocks_padding_garbage():
    lp = T([[-1.0, -INF]])
    ref = T([[-2.0, 0.0]])
    mask = M([[1, 0]])
    for kind, first in [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1) - 1 + 1), ("low_var_kl", math.exp(-1))]:
        kl = compute_approx_kl(lp, ref, kind, mask=mask)
        close(kl, [[first, 0.0]])


def test_kl_loss_reduced():
    mask = M([[1, 1, 0], [1, 0, 0]])
    lp = T([[0.0, -1.0, -INF], [-2.0, 0.0, 0.0]])
    ref = T([[-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    # k2 = lr^2/2: row0 [0.5, 0]; row1 [0.5]; sample mean = (0.25 + 0.5)/2 = 0.375
    close(kl_loss(lp, ref, mask, "k2"), 0.375)
    # token mean = (0.5 + 0 + 0.5)/3
    close(kl_loss(lp, ref, mask, "k2", reduction="token_mean"), 1.0 / 3.0)
    # unbiased KL with old == lp: ratio 1, same value
    close(kl_loss(lp, ref, mask, "k2", old_log_probs=lp.clone()), 0.375)


# ----------------------------------------------------------------------------- policy loss

def _ratios(r):
    """log_probs giving these ratios against old log-probs of 0."""
    return torch.log(T(r)), torch.zeros(len(r), dtype=D)


def test_ppo_clip_symmetric_just_inside_and_outside():
    lp, old = _ratios([1.19, 1.21, 0.81, 0.79, 0.7, 1.5])
    adv = T([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])
    out = ppo_policy_loss(lp, old, adv, torch.ones(6, dtype=torch.bool), eps_clip=0.2)
    # A>0: loss = -min(r, 1.2)  for r > 1: 1.19 -> -1.19; 1.21 -> -1.2 (clipped)
    # A<0: loss = max(r, 0.8)   for r < 1: 0.81 -> 0.81;  0.79 -> 0.8 (clipped)
    # A>0, r=0.7: pg1 = -0.7, pg2 = -0.8 -> max = -0.7 (no clip on the optimistic side)
    # A<0, r=1.5: pg1 = 1.5, pg2 = 1.2 -> 1.5 (no clip)
    close(out.pg_loss, [-1.19, -1.2, 0.81, 0.8, -0.7, 1.5], tol=1e-12)
    close(out.clipfrac, [0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    close(out.ppo_kl, -torch.log(T([1.19, 1.21, 0.81, 0.79, 0.7, 1.5])))  # old - lp = -log r
    close(out.ratio, [1.19, 1.21, 0.81, 0.79, 0.7, 1.5], tol=1e-12)


def test_ppo_clip_higher():
    lp, old = _ratios([1.25, 1.3, 0.75])
    adv = T([1.0, 1.0, -1.0])
    mask = torch.ones(3, dtype=torch.bool)
    # eps_clip 0.2, eps_clip_high 0.28 -> range [0.8, 1.28]
    # 1.25 (A>0): inside the high bound -> -1.25, not clipped (it would be -1.2 symmetric)
    # 1.3  (A>0): -> -1.28 clipped;  0.75 (A<0): -> max(0.75, 0.8) = 0.8 clipped
    out = ppo_policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    close(out.pg_loss, [-1.25, -1.28, 0.8], tol=1e-12)
    close(out.clipfrac, [0.0, 1.0, 1.0])
    sym = ppo_policy_loss(lp, old, adv, mask, eps_clip=0.2)
    close(sym.pg_loss, [-1.2, -1.2, 0.8], tol=1e-12)
    close(sym.clipfrac, [1.0, 1.0, 1.0])


def test_dual_clip_only_on_negative_advantages():
    lp, old = _ratios([5.0, 1.5, 5.0, 4.0])
    adv = T([-1.0, -1.0, 1.0, -2.0])
    out = ppo_policy_loss(lp, old, adv, torch.ones(4, dtype=torch.bool), eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    # A=-1, r=5: max(5, 1.28) = 5 -> min(3*1, 5) = 3 (dual clip)
    # A=-1, r=1.5: 1.5 < 3 -> 1.5
    # A=+1, r=5: -min(5, 1.28) = -1.28; the dual clip does not touch A>0
    # A=-2, r=4: max(8, 2.56) = 8 -> min(3*2, 8) = 6
    close(out.pg_loss, [3.0, 1.5, -1.28, 6.0], tol=1e-12)
    # slime's clipfrac ignores the dual clip: only the A>0 token was clipped by eps
    close(out.clipfrac, [0.0, 0.0, 1.0, 0.0])
    # without the dual clip the first token would cost 5
    close(ppo_policy_loss(lp, old, adv, torch.ones(4, dtype=torch.bool), eps_clip=0.2, eps_clip_high=0.28).pg_loss[0], 5.0, tol=1e-12)
    with pytest.raises(ValueError):
        clipped_surrogate(torch.zeros(1, dtype=D), T([-1.0]), eps_clip_c=1.0)


def test_ratio_one_invariants():
    mask = M([[1, 1, 0], [1, 0, 0]])
    lp = T([[-0.3, -1.2, -INF], [-2.0, 5.0, 5.0]])
    adv = T([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])  # 9 = padding garbage
    out = ppo_policy_loss(lp, lp.clone(), adv, mask, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    # ratio 1 -> pg = -A per token; sample mean of -A = ((-1-2)/2 + (-3)/1)/2 = -2.25
    m = out.metrics("sample_mean")
    close(out.loss("sample_mean"), -2.25)
    close(m["pg_loss"], -2.25)
    close(m["pg_clipfrac"], 0.0)
    close(m["ppo_kl"], 0.0)
    # token mean of -A = -(1+2+3)/3 = -2
    close(out.loss("token_mean"), -2.0)
    close(out.pg_loss, [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]])
    assert not torch.isnan(out.ratio).any()


def test_policy_gradient_only_where_mask_is_one():
    mask = M([[1, 1, 0], [1, 0, 0]])
    lp = T([[-0.3, -1.2, -0.5], [-2.0, -0.1, -0.1]]).requires_grad_(True)
    old = lp.detach().clone()
    old[0, 2] = -INF  # padding garbage in the old log-probs must not leak
    adv = T([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    out = ppo_policy_loss(lp, old, adv, mask)
    out.loss("sample_mean").backward()
    # at ratio 1 (unclipped) d pg_t / d lp_t = -ratio * A_t = -A_t; sample mean weights 1/(n_i * B)
    # row0: -1/(2*2) = -0.25, -2/(2*2) = -0.5; row1: -3/(1*2) = -1.5; padding exactly 0
    close(lp.grad, [[-0.25, -0.5, 0.0], [-1.5, 0.0, 0.0]])

    # a clipped token gets no gradient: ratio 1.3 > 1.2 with A > 0
    lp2 = torch.log(T([[1.3, 1.1]])).requires_grad_(True)
    out2 = ppo_policy_loss(lp2, torch.zeros(1, 2, dtype=D), T([[1.0, 1.0]]), M([[1, 1]]))
    out2.loss("token_mean").backward()
    # token 1: d(-r*A)/d lp = -r*A = -1.1, divided by 2 tokens -> -0.55
    close(lp2.grad, [[0.0, -0.55]], tol=1e-12)


def test_gspo_sequence_ratio_is_geometric_mean():
    mask = M([[1, 1, 0], [1, 1, 1]])
    old = torch.zeros(2, 3, dtype=D)
    # log-ratios lp - old: row0 [0.1, 0.3] (+ padding); row1 [0.0, 0.3, -0.3]
    lp = T([[0.1, 0.3, 50.0], [0.0, 0.3, -0.3]]).requires_grad_(True)
    seq = gspo_sequence_kl(lp, old, mask)
    # row0: old - lp mean = -(0.1+0.3)/2 = -0.2 ; row1: -(0 + 0.3 - 0.3)/3 = 0
    close(seq, [[-0.2, -0.2, 0.0], [0.0, 0.0, 0.0]])
    adv = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = gspo_policy_loss(lp, old, adv, mask, eps_clip=0.2)
    # row0 ratio exp(0.2) = 1.2214 = sqrt(exp(0.1)*exp(0.3)) > 1.2 -> loss -1.2, clipped
    # row1 ratio exp(0) = 1 -> loss -1
    close(out.ratio[0, :2], [math.sqrt(math.exp(0.1) * math.exp(0.3))] * 2, tol=1e-12)
    close(out.pg_loss, [[-1.2, -1.2, 0.0], [-1.0, -1.0, -1.0]], tol=1e-12)
    close(out.clipfrac, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    out.loss("sample_mean").backward()
    # row0 clipped -> 0; row1: loss_1 = mean_t(-ratio * A_t) with ratio = exp(mean_s lr_s)
    #   d/d lp_t = -(A summed / 3) * ratio * (1/3) = -1 * 1/3 ... times 1/B = 1/2 -> -1/6 each
    close(lp.grad, [[0.0, 0.0, 0.0], [-1 / 6, -1 / 6, -1 / 6]], tol=1e-12)


def test_entropy_logprobs_and_bonus():
    logits = T([[0.0, 0.0], [0.0, math.log(3.0)]])
    # H([.5,.5]) = ln 2 = 0.6931471806; H([.25,.75]) = .25 ln 4 + .75 ln(4/3) = 0.5623351446
    close(entropy_from_logits(logits), [0.6931471806, 0.5623351446], tol=1e-9)
    # log p(token 1) = ln(0.75) = -0.2876820725
    close(log_probs_from_logits(logits[1:], torch.tensor([1])), [-0.2876820725], tol=1e-9)
    # temperature 2: logits [0, ln3/2] -> p1 = sqrt3/(1+sqrt3) = 0.6339745962 -> ln = -0.4557466
    close(log_probs_from_logits(logits[1:], torch.tensor([1]), temperature=2.0), [math.log(0.6339745962)], tol=1e-9)
    # bonus = -coef * reduce(H): sample means (1+2)/2 = 1.5 and 3 -> 2.25 -> -0.0225
    H = T([[1.0, 2.0], [3.0, 77.0]])
    mask = M([[1, 1], [1, 0]])
    close(entropy_bonus(H, mask, 0.01), -0.0225)
    close(entropy_bonus(H, mask, 0.01, "token_mean"), -0.02)  # (1+2+3)/3 = 2


def test_sft_loss():
    lp = T([[-1.0, -2.0, -100.0], [-3.0, -INF, -INF]])
    mask = M([[1, 1, 0], [1, 0, 0]])
    # sample mean: row means -1.5 and -3 -> mean -2.25 -> NLL 2.25
    close(sft_loss(lp, mask), 2.25)
    # token mean: (-1-2-3)/3 = -2 -> 2
    close(sft_loss(lp, mask, "token_mean"), 2.0)


# ----------------------------------------------------------------------------- TIS

def test_tis_clamp_and_metrics():
    # old - rollout log ratios: ln .5, ln 1.5, ln 3, ln .1, and a padding slot
    rollout = torch.zeros(1, 5, dtype=D)
    old = T([[math.log(0.5), math.log(1.5), math.log(3.0), math.log(0.1), INF]])
    mask = M([[1, 1, 1, 1, 0]])
    out = compute_tis_weights(old, rollout, mask, tis_clip=2.0, tis_clip_low=0.0)
    close(out.tis, [[0.5, 1.5, 3.0, 0.1, 0.0]], tol=1e-12)
    close(out.weights, [[0.5, 1.5, 2.0, 0.1, 0.0]], tol=1e-12)  # 3 -> clamp to 2
    close(out.clipfrac, [[0.0, 0.0, 1.0, 0.0, 0.0]])
    close(out.tis_abs, [[0.5, 0.5, 2.0, 0.9, 0.0]], tol=1e-12)
    low = compute_tis_weights(old, rollout, mask, tis_clip=2.0, tis_clip_low=0.2)
    close(low.weights, [[0.5, 1.5, 2.0, 0.2, 0.0]], tol=1e-12)  # 0.1 -> 0.2
    close(low.clipfrac, [[0.0, 0.0, 1.0, 1.0, 0.0]])
    pg = T([[1.0, -1.0, 1.0, 1.0, 0.0]])
    close(apply_tis(pg, out), [[0.5, -1.5, 2.0, 0.1, 0.0]], tol=1e-12)
    with pytest.raises(ValueError):
        compute_tis_weights(old, rollout, mask, tis_clip=0.5, tis_clip_low=1.0)

    # |d| mean = (0.6931471806 + 0.4054651081 + 1.0986122887 + 2.3025850930)/4 = 1.1249524176
    close(logprob_abs_diff(old, rollout, mask), 1.1249524176, tol=1e-9)
    m = compute_tis_weights(old, rollout, mask).metrics("sample_mean")
    close(m["tis"], 1.275, tol=1e-12)  # (0.5+1.5+3+0.1)/4
    close(m["tis_clipfrac"], 0.25)
    close(m["tis_abs"], 0.975, tol=1e-12)  # (0.5+0.5+2+0.9)/4


# ----------------------------------------------------------------------------- reduction

def test_reduction_modes_differ_on_unequal_lengths():
    x = T([[1.0, 2.0, 3.0, 0.0], [10.0, 0.0, 0.0, 0.0]])
    mask = M([[1, 1, 1, 0], [1, 0, 0, 0]])
    # per-sample mean: row means 2 and 10 -> 6 ; per-token: (1+2+3+10)/4 = 4
    close(per_sample_mean(x, mask), [2.0, 10.0])
    close(sample_mean(x, mask), 6.0)
    close(token_mean(x, mask), 4.0)
    close(reduce_masked(x, mask, "sample_mean"), 6.0)
    close(reduce_masked(x, mask, "token_mean"), 4.0)
    with pytest.raises(ValueError):
        reduce_masked(x, mask, "seq_mean")


def test_reduction_ignores_padding_and_counts_empty_samples():
    x = T([[2.0, 4.0, float("nan")], [7.0, INF, 7.0]])
    mask = M([[1, 1, 0], [0, 0, 0]])
    # row0 mean 3; the empty row contributes 0 but still counts: (3 + 0)/2 = 1.5
    close(sample_mean(x, mask), 1.5)
    # token mean, slime's count (issue 18 item 5): the empty sample counts one token, (2+4)/(2+1) = 2
    close(token_mean(x, mask), 2.0)
    close(token_mean(x, M([[1, 1, 0], [0, 0, 1]])), (2 + 4 + 7) / 3)
    # 1-D input is one sample: (2+4)/2
    close(sample_mean(T([2.0, 4.0, 100.0]), M([1, 1, 0])), 3.0)


# ----------------------------------------------------------------------------- assembled loss

def test_full_loss_gradients_only_on_valid_tokens():
    torch.manual_seed(0)
    B, L, V = 3, 5, 7
    mask = M([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])  # row 2: a loss-masked prompt-ish head
    logits = torch.randn(B, L, V, dtype=D, requires_grad=True)
    tokens = torch.randint(0, V, (B, L))
    lp = log_probs_from_logits(logits, tokens)
    H = entropy_from_logits(logits)
    pad = ~mask
    old = (lp.detach() + 0.05 * torch.randn(B, L, dtype=D)).masked_fill(pad, -INF)
    ref = (lp.detach() + 0.1 * torch.randn(B, L, dtype=D)).masked_fill(pad, -INF)
    rollout = (old + 0.01 * torch.randn(B, L, dtype=D)).masked_fill(pad, INF)
    rewards = normalize_group_rewards(T([1.0, 0.0, 1.0]), 3)
    adv = compute_advantages("grpo", rewards, mask).advantages
    out = ppo_policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    pg = apply_tis(out.pg_loss, compute_tis_weights(old, rollout, mask))
    loss = (reduce_masked(pg, mask) + entropy_bonus(H, mask, 0.01)
            + 0.05 * kl_loss(lp, ref, mask, "low_var_kl", old_log_probs=old))
    loss.backward()
    g = logits.grad.abs().sum(-1)
    assert torch.isfinite(logits.grad).all()
    assert (g[pad] == 0).all()
    assert (g[mask] > 0).all()
