"""RL post-training math in slime's definitions: pure functions over torch tensors.

Representation: padded ``[B, T]`` per-token tensors (response tokens, right-padded) plus a mask
of the same shape (slime's ``loss_mask``); per-sample values are ``[B]``. Only ``torch`` is
imported (``tests/test_walls.py`` enforces it).

Modules: :mod:`.rewards` (group reward normalization), :mod:`.advantages` (GRPO/GSPO,
REINFORCE++, REINFORCE++-baseline, whitening), :mod:`.kl` (k1/k2/k3/low_var_kl),
:mod:`.policy_loss` (PPO clip, clip-higher, dual clip, GSPO, entropy, SFT), :mod:`.tis`
(truncated importance sampling, mismatch metrics), :mod:`.opd` (on-policy distillation shaping),
:mod:`.reduce` (per-sample vs per-token loss reduction).
"""

from __future__ import annotations

from slimectl.algorithms.advantages import (
    ESTIMATORS,
    AdvantageResult,
    broadcast_to_tokens,
    compute_advantages,
    discounted_cumsum,
    grpo_advantages,
    gspo_advantages,
    last_valid_index,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
    whiten_advantages,
)
from slimectl.algorithms.kl import KL_TYPES, compute_approx_kl, kl_loss
from slimectl.algorithms.opd import apply_opd_kl, opd_reverse_kl
from slimectl.algorithms.policy_loss import (
    PolicyLossOutput,
    clipped_surrogate,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    gspo_sequence_kl,
    log_probs_from_logits,
    ppo_policy_loss,
    sft_loss,
)
from slimectl.algorithms.reduce import (
    REDUCTION_MODES,
    masked,
    masked_sum,
    per_sample_mean,
    reduce_masked,
    reduction_mode,
    sample_mean,
    token_mean,
)
from slimectl.algorithms.rewards import REWARD_NORM_MODES, normalize_group_rewards, reward_norm_mode_for
from slimectl.algorithms.tis import TISOutput, apply_tis, compute_tis_weights, mismatch_metrics

__all__ = [
    "ESTIMATORS",
    "KL_TYPES",
    "REDUCTION_MODES",
    "REWARD_NORM_MODES",
    "AdvantageResult",
    "PolicyLossOutput",
    "TISOutput",
    "apply_opd_kl",
    "apply_tis",
    "broadcast_to_tokens",
    "clipped_surrogate",
    "compute_advantages",
    "compute_approx_kl",
    "compute_tis_weights",
    "discounted_cumsum",
    "entropy_bonus",
    "entropy_from_logits",
    "grpo_advantages",
    "gspo_advantages",
    "gspo_policy_loss",
    "gspo_sequence_kl",
    "kl_loss",
    "last_valid_index",
    "log_probs_from_logits",
    "masked",
    "masked_sum",
    "mismatch_metrics",
    "normalize_group_rewards",
    "opd_reverse_kl",
    "per_sample_mean",
    "ppo_policy_loss",
    "reduce_masked",
    "reduction_mode",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns",
    "reward_norm_mode_for",
    "sample_mean",
    "sft_loss",
    "token_mean",
    "whiten_advantages",
]
