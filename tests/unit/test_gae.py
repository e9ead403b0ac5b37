"""PPO's GAE, the critic's clipped value loss and its metrics, against hand-computed tensors.

Every expected number is written out with its arithmetic in a comment; none comes from the
function under test. float64 throughout. The last tests compare with line-by-line transcriptions
of slime's ``vanilla_gae`` and verl's masked ``compute_gae_advantage_return`` on random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimectl.algorithms.gae import compute_gae, gae, gae_lists, last_step_index, ppo_token_rewards
from slimectl.algorithms.value_loss import CRITIC_METRICS, clipped_value_loss, critic_metrics, explained_variance

D = torch.float64
NAN = float("nan")


def T(x):
    return torch.tensor(x, dtype=D)


def M(x):
    return torch.tensor(x, dtype=torch.bool)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- gamma = lambd = 1


def test_gamma1_lambd1_is_return_to_go_minus_value():
    # row 0: 3 tokens, V = [0.2, 0.5, 0.9], reward 1 on the last token -> return-to-go [1, 1, 1]
    # row 1: 2 tokens + padding (its value is nan: never read), V = [0.1, -0.3], reward -0.5 -> RTG [-0.5, -0.5]
    values = T([[0.2, 0.5, 0.9], [0.1, -0.3, NAN]])
    mask = M([[1, 1, 1], [1, 1, 0]])
    res = compute_gae(T([1.0, -0.5]), values, mask, gamma=1.0, lambd=1.0)
    close(res.token_rewards, [[0, 0, 1.0], [0, -0.5, 0]])
    # A = RTG - V: [1-0.2, 1-0.5, 1-0.9] = [0.8, 0.5, 0.1]; [-0.5-0.1, -0.5+0.3] = [-0.6, -0.2]
    close(res.advantages, [[0.8, 0.5, 0.1], [-0.6, -0.2, 0.0]])
    close(res.returns, [[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])  # G = A + V = the return-to-go
    close(res.kl, torch.zeros(2, 3))


def test_gamma1_lambd1_with_kl_shaping():
    # k1 kl = lp - ref = [0.1, -0.2, 0.3]; kl_coef 0.5 -> r = [-0.05, 0.1, -0.15 + 1] = [-0.05, 0.1, 0.85]
    # RTG = [-0.05 + 0.1 + 0.85, 0.1 + 0.85, 0.85] = [0.9, 0.95, 0.85]; V = [0.2, 0.5, 0.9]
    lp, ref = T([[-1.0, -2.0, -0.5]]), T([[-1.1, -1.8, -0.8]])
    res = compute_gae(T([1.0]), T([[0.2, 0.5, 0.9]]), M([[1, 1, 1]]), gamma=1.0, lambd=1.0,
                      log_probs=lp, ref_log_probs=ref, kl_coef=0.5)
    close(res.kl, [[0.1, -0.2, 0.3]])
    close(res.token_rewards, [[-0.05, 0.1, 0.85]])
    close(res.advantages, [[0.9 - 0.2, 0.95 - 0.5, 0.85 - 0.9]])  # [0.7, 0.45, -0.05]
    close(res.returns, [[0.9, 0.95, 0.85]])


# ----------------------------------------------------------------------------- gamma 0.9, lambd 0.8 by hand

V3 = [0.5, 0.2, -0.1]


def test_gamma09_lambd08_three_tokens():
    # gamma*lambd = 0.72; r = [0, 0, 1]
    # delta2 = 1 + 0.9*0 - (-0.1) = 1.1
    # delta1 = 0 + 0.9*(-0.1) - 0.2 = -0.29
    # delta0 = 0 + 0.9*0.2 - 0.5 = -0.32
    # A2 = 1.1 ; A1 = -0.29 + 0.72*1.1 = 0.502 ; A0 = -0.32 + 0.72*0.502 = 0.04144
    # G = A + V = [0.54144, 0.702, 1.0]
    res = compute_gae(T([1.0]), T([V3]), M([[1, 1, 1]]), gamma=0.9, lambd=0.8)
    close(res.advantages, [[0.04144, 0.502, 1.1]])
    close(res.returns, [[0.54144, 0.702, 1.0]])


def test_gamma09_lambd08_three_tokens_with_kl():
    # kl (k1) = [0.2, -0.4, 0.0], kl_coef 0.5 -> r = [-0.1, 0.2, 0 + 1] = [-0.1, 0.2, 1.0]
    # delta2 = 1.0 + 0 + 0.1 = 1.1 ; delta1 = 0.2 - 0.09 - 0.2 = -0.09 ; delta0 = -0.1 + 0.18 - 0.5 = -0.42
    # A2 = 1.1 ; A1 = -0.09 + 0.792 = 0.702 ; A0 = -0.42 + 0.72*0.702 = -0.42 + 0.50544 = 0.08544
    # G = [0.58544, 0.902, 1.0]
    lp, ref = T([[-1.0, -1.0, -1.0]]), T([[-1.2, -0.6, -1.0]])
    res = compute_gae(T([1.0]), T([V3]), M([[1, 1, 1]]), gamma=0.9, lambd=0.8, log_probs=lp, ref_log_probs=ref,
                      kl_coef=0.5)
    close(res.token_rewards, [[-0.1, 0.2, 1.0]])
    close(res.advantages, [[0.08544, 0.702, 1.1]])
    close(res.returns, [[0.58544, 0.902, 1.0]])


def test_lambd_1_and_0_limits():
    # lambd = 1: A_t = sum_k 0.9^k r_{t+k} - V_t = [0.81 - 0.5, 0.9 - 0.2, 1 + 0.1] = [0.31, 0.7, 1.1]
    one = compute_gae(T([1.0]), T([V3]), M([[1, 1, 1]]), gamma=0.9, lambd=1.0)
    close(one.advantages, [[0.31, 0.7, 1.1]])
    close(one.returns, [[0.81, 0.9, 1.0]])
    # lambd = 0: A_t = delta_t = [-0.32, -0.29, 1.1] (one-step TD)
    zero = compute_gae(T([1.0]), T([V3]), M([[1, 1, 1]]), gamma=0.9, lambd=0.0)
    close(zero.advantages, [[-0.32, -0.29, 1.1]])


# ----------------------------------------------------------------------------- masked tokens (multi-turn)

# 5 response tokens: model, model, tool, tool, model. The tool tokens' values (7, 8) and KL must not count.
MT_MASK = M([[1, 1, 0, 0, 1]])
MT_VALUES = T([[0.5, 0.2, 7.0, 8.0, -0.1]])
MT_LP, MT_REF = T([[-1.0, -1.0, -1.0, -1.0, -1.0]]), T([[-1.0, -1.0, -6.0, -6.0, -1.0]])  # k1 kl = [0, 0, 5, 5, 0]


def test_masked_middle_tokens_are_skipped():
    # default: the steps are the loss tokens, so this is the 3-token case of
    # test_gamma09_lambd08_three_tokens on positions 0, 1, 4 (token 1 bootstraps from V4 = -0.1),
    # and the KL of the tool tokens (kl_coef 0.1 * 5) is not a reward
    res = compute_gae(T([1.0]), MT_VALUES, MT_MASK, gamma=0.9, lambd=0.8, log_probs=MT_LP, ref_log_probs=MT_REF,
                      kl_coef=0.1)
    close(res.token_rewards, [[0, 0, 0, 0, 1.0]])
    close(res.advantages, [[0.04144, 0.502, 0, 0, 1.1]])
    close(res.returns, [[0.54144, 0.702, 0, 0, 1.0]])


def test_masked_middle_tokens_slime_mode_steps_over_every_response_token():
    # response_mask = all 5 tokens (slime): V = [0.5, 0.2, 7, 8, -0.1], r = [0, 0, 0, 0, 1]
    # delta4 = 1 + 0.1 = 1.1
    # delta3 = 0.9*(-0.1) - 8 = -8.09
    # delta2 = 0.9*8 - 7 = 0.2
    # delta1 = 0.9*7 - 0.2 = 6.1
    # delta0 = 0.9*0.2 - 0.5 = -0.32
    # A4 = 1.1 ; A3 = -8.09 + 0.72*1.1 = -7.298 ; A2 = 0.2 + 0.72*(-7.298) = -5.05456
    # A1 = 6.1 + 0.72*(-5.05456) = 2.4607168 ; A0 = -0.32 + 0.72*2.4607168 = 1.451716096
    # advantages zeroed on the tool tokens (loss mask); returns G = A + V on every response token:
    # [1.951716096, 2.6607168, -5.05456 + 7, -7.298 + 8, 1.0]
    resp = M([[1, 1, 1, 1, 1]])
    res = compute_gae(T([1.0]), MT_VALUES, MT_MASK, gamma=0.9, lambd=0.8, response_mask=resp)
    close(res.advantages, [[1.451716096, 2.4607168, 0, 0, 1.1]])
    close(res.returns, [[1.951716096, 2.6607168, 1.94544, 0.702, 1.0]])
    # slime's KL reward does reach the tool tokens: kl_coef 0.1 * kl 5 -> r = [0, 0, -0.5, -0.5, 1]
    shaped = compute_gae(T([1.0]), MT_VALUES, MT_MASK, gamma=0.9, lambd=0.8, response_mask=resp,
                         log_probs=MT_LP, ref_log_probs=MT_REF, kl_coef=0.1)
    close(shaped.token_rewards, [[0, 0, -0.5, -0.5, 1.0]])


def test_reward_sits_on_the_last_step():
    # the response ends with a loss-masked token: by default the reward goes on the last loss token
    # (position 1); in slime's mode on the last response token (position 2)
    mask, resp = M([[1, 1, 0]]), M([[1, 1, 1]])
    close(ppo_token_rewards(T([2.0]), mask), [[0, 2.0, 0]])
    close(ppo_token_rewards(T([2.0]), resp), [[0, 0, 2.0]])
    # V = [0.5, 0.5, 0.5], gamma = lambd = 1, default: A = RTG - V = [2 - 0.5, 2 - 0.5, 0]
    res = compute_gae(T([2.0]), T([[0.5, 0.5, 0.5]]), mask)
    close(res.advantages, [[1.5, 1.5, 0]])
    last, has = last_step_index(M([[1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]]))
    assert last.tolist() == [2, 0, 1] and has.tolist() == [True, False, True]


def test_fully_masked_row_gets_zeros():
    # a sample whose loss mask is all 0 (e.g. dropped by a filter): no step, nothing to carry its reward
    res = compute_gae(T([1.0, 3.0]), T([[0.5, 0.5], [0.2, 0.4]]), M([[1, 1], [0, 0]]), gamma=1.0, lambd=1.0)
    close(res.advantages, [[0.5, 0.5], [0, 0]])
    close(res.returns, [[1.0, 1.0], [0, 0]])


# ----------------------------------------------------------------------------- length-1 responses


def test_length_one_responses():
    # one token: A = r - V (no next value), G = r, whatever gamma and lambd are
    # row 0: 2 - 0.3 = 1.7 ; row 1 (a 3-token row beside it): the gamma 0.9 / lambd 0.8 case above
    values = T([[0.3, 0.0, 0.0], V3])
    mask = M([[1, 0, 0], [1, 1, 1]])
    res = compute_gae(T([2.0, 1.0]), values, mask, gamma=0.9, lambd=0.8)
    close(res.advantages, [[1.7, 0, 0], [0.04144, 0.502, 1.1]])
    close(res.returns, [[2.0, 0, 0], [0.54144, 0.702, 1.0]])
    single = compute_gae(T([-1.0]), T([[0.25]]), M([[1]]), gamma=0.5, lambd=0.5)
    close(single.advantages, [[-1.25]])
    close(single.returns, [[-1.0]])


# ----------------------------------------------------------------------------- whitening, lists, errors


def test_whitening_over_loss_tokens_returns_untouched():
    # the gamma = lambd = 1 advantages [0.8, 0.5, 0.1, -0.6, -0.2]: mean 0.6/5 = 0.12
    # deviations [0.68, 0.38, -0.02, -0.72, -0.32], squares sum 1.228, unbiased var 1.228/4 = 0.307
    values = T([[0.2, 0.5, 0.9], [0.1, -0.3, 0.0]])
    mask = M([[1, 1, 1], [1, 1, 0]])
    res = compute_gae(T([1.0, -0.5]), values, mask, normalize_advantages=True)
    sd = math.sqrt(0.307 + 1e-8)
    close(res.advantages, [[0.68 / sd, 0.38 / sd, -0.02 / sd], [-0.72 / sd, -0.32 / sd, 0.0]])
    close(res.returns, [[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]])


def test_list_form_matches_padded():
    # slime's layout: one 1-D tensor per sample, every token a step
    adv, ret = gae_lists([T([0.0, 0.0, 1.0]), T([2.0])], [T(V3), T([0.3])], gamma=0.9, lambd=0.8)
    close(adv[0], [0.04144, 0.502, 1.1])
    close(adv[1], [1.7])
    close(ret[0], [0.54144, 0.702, 1.0])
    close(ret[1], [2.0])
    # with a per-sample mask: the multi-turn case
    adv, ret = gae_lists([T([0.0, 0.0, 0.0, 0.0, 1.0])], [MT_VALUES[0]], 0.9, 0.8, steps=[MT_MASK[0]])
    close(adv[0], [0.04144, 0.502, 0, 0, 1.1])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="lambd must be in"):
        gae(T([[1.0]]), T([[0.0]]), M([[1]]), gamma=0.9, lambd=1.5)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae(T([[1.0]]), T([[0.0]]), M([[1]]), gamma=-0.1, lambd=1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        compute_gae(T([1.0]), T([[0.0, 0.0]]), M([[1, 1, 1]]))
    with pytest.raises(ValueError, match="2 rewards for 1 samples"):
        compute_gae(T([1.0, 2.0]), T([[0.0]]), M([[1]]))
    with pytest.raises(ValueError, match="kl_coef != 0 needs ref_log_probs"):
        compute_gae(T([1.0]), T([[0.0]]), M([[1]]), log_probs=T([[0.0]]), kl_coef=0.1)


def test_no_gradient_reaches_the_values():
    values = T([V3]).requires_grad_(True)
    res = compute_gae(T([1.0]), values, M([[1, 1, 1]]), gamma=0.9, lambd=0.8)
    assert not res.advantages.requires_grad and not res.returns.requires_grad


# ----------------------------------------------------------------------------- value loss

# one row of 4 tokens, value_clip 0.2:
#   t0 inside:  V_old 0, V 0.1,  G 1 -> V_clip 0.1;  max((0.1-1)^2, (0.1-1)^2) = 0.81, not clipped
#   t1 above:   V_old 0, V 0.5,  G 1 -> V_clip 0.2;  max((0.2-1)^2 = 0.64, (0.5-1)^2 = 0.25) = 0.64, clipped
#   t2 below:   V_old 0, V -0.5, G 1 -> V_clip -0.2; max((-0.2-1)^2 = 1.44, (-0.5-1)^2 = 2.25) = 2.25, clipped
#   t3 inside:  V_old 1, V 1.0,  G 0 -> V_clip 1.0;  1.0, not clipped
VL_OLD, VL_V, VL_G = [0.0, 0.0, 0.0, 1.0], [0.1, 0.5, -0.5, 1.0], [1.0, 1.0, 1.0, 0.0]


def test_value_loss_inside_above_below_the_clip_range():
    v = T([VL_V]).requires_grad_(True)
    out = clipped_value_loss(v, T([VL_OLD]), T([VL_G]), M([[1, 1, 1, 1]]), value_clip=0.2)
    close(out.per_token, [[0.81, 0.64, 2.25, 1.0]])
    close(out.loss, (0.81 + 0.64 + 2.25 + 1.0) / 4)  # 1.175, no 1/2 factor (slime)
    # slime's clip fraction counts |V - V_old| > 0.2: t1 and t2 -> 2/4 (verl's definition would count t1 only)
    close(out.clipfrac, 0.5)
    out.loss.backward()
    # d/dV of the mean: t0 2*(0.1-1)/4 = -0.45 ; t1 the clipped term wins and is flat in V -> 0
    # t2 the unclipped term wins: 2*(-0.5-1)/4 = -0.75 ; t3 2*(1-0)/4 = 0.5
    close(v.grad, [[-0.45, 0.0, -0.75, 0.5]])


def test_value_loss_above_the_range_moving_away_uses_the_unclipped_error():
    # V_old 0, V 0.5, G -1: V_clip 0.2 -> max((0.2+1)^2 = 1.44, (0.5+1)^2 = 2.25) = 2.25
    out = clipped_value_loss(T([[0.5]]), T([[0.0]]), T([[-1.0]]), M([[1]]), value_clip=0.2)
    close(out.loss, 2.25)
    close(out.clipfrac, 1.0)


def test_value_loss_reductions_and_padding():
    # row 0 = t0..t2, row 1 = t3 + a padded position holding nan (never read)
    mask = M([[1, 1, 1], [1, 0, 0]])
    v = T([[0.1, 0.5, -0.5], [1.0, NAN, NAN]])
    old = T([[0.0, 0.0, 0.0], [1.0, NAN, NAN]])
    g = T([[1.0, 1.0, 1.0], [0.0, NAN, NAN]])
    # per-sample mean: mean((0.81 + 0.64 + 2.25)/3, 1.0/1) = (1.2333.. + 1)/2 ; clipfrac mean(2/3, 0) = 1/3
    out = clipped_value_loss(v, old, g, mask, value_clip=0.2)
    close(out.loss, (3.7 / 3 + 1.0) / 2)
    close(out.clipfrac, 1 / 3)
    # per token: 4.7 / 4 ; clipfrac 2/4
    tok = clipped_value_loss(v, old, g, mask, value_clip=0.2, mode="token_mean")
    close(tok.loss, 4.7 / 4)
    close(tok.clipfrac, 0.5)
    # no clip: plain squared error [(0.1-1)^2, (0.5-1)^2, (-0.5-1)^2 | 1] = [0.81, 0.25, 2.25 | 1.0]
    plain = clipped_value_loss(v, old, g, mask, value_clip=None, mode="token_mean")
    close(plain.loss, (0.81 + 0.25 + 2.25 + 1.0) / 4)
    close(plain.clipfrac, 0.0)
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        clipped_value_loss(v, old, g, mask, value_clip=0.0)


# ----------------------------------------------------------------------------- explained variance, metrics


def test_explained_variance_perfect_constant_and_partial():
    g = T([[1.0, 2.0, 3.0, 4.0, NAN]])
    mask = M([[1, 1, 1, 1, 0]])
    close(explained_variance(g, g, mask), 1.0)  # perfect: Var(G - V) = 0
    close(explained_variance(T([[2.5, 2.5, 2.5, 2.5, 9.0]]), g, mask), 0.0)  # constant: Var(G - c) = Var(G)
    close(explained_variance(T([[-7.0, -7.0, -7.0, -7.0, 0.0]]), g, mask), 0.0)
    # G = [1, 2, 3, 4]: mean 2.5, Var = (2.25 + 0.25 + 0.25 + 2.25)/4 = 1.25
    # V = [1, 2, 3, 3]: G - V = [0, 0, 0, 1], mean 0.25, Var = (3*0.0625 + 0.5625)/4 = 0.1875
    # EV = 1 - 0.1875 / 1.25 = 0.85
    close(explained_variance(T([[1.0, 2.0, 3.0, 3.0, 0.0]]), g, mask), 0.85)
    # every return equal: nothing to explain -> 0
    close(explained_variance(T([[0.0, 1.0]]), T([[5.0, 5.0]]), M([[1, 1]])), 0.0)


def test_critic_metrics_from_tensors():
    # the gamma = lambd = 1 example: V [0.2, 0.5, 0.9 | 0.1, -0.3], G [1, 1, 1 | -0.5, -0.5],
    # A = G - V = [0.8, 0.5, 0.1 | -0.6, -0.2]
    values = T([[0.2, 0.5, 0.9], [0.1, -0.3, NAN]])
    returns = T([[1.0, 1.0, 1.0], [-0.5, -0.5, NAN]])
    adv = T([[0.8, 0.5, 0.1], [-0.6, -0.2, NAN]])
    mask = M([[1, 1, 1], [1, 1, 0]])
    m = critic_metrics(values, returns, adv, mask, value_loss=T(0.25), value_clipfrac=0.5)
    assert tuple(m) == CRITIC_METRICS
    exp = {
        "critic/value_loss": 0.25,
        "critic/value_clipfrac": 0.5,
        # Var(G - V) = Var(A) = 1.228/5 = 0.2456 ; Var(G): mean 0.4, squares 3*0.36 + 2*0.81 = 2.7, /5 = 0.54
        "critic/explained_variance": 1 - 0.2456 / 0.54,
        "critic/values_mean": 1.4 / 5,  # (0.2 + 0.5 + 0.9 + 0.1 - 0.3) / 5
        "critic/returns_mean": 0.4,  # (3 - 1) / 5
        "critic/returns_std": math.sqrt(0.54),
        "critic/returns_max": 1.0,
        "critic/returns_min": -0.5,
        "critic/advantages_mean": 0.12,  # 0.6 / 5
        "critic/advantages_std": math.sqrt(0.2456),
        "critic/advantages_max": 0.8,
        "critic/advantages_min": -0.6,
    }
    for k, v in exp.items():
        assert m[k] == pytest.approx(v, abs=1e-12), k
    assert all(type(v) is float for v in m.values())
    # without the loss figures, only the tensor statistics
    assert set(critic_metrics(values, returns, adv, mask)) == set(CRITIC_METRICS) - {"critic/value_loss",
                                                                                      "critic/value_clipfrac"}


# ----------------------------------------------------------------------------- transcriptions of slime / verl


def _slime_vanilla_gae(rewards, values, gamma, lambd):
    """slime ``ppo_utils.vanilla_gae`` (padded [B, T], no mask), transcribed."""
    B, n = rewards.shape
    lastgaelam = torch.zeros(B, dtype=rewards.dtype)
    rev = []
    for t in reversed(range(n)):
        next_value = values[:, t + 1] if t < n - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return adv, adv + values


def _verl_gae(rewards, values, mask, gamma, lam):
    """verl ``compute_gae_advantage_return`` (skips observation tokens), transcribed, without its whitening."""
    nextvalues, lastgaelam, rev = 0, 0, []
    m = mask.to(rewards.dtype)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return adv, adv + values


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_slime_and_verl_transcriptions(seed):
    g = torch.Generator().manual_seed(seed)
    B, n = 5, 9
    lengths = [9, 1, 4, 7, 2]
    resp = torch.zeros(B, n, dtype=torch.bool)
    for i, k in enumerate(lengths):
        resp[i, :k] = True
    loss = resp & (torch.rand(B, n, generator=g) > 0.3)
    for i, k in enumerate(lengths):
        loss[i, 0] = True  # every sample has a loss token
        loss[i, k - 1] = True  # ... and ends with one, where verl and slimectl put the reward
    values = torch.randn(B, n, generator=g, dtype=D)
    r = torch.randn(B, n, generator=g, dtype=D)
    gamma, lambd = 0.95, 0.9
    # slime: every response token a step (padding after each response: slime runs per sample)
    ours_adv, ours_ret = gae(r, values, resp, gamma, lambd)
    for i, k in enumerate(lengths):
        s_adv, s_ret = _slime_vanilla_gae(r[i:i + 1, :k], values[i:i + 1, :k], gamma, lambd)
        close(ours_adv[i, :k], s_adv[0], tol=1e-12)
        close(ours_ret[i, :k], s_ret[0], tol=1e-12)
    # verl: loss-masked tokens skipped; compare on the loss tokens (verl keeps carried values elsewhere)
    ours_adv, ours_ret = gae(r, values, loss, gamma, lambd)
    v_adv, v_ret = _verl_gae(torch.where(loss, r, 0.0), values, loss, gamma, lambd)
    close(ours_adv[loss], v_adv[loss], tol=1e-12)
    close(ours_ret[loss], v_ret[loss], tol=1e-12)
    assert bool((ours_adv[~loss] == 0).all()) and bool((ours_ret[~loss] == 0).all())
