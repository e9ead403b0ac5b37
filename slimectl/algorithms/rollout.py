"""A rollout's advantages from the typed algorithm section: reward normalisation, then the estimator (or the
critic's GAE), OPD shaping and whitening, in slime's order.

The one place the trainer's advantages are made: the Megatron actor calls :func:`rollout_advantages` on the
rollout it trains, and PPO's path calls it with the critic's values (also while only the critic trains).
Every setting comes from the :class:`~slimectl.contract.config_schema.AlgorithmSection` itself, its null keys
resolved there (``effective_reward_normalization``, ``effective_normalize_advantages``)::

    rewards = normalize_rewards_by_group(raw rewards, group ids, effective_reward_normalization)
    ppo:    GAE(rewards, values, gamma, lambd, KL reward)              -> advantages, returns
    other:  estimator(rewards) -> OPD (teacher_log_probs) -> whitening -> advantages, returns
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from slimectl.algorithms.advantages import AdvantageResult, compute_advantages
from slimectl.algorithms.gae import GAEResult, compute_gae
from slimectl.algorithms.objective import slime_args
from slimectl.algorithms.rewards import normalize_rewards_by_group
from slimectl.contract.algorithm_names import CRITIC_ESTIMATORS

if TYPE_CHECKING:
    from slimectl.contract.config_schema import AlgorithmSection


@dataclass
class RolloutTensors:
    """What a rollout's advantages are computed from: one row per sample, right-padded to ``[B, T]``."""

    rewards: torch.Tensor
    """``[B]`` raw rewards (before the group normalisation)."""
    group_ids: Sequence[Hashable]
    """Each sample's group (samples of one prompt share one)."""
    mask: torch.Tensor
    """``[B, T]`` loss mask of the response tokens."""
    lengths: list[int]
    """Each sample's response length."""
    log_probs: torch.Tensor | None = None
    """``[B, T]`` old-policy log-probs (recomputed, or the rollout's): the KL reward and OPD's student."""
    ref_log_probs: torch.Tensor | None = None
    """``[B, T]`` the reference model's log-probs (the KL reward)."""
    teacher_log_probs: torch.Tensor | None = None
    """``[B, T]`` on-policy distillation's teacher log-probs (OPD is on when given)."""
    values: torch.Tensor | None = None
    """``[B, T']`` the critic's values of the response tokens (ppo), padded to the mask's width here."""


def rollout_advantages(cfg: "AlgorithmSection", t: RolloutTensors) -> AdvantageResult | GAEResult:
    """The rollout's ``[B, T]`` advantages and returns (``.advantages``, ``.returns``, ``.kl``) under ``cfg``."""
    rewards = normalize_rewards_by_group(t.rewards, t.group_ids, cfg.effective_reward_normalization)
    if cfg.advantage_estimator in CRITIC_ESTIMATORS:
        if t.values is None:
            raise ValueError(f"advantage_estimator {cfg.advantage_estimator} needs the critic's values")
        values = t.values
        if values.shape[-1] < t.mask.shape[-1]:
            values = torch.nn.functional.pad(values, (0, t.mask.shape[-1] - values.shape[-1]))
        return compute_gae(rewards, values, t.mask, gamma=cfg.gamma, lambd=cfg.lambd, log_probs=t.log_probs,
                           ref_log_probs=t.ref_log_probs, kl_coef=cfg.kl_coef, kl_type=cfg.kl_loss_type,
                           normalize_advantages=cfg.effective_normalize_advantages)
    return compute_advantages(
        cfg.advantage_estimator, rewards, t.mask, log_probs=t.log_probs, ref_log_probs=t.ref_log_probs,
        kl_coef=cfg.kl_coef, kl_type=cfg.kl_loss_type, gamma=cfg.gamma,
        # on-policy distillation: A_t -= coef * (log pi_student - log pi_teacher), after the estimator and
        # before the whitening (slime's order)
        teacher_log_probs=t.teacher_log_probs, opd_kl_coef=cfg.opd_kl_coef,
        normalize_advantages=cfg.effective_normalize_advantages, args=slime_args(cfg),
        custom_advantage_function=cfg.hooks.get("custom_advantage_function"), lengths=t.lengths)
