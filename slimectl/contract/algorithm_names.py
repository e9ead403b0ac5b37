"""The algorithm names: every choice name and default the RL math accepts, with no torch import.

The config schema (:mod:`slimectl.contract.config_schema`) validates against these tuples and takes its
defaults from these constants, and the math (:mod:`slimectl.algorithms`) dispatches on them, so a name
added here is accepted everywhere at once.
"""

from __future__ import annotations

#: ``algorithm.advantage_estimator`` (:func:`slimectl.algorithms.advantages.compute_advantages`).
ESTIMATORS: tuple[str, ...] = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
#: Estimators that need a learned critic (:mod:`slimectl.algorithms.gae`; trained by the train stage's critic,
#: ``backends/megatron/critic_trainer.py``); :func:`slimectl.algorithms.advantages.compute_advantages` does not take them.
CRITIC_ESTIMATORS: tuple[str, ...] = ("ppo",)
#: Estimators whose advantage is the (normalized) reward broadcast over the response.
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "gspo", "cispo")
#: ``algorithm.kl_loss_type`` (:func:`slimectl.algorithms.kl.compute_approx_kl`).
KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl")
#: Loss reductions (:func:`slimectl.algorithms.reduce.reduce_masked`); ``algorithm.calculate_per_token_loss``
#: picks ``token_mean``.
REDUCTION_MODES: tuple[str, ...] = ("sample_mean", "token_mean")
#: ``algorithm.reward_normalization`` (:func:`slimectl.algorithms.rewards.normalize_group_rewards`).
REWARD_NORM_MODES: tuple[str, ...] = ("group_mean_std", "group_mean", "none")
#: ``algorithm.loss_type`` (:func:`slimectl.algorithms.objective.compute_objective`).
LOSS_TYPES: tuple[str, ...] = ("policy_loss", "sft_loss", "custom_loss")
#: ``algorithm.tis_mode``: ``truncate`` clamps the TIS weight (slime ``vanilla_tis_function``), ``mask`` zeroes
#: tokens whose weight leaves the range (slime ``icepop_function``).
TIS_MODES: tuple[str, ...] = ("truncate", "mask")

DEFAULT_ESTIMATOR = "grpo"
DEFAULT_LOSS_TYPE = "policy_loss"
#: ``algorithm.reward_normalization: null`` means slime's rule for the estimator (:func:`default_reward_norm`).
DEFAULT_REWARD_NORM = None
DEFAULT_KL_LOSS_TYPE = "k1"
DEFAULT_TIS_MODE = "truncate"
#: OPSM: a sequence with a negative advantage is masked when its mean ``old_lp - lp`` exceeds this.
DEFAULT_OPSM_DELTA = 1e-4
#: PPO clip range ``[1 - eps_clip, 1 + eps_clip_high]`` (``eps_clip_high`` defaults to ``eps_clip``).
DEFAULT_EPS_CLIP = 0.2
#: Truncated importance sampling clamp ``[tis_clip_low, tis_clip]``.
DEFAULT_TIS_CLIP = 2.0
DEFAULT_TIS_CLIP_LOW = 0.0
#: On-policy distillation: ``A_t -= opd_kl_coef * (log pi_student - log pi_teacher)``.
DEFAULT_OPD_KL_COEF = 1.0
#: Discount and GAE lambda (slime ``--gamma``, ``--lambd``; both 1.0 there).
DEFAULT_GAMMA = 1.0
DEFAULT_LAMBD = 1.0
#: Critic value clip (slime ``--value-clip``): ``V_old + clamp(V - V_old, -value_clip, value_clip)``.
DEFAULT_VALUE_CLIP = 0.2
#: Rollouts at the start during which only the critic trains (slime ``--num-critic-only-steps``).
DEFAULT_NUM_CRITIC_ONLY_STEPS = 0


def default_reward_norm(estimator: str) -> str:
    """slime's reward post-processing for an estimator with its default flags: group mean+std for
    grpo/gspo/cispo, the group mean for reinforce_plus_plus_baseline, none for reinforce_plus_plus."""
    if estimator in GROUP_ESTIMATORS:
        return "group_mean_std"
    if estimator == "reinforce_plus_plus_baseline":
        return "group_mean"
    return "none"


def default_normalize_advantages(estimator: str) -> bool:
    """slime's whitening for an estimator: required (on) for both REINFORCE++ variants, off otherwise."""
    return estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def check_choice(kind: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; otherwise a one-line ValueError listing them."""
    if value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(choices)}")
    return value
