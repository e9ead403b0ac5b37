"""slimectl.algorithms.objective: the per-micro-batch loss and metrics, against hand-computed numbers.

One 2x3 micro-batch with right padding (row 0 has 2 valid tokens, row 1 has 1); the padding holds
nan so any leak shows. Every expected number is written out with its arithmetic; none comes from
the helpers under test. float64 throughout.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from slimectl.algorithms.objective import ObjectiveBatch, compute_objective
from slimectl.contract.algorithm_names import CRITIC_ESTIMATORS, ESTIMATORS, KL_TYPES, LOSS_TYPES, REWARD_NORM_MODES
from slimectl.contract.config import build_config
from slimectl.contract.config_schema import AlgorithmSection
from slimectl.contract.errors import ConfigError

D = torch.float64
NAN = float("nan")
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=D)
OLD = [[-1.0, -2.0, NAN], [-0.7, NAN, NAN]]
# ratio = exp(lp - old): 1.5 and 0.5 in row 0, 1.1 in row 1
RATIO = [[1.5, 0.5], [1.1]]
ADV = [[1.0, 1.0, NAN], [-2.0, NAN, NAN]]
LP = [[-1.0 + math.log(1.5), -2.0 + math.log(0.5)], [-0.7 + math.log(1.1)]]
CLIP = {"eps_clip": 0.2, "eps_clip_high": 0.28}  # ratio range [0.8, 1.28]


def A(reduction: str = "sample_mean", **kw) -> AlgorithmSection:
    """The algorithm section the objective reads (``reduction`` as its calculate_per_token_loss key)."""
    return AlgorithmSection(calculate_per_token_loss=reduction == "token_mean", **kw)


def replace(cfg: AlgorithmSection, reduction: str | None = None, **kw) -> AlgorithmSection:
    if reduction is not None:
        kw["calculate_per_token_loss"] = reduction == "token_mean"
    return AlgorithmSection(**{**cfg.model_dump(), **kw})


def T(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


def batch(**kw) -> ObjectiveBatch:
    lp = T([[LP[0][0], LP[0][1], NAN], [LP[1][0], NAN, NAN]], grad=True)
    return ObjectiveBatch(log_probs=lp, mask=MASK, old_log_probs=T(OLD), advantages=T(ADV), **kw)


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


def value(metrics, key):
    return float(metrics[key])


# per-token PPO losses, clip range [0.8, 1.28]:
#   (0,0) ratio 1.5, A 1:  max(-1.5, -1.28) = -1.28, clipped
#   (0,1) ratio 0.5, A 1:  max(-0.5, -0.8)  = -0.5
#   (1,0) ratio 1.1, A -2: max(2.2, 2.2)    = 2.2
PG = [[-1.28, -0.5], [2.2]]


def test_ppo_alone_sample_mean():
    b = batch()
    loss, m = compute_objective(A(**CLIP), b)
    # rows: (-1.28 - 0.5)/2 = -0.89 and 2.2; mean (-0.89 + 2.2)/2 = 0.655
    close(loss, 0.655)
    close(value(m, "train/pg_loss"), 0.655)
    close(value(m, "train/loss"), 0.655)
    close(value(m, "train/pg_clipfrac"), (0.5 + 0.0) / 2)  # row 0: 1 of 2 clipped
    # ppo_kl = old - lp = -log(ratio): row 0 mean -(log 1.5 + log 0.5)/2, row 1 -log 1.1
    close(value(m, "train/ppo_kl"), (-(math.log(1.5) + math.log(0.5)) / 2 - math.log(1.1)) / 2)
    assert set(m) == {"train/pg_loss", "train/pg_clipfrac", "train/ppo_kl", "train/loss"}
    loss.backward()
    # d/dlp of -ratio*A is -ratio*A; token weights 1/(2 rows * 2 tokens) and 1/(2 rows * 1 token);
    # the clipped token gets none, padding none
    close(b.log_probs.grad, [[0.0, -0.5 * 1.0 / 4, 0.0], [-1.1 * -2.0 / 2, 0.0, 0.0]])


def test_ppo_token_mean():
    loss, m = compute_objective(A(reduction="token_mean", **CLIP), batch())
    close(loss, (-1.28 - 0.5 + 2.2) / 3)  # every valid token weighs the same
    close(value(m, "train/pg_clipfrac"), 1 / 3)


def test_dual_clip_bounds_negative_advantage_loss():
    b = ObjectiveBatch(log_probs=T([[math.log(5.0)]], grad=True), mask=T([[1.0]]), old_log_probs=T([[0.0]]),
                       advantages=T([[-1.0]]))
    # ratio 5, A -1: max(5, 1.28) = 5; dual clip 3: min(-3 * -1, 5) = 3
    loss, _ = compute_objective(A(eps_clip_c=3.0, **CLIP), b)
    close(loss, 3.0)
    close(compute_objective(A(**CLIP), b)[0], 5.0)


def test_gspo_uses_the_sequence_ratio():
    b = batch()
    loss, m = compute_objective(A(advantage_estimator="gspo", **CLIP), b)
    # row 0 ratio exp(mean(log 1.5, log 0.5)) = sqrt(0.75) = 0.8660 (inside the range): loss -sqrt(.75)
    # row 1 (one token) as PPO: 2.2
    close(loss, (-math.sqrt(0.75) + 2.2) / 2)
    close(value(m, "train/pg_clipfrac"), 0.0)
    loss.backward()
    # row 0: d(-r)/dlp_t = -r/2 (r = exp of the mean), times 1/2 rows
    r = math.sqrt(0.75)
    close(b.log_probs.grad, [[-r / 4, -r / 4, 0.0], [1.1, 0.0, 0.0]])


def test_cispo_stops_the_gradient_at_the_clipped_ratio():
    b = batch()
    loss, m = compute_objective(A(advantage_estimator="cispo", **CLIP), b)
    # -sg(clamp(ratio, .8, 1.28)) * A * lp: clamped 1.28, 0.8 | 1.1
    tok = [[-1.28 * 1.0 * LP[0][0], -0.8 * 1.0 * LP[0][1]], [-1.1 * -2.0 * LP[1][0]]]
    close(loss, ((tok[0][0] + tok[0][1]) / 2 + tok[1][0]) / 2)
    close(value(m, "train/pg_clipfrac"), (1.0 + 0.0) / 2)  # both row-0 ratios were clamped
    loss.backward()
    # gradient -clamped * A through lp only: clipped tokens still get one
    close(b.log_probs.grad, [[-1.28 / 4, -0.8 / 4, 0.0], [2.2 / 2, 0.0, 0.0]])


def test_sft_alone():
    b = batch()
    loss, m = compute_objective(A(loss_type="sft_loss"), b)
    close(loss, -((LP[0][0] + LP[0][1]) / 2 + LP[1][0]) / 2)
    assert value(m, "train/pg_loss") == 0.0 and "train/pg_clipfrac" not in m and "train/ppo_kl" not in m
    loss.backward()
    close(b.log_probs.grad, [[-0.25, -0.25, 0.0], [-0.5, 0.0, 0.0]])
    # SFT needs no old log-probs or advantages
    bare = ObjectiveBatch(log_probs=T([[-2.0, -4.0]]), mask=T([[1.0, 1.0]]))
    close(compute_objective(A(loss_type="sft_loss", reduction="token_mean"), bare)[0], 3.0)


ENTROPY = [[0.5, 1.5, NAN], [2.0, NAN, NAN]]


def test_entropy_metric_and_bonus():
    ent = T(ENTROPY, grad=True)
    loss, m = compute_objective(A(entropy_coef=0.1, **CLIP), batch(entropy=ent))
    # entropy sample mean: (1.0 + 2.0)/2 = 1.5; the bonus -0.1 * 1.5 is added to the loss
    close(value(m, "train/entropy"), 1.5)
    close(loss, 0.655 - 0.15)
    close(value(m, "train/loss"), 0.655 - 0.15)
    close(value(m, "train/pg_loss"), 0.655)
    loss.backward()
    close(ent.grad, [[-0.1 / 4, -0.1 / 4, 0.0], [-0.1 / 2, 0.0, 0.0]])
    # coefficient 0: reported, not in the loss
    loss0, m0 = compute_objective(A(**CLIP), batch(entropy=T(ENTROPY)))
    close(loss0, 0.655)
    close(value(m0, "train/entropy"), 1.5)


def ref_for(diffs):
    """Reference log-probs with lp - ref = diffs on the valid tokens (nan padding)."""
    return T([[LP[0][0] - diffs[0][0], LP[0][1] - diffs[0][1], NAN], [LP[1][0] - diffs[1][0], NAN, NAN]])


def test_kl_loss_to_the_reference():
    ref = ref_for([[0.2, 0.4], [-0.1]])
    cfg = A(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", **CLIP)
    loss, m = compute_objective(cfg, batch(ref_log_probs=ref))
    # k1 = lp - ref: rows 0.3 and -0.1 -> 0.1; loss 0.655 + 0.5 * 0.1
    close(value(m, "train/kl_loss"), 0.1)
    close(loss, 0.655 + 0.05)
    # low_var_kl = k3 = exp(-x) - 1 + x of x = lp - ref
    k3 = [[math.exp(-0.2) - 1 + 0.2, math.exp(-0.4) - 1 + 0.4], [math.exp(0.1) - 1 - 0.1]]
    _, m3 = compute_objective(replace(cfg, kl_loss_type="low_var_kl"), batch(ref_log_probs=ref))
    close(value(m3, "train/kl_loss"), ((k3[0][0] + k3[0][1]) / 2 + k3[1][0]) / 2)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_objective(cfg, batch())


# trainer_old - rollout: log 3, log 0.5 | 0 -> TIS ratio 3, 0.5 | 1, clamped to [0, 2]: 2, 0.5 | 1
TRAINER_OLD = [[-1.0, -2.0, NAN], [-0.7, NAN, NAN]]
ROLLOUT = [[-1.0 - math.log(3.0), -2.0 - math.log(0.5), NAN], [-0.7, NAN, NAN]]


def test_tis_weights_and_metrics():
    cfg = A(use_tis=True, **CLIP)
    loss, m = compute_objective(cfg, batch(trainer_old_log_probs=T(TRAINER_OLD), rollout_log_probs=T(ROLLOUT)))
    # pg * w: -1.28 * 2 = -2.56, -0.5 * 0.5 = -0.25 | 2.2 * 1; rows -1.405 and 2.2
    close(loss, (-1.405 + 2.2) / 2)
    close(value(m, "train/pg_loss"), (-1.405 + 2.2) / 2)
    close(value(m, "train/tis"), ((3.0 + 0.5) / 2 + 1.0) / 2)
    close(value(m, "train/tis_clipfrac"), (0.5 + 0.0) / 2)
    close(value(m, "train/tis_abs"), ((2.0 + 0.5) / 2 + 0.0) / 2)
    # |trainer_old - rollout| = log 3, log 2 | 0
    close(value(m, "train/train_rollout_logprob_abs_diff"), ((math.log(3.0) + math.log(2.0)) / 2) / 2)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        compute_objective(cfg, batch(trainer_old_log_probs=T(TRAINER_OLD)))


def test_mismatch_metric_without_tis_and_opd_metric():
    teacher = [[-1.0 - 0.3, -2.0 + 0.1, NAN], [-0.7 - 0.2, NAN, NAN]]  # old - teacher = 0.3, -0.1 | 0.2
    loss, m = compute_objective(A(use_opd=True, **CLIP),
                                batch(trainer_old_log_probs=T(TRAINER_OLD), rollout_log_probs=T(ROLLOUT),
                                      teacher_log_probs=T(teacher)))
    close(loss, 0.655)  # neither changes the loss (OPD shapes the advantages, TIS is off)
    close(value(m, "train/opd_reverse_kl"), ((0.3 - 0.1) / 2 + 0.2) / 2)
    close(value(m, "train/train_rollout_logprob_abs_diff"), (math.log(3.0) + math.log(2.0)) / 4)
    assert "train/tis" not in m
    # no rollout log-probs: no mismatch metric
    assert "train/train_rollout_logprob_abs_diff" not in compute_objective(A(), batch())[1]


def test_everything_composed_both_reductions_and_gradients():
    cfg = A(use_tis=True, entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", **CLIP)
    kw = {"trainer_old_log_probs": T(TRAINER_OLD), "rollout_log_probs": T(ROLLOUT),
          "ref_log_probs": ref_for([[0.2, 0.4], [-0.1]])}
    ent = T(ENTROPY, grad=True)
    b = batch(entropy=ent, **kw)
    loss, m = compute_objective(cfg, b)
    # pg with TIS 0.3975, entropy -0.1 * 1.5, KL 0.5 * 0.1
    close(loss, 0.3975 - 0.15 + 0.05)
    close(value(m, "train/loss"), 0.3975 - 0.15 + 0.05)
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())  # metrics are detached scalars
    assert loss.requires_grad
    loss.backward()
    # lp: PPO part (TIS-weighted; (0,1) weight 0.5) + KL part 0.5 * d(lp - ref)/dlp per token weight
    close(b.log_probs.grad, [[0.0 + 0.5 / 4, -0.5 * 0.5 / 4 + 0.5 / 4, 0.0], [1.1 + 0.5 / 2, 0.0, 0.0]])
    assert torch.isfinite(b.log_probs.grad).all() and torch.isfinite(ent.grad).all()  # nan padding never leaks
    # token_mean: pg (-2.56 - 0.25 + 2.2)/3, entropy 4/3, kl (0.2 + 0.4 - 0.1)/3
    loss_t, m_t = compute_objective(replace(cfg, reduction="token_mean"), batch(entropy=T(ENTROPY), **kw))
    close(loss_t, -0.61 / 3 - 0.1 * 4 / 3 + 0.5 * 0.5 / 3)
    close(value(m_t, "train/entropy"), 4 / 3)
    close(value(m_t, "train/tis"), (3.0 + 0.5 + 1.0) / 3)


def test_the_section_resolves_its_defaults_once():
    """The objective reads the section itself; its null keys are resolved by the schema (no mirror class)."""
    a = AlgorithmSection()
    assert a.effective_eps_clip_high == a.eps_clip == 0.2 and a.reduction == "sample_mean"
    b = AlgorithmSection(eps_clip=0.1, eps_clip_high=0.3, calculate_per_token_loss=True)
    assert b.effective_eps_clip_high == 0.3 and b.reduction == "token_mean"
    assert AlgorithmSection(eps_clip=0.25).effective_eps_clip_high == 0.25  # follows eps_clip while unset
    # the resolved upper clip reaches the clamp: ratio 1.5 at A = 1 clipped to 1 + high
    one = ObjectiveBatch(log_probs=T([[math.log(1.5)]], grad=True), mask=T([[1.0]]), old_log_probs=T([[0.0]]),
                         advantages=T([[1.0]]))
    close(compute_objective(AlgorithmSection(eps_clip=0.2), one)[0], -1.2)
    close(compute_objective(AlgorithmSection(eps_clip=0.2, eps_clip_high=0.28), one)[0], -1.28)
    with pytest.raises(ValueError):
        AlgorithmSection(advantage_estimator="ppo2")


def test_config_choices_come_from_the_registry():
    fields = AlgorithmSection.model_fields
    for key, names in (("advantage_estimator", ESTIMATORS + CRITIC_ESTIMATORS), ("kl_loss_type", KL_TYPES),
                       ("loss_type", LOSS_TYPES)):
        assert typing.get_args(fields[key].annotation) == names, key
    literal, none = typing.get_args(fields["reward_normalization"].annotation)  # Optional: null = slime's rule
    assert typing.get_args(literal) == REWARD_NORM_MODES and none is type(None)
    assert build_config({"algorithm": {"advantage_estimator": "cispo"}}).algorithm.advantage_estimator == "cispo"
    with pytest.raises(ConfigError) as err:
        build_config({"algorithm": {"advantage_estimator": "ppo2"}})
    assert "\n" not in str(err.value) and "algorithm.advantage_estimator" in str(err.value) and "'cispo'" in str(err.value)
