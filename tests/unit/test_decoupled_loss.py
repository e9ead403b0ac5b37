"""algorithm.use_decoupled_loss (AReaL's decoupled PPO objective) against hand-computed numbers, its equivalence
with TIS's mask mode, and the config combinations it refuses.

One 2x4 micro-batch, float64: row 0 has 3 loss tokens, row 1 has 2; the padding holds nan so any leak shows.
The proximal policy is the trainer's old log-probs, the behaviour policy the rollout's. Every expected number
is written out with its arithmetic; none comes from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimectl.algorithms.objective import ObjectiveBatch, compute_objective
from slimectl.contract.config import build_config
from slimectl.contract.config_schema import AlgorithmSection
from slimectl.contract.errors import ConfigError

D = torch.float64
NAN = float("nan")
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
PROX = [[-1.0, -2.0, -0.5, NAN], [-1.5, -0.3, NAN, NAN]]
# r = exp(lp - prox): 1.1, 1.5, 0.9 | 0.7, 1.0
R = [[1.1, 1.5, 0.9], [0.7, 1.0]]
# w = exp(prox - behav): 1.2, 0.5, 3.0 | 2.0, 0.8; with cap 2.5 the token of weight 3.0 leaves the loss
W = [[1.2, 0.5, 3.0], [2.0, 0.8]]
ADV = [[1.0, 1.0, 1.0, NAN], [-0.5, -0.5, NAN, NAN]]
CAP = 2.5


def rows(values: list[list[float]], fill=NAN) -> list[list[float]]:
    return [v + [fill] * (4 - len(v)) for v in values]


def batch() -> ObjectiveBatch:
    lp = [[p + math.log(r) for p, r in zip(prow, rrow)] for prow, rrow in zip(PROX, R)]
    behav = [[p - math.log(w) for p, w in zip(prow, wrow)] for prow, wrow in zip(PROX, W)]
    t = lambda x, grad=False: torch.tensor(x, dtype=D, requires_grad=grad)  # noqa: E731
    prox = t(PROX)
    return ObjectiveBatch(log_probs=t(rows(lp), grad=True), mask=t(MASK), old_log_probs=prox,
                          advantages=t(ADV), trainer_old_log_probs=prox, rollout_log_probs=t(rows(behav)))


def decoupled(reduction: str = "sample_mean", cap: float | None = CAP) -> AlgorithmSection:
    return AlgorithmSection(use_decoupled_loss=True, behav_imp_weight_cap=cap, eps_clip=0.2,
                            calculate_per_token_loss=reduction == "token_mean")


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D), atol=tol, rtol=0)


# per-token clipped PPO against the proximal policy, ratio range [0.8, 1.2]:
#   row 0, A = 1:     r 1.1: max(-1.1, -1.1) = -1.1 | r 1.5: max(-1.5, -1.2) = -1.2 (clipped) | r 0.9: -0.9
#   row 1, A = -0.5:  r 0.7: max(0.35, 0.4) = 0.4 (clipped) | r 1.0: 0.5
# times the behaviour weight (0 above the cap):
#   row 0: -1.1 * 1.2 = -1.32, -1.2 * 0.5 = -0.6, -0.9 * 0 = 0      row 1: 0.4 * 2.0 = 0.8, 0.5 * 0.8 = 0.4
PG_W = [[-1.32, -0.6, 0.0], [0.8, 0.4]]


def test_decoupled_loss_sample_mean_by_hand():
    b = batch()
    loss, m = compute_objective(decoupled(), b)
    # rows: (-1.32 - 0.6 + 0) / 3 = -0.64 and (0.8 + 0.4) / 2 = 0.6 (the capped token stays in row 0's
    # denominator, as AReaL counts the loss mask before the cap); mean (-0.64 + 0.6) / 2 = -0.02
    close(loss, -0.02)
    close(m["train/pg_loss"], -0.02)
    close(m["train/pg_clipfrac"], (1 / 3 + 1 / 2) / 2)
    close(m["train/tis"], ((1.2 + 0.5 + 3.0) / 3 + (2.0 + 0.8) / 2) / 2)  # the raw weight, every loss token
    close(m["train/tis_clipfrac"], (1 / 3 + 0 / 2) / 2)  # the fraction the cap masked
    close(m["train/behav_imp_weight"], ((1.2 + 0.5) / 2 + (2.0 + 0.8) / 2) / 2)  # over the kept tokens
    loss.backward()
    # d/dlp of -r A w is -r A w where the ratio is not clipped and the token not capped, else 0:
    #   row 0 t0: -1.1 * 1 * 1.2 = -1.32, over 2 rows x 3 tokens;  row 1 t1: -1.0 * -0.5 * 0.8 = 0.4, over 2 x 2
    close(b.log_probs.grad, [[-1.32 / 6, 0.0, 0.0, 0.0], [0.0, 0.4 / 4, 0.0, 0.0]])


def test_decoupled_loss_token_mean_is_areals_reduction():
    b = batch()
    loss, m = compute_objective(decoupled("token_mean"), b)
    # AReaL: sum of the weighted losses over the 5 loss tokens (the capped one included) / 5
    close(loss, (-1.32 - 0.6 + 0.0 + 0.8 + 0.4) / 5)
    close(m["train/behav_imp_weight"], (1.2 + 0.5 + 2.0 + 0.8) / 4)
    loss.backward()
    close(b.log_probs.grad, [[-1.32 / 5, 0.0, 0.0, 0.0], [0.0, 0.4 / 5, 0.0, 0.0]])


def test_no_cap_keeps_every_token_with_its_weight():
    loss, m = compute_objective(decoupled(cap=None), batch())
    # row 0's last token now counts: -0.9 * 3.0 = -2.7; rows (-1.32 - 0.6 - 2.7) / 3 = -1.54 and 0.6
    close(loss, (-1.54 + 0.6) / 2)
    close(m["train/tis_clipfrac"], 0.0)


def test_decoupled_is_tis_mask_mode_capped_above():
    """The option resolves to TIS's mask mode on [0, cap]: the same loss, gradient and metrics, on random
    batches, both reductions (only the behav_imp_weight metric is its own)."""
    g = torch.Generator().manual_seed(0)
    for reduction in ("sample_mean", "token_mean"):
        for _ in range(5):
            shape = (3, 6)
            mask = (torch.rand(shape, generator=g) < 0.7).to(D)
            prox = -torch.rand(shape, generator=g, dtype=D) * 3
            behav = prox - torch.randn(shape, generator=g, dtype=D)
            lp = (prox + 0.3 * torch.randn(shape, generator=g, dtype=D))
            adv = torch.randn(shape, generator=g, dtype=D)
            outs = []
            for cfg in (decoupled(reduction), AlgorithmSection(use_tis=True, tis_mode="mask", tis_clip=CAP,
                                                               tis_clip_low=0.0, eps_clip=0.2,
                                                               calculate_per_token_loss=reduction == "token_mean")):
                x = lp.clone().requires_grad_(True)
                loss, m = compute_objective(cfg, ObjectiveBatch(log_probs=x, mask=mask, old_log_probs=prox,
                                                                advantages=adv, trainer_old_log_probs=prox,
                                                                rollout_log_probs=behav))
                loss.backward()
                outs.append((loss, x.grad, m))
            (l1, g1, m1), (l2, g2, m2) = outs
            assert torch.equal(l1, l2) and torch.equal(g1, g2)
            assert set(m1) - set(m2) == {"train/behav_imp_weight"}
            assert all(torch.equal(m1[k], m2[k]) for k in m2)


def test_the_section_resolves_the_decoupled_option():
    a = decoupled()
    assert (a.effective_use_tis, a.effective_tis_mode, a.effective_tis_clip, a.effective_tis_clip_low) == \
        (True, "mask", CAP, 0.0)
    assert decoupled(cap=None).effective_tis_clip == math.inf
    plain = AlgorithmSection(use_tis=True, tis_clip=3.0, tis_clip_low=0.1)
    assert (plain.effective_use_tis, plain.effective_tis_mode, plain.effective_tis_clip,
            plain.effective_tis_clip_low) == (True, "truncate", 3.0, 0.1)
    assert not AlgorithmSection().effective_use_tis
    with pytest.raises(ValueError, match="use_decoupled_loss"):
        compute_objective(a, ObjectiveBatch(log_probs=torch.zeros(1, 1), mask=torch.ones(1, 1),
                                            old_log_probs=torch.zeros(1, 1), advantages=torch.ones(1, 1),
                                            trainer_old_log_probs=torch.zeros(1, 1)))


@pytest.mark.parametrize("data, words", [
    ({"algorithm": {"behav_imp_weight_cap": 2.0}}, "behav_imp_weight_cap is set but algorithm.use_decoupled_loss"),
    ({"algorithm": {"use_decoupled_loss": True, "use_tis": True}}, "use_decoupled_loss and algorithm.use_tis"),
    ({"algorithm": {"use_decoupled_loss": True, "loss_type": "sft_loss"}}, "algorithm.loss_type = sft_loss"),
    ({"algorithm": {"use_decoupled_loss": True}, "train": {"use_rollout_logprobs": True}},
     "use_decoupled_loss needs train.use_rollout_logprobs: false"),
    ({"algorithm": {"use_decoupled_loss": True, "behav_imp_weight_cap": 1.0}}, "behav_imp_weight_cap"),
])
def test_refused_combinations_in_one_line(data, words):
    with pytest.raises(ConfigError) as err:
        build_config(data)
    assert "\n" not in str(err.value).strip() and words in str(err.value), str(err.value)


def test_accepted_combinations():
    cfg = build_config({"algorithm": {"use_decoupled_loss": True, "behav_imp_weight_cap": 5.0,
                                      "advantage_estimator": "gspo"}})
    assert cfg.algorithm.effective_tis_clip == 5.0
