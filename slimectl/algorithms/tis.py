"""Truncated importance sampling for the train/inference mismatch (slime:
``slime/backends/megatron_utils/loss.py::vanilla_tis_function``, ``--use-tis``,
``--get-mismatch-metrics``).

The rollout engine (SGLang) and the trainer (Megatron) compute slightly different log-probs for
the same tokens. With ``old_lp`` the trainer's old-policy log-probs and ``rollout_lp`` the
engine's, per token::

    tis          = exp(old_lp - rollout_lp)                   # pi_train_old / pi_rollout
    tis_weights  = clamp(tis, tis_clip_low, tis_clip)          # defaults 0 and 2.0
    tis_clipfrac = (tis_weights != tis)
    tis_abs      = |tis - 1|
    pg_loss      = pg_loss * tis_weights                       # before reduction

``mode="mask"`` (slime ``icepop_function``) keeps the raw ratio inside ``[tis_clip_low, tis_clip]``
and gives weight 0 outside it (the token is dropped instead of truncated)::

    tis_weights  = where(tis_clip_low <= tis <= tis_clip, tis, 0)

The weights carry no gradient (slime builds them from stored / detached log-probs).
``train_rollout_logprob_abs_diff = reduce(|train_lp - rollout_lp|)`` is the headline mismatch
metric; here two KL estimates of ``KL(pi_rollout || pi_train)`` are reported too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimectl.algorithms.reduce import ReductionMode, masked, reduce_masked
from slimectl.contract.algorithm_names import DEFAULT_TIS_CLIP, DEFAULT_TIS_CLIP_LOW, DEFAULT_TIS_MODE, TIS_MODES, check_choice


@dataclass
class TISOutput:
    """Per-token TIS quantities (``[B, T]``, 0 where ``mask == 0``)."""

    weights: torch.Tensor  # clamp(tis, low, high), detached
    tis: torch.Tensor  # raw ratio exp(old_lp - rollout_lp)
    clipfrac: torch.Tensor  # 1.0 where the clamp changed the ratio
    tis_abs: torch.Tensor  # |tis - 1|
    mask: torch.Tensor

    def metrics(self, reduction: ReductionMode = "sample_mean") -> dict[str, torch.Tensor]:
        """slime's ``tis``, ``tis_clipfrac``, ``tis_abs`` metrics, reduced."""
        return {
            "tis": reduce_masked(self.tis, self.mask, reduction),
            "tis_clipfrac": reduce_masked(self.clipfrac, self.mask, reduction),
            "tis_abs": reduce_masked(self.tis_abs, self.mask, reduction),
        }


def compute_tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_clip: float = DEFAULT_TIS_CLIP,
    tis_clip_low: float = DEFAULT_TIS_CLIP_LOW,
    mode: str = DEFAULT_TIS_MODE,
) -> TISOutput:
    """Token-level TIS weights: ``truncate`` (vanilla) or ``mask`` (IcePop); see the module docstring."""
    check_choice("tis mode", mode, TIS_MODES)
    if tis_clip_low > tis_clip:
        raise ValueError(f"tis_clip_low {tis_clip_low} > tis_clip {tis_clip}")
    with torch.no_grad():
        log_ratio = masked(old_log_probs.detach() - rollout_log_probs.detach().to(old_log_probs.dtype), mask)
        tis = log_ratio.exp()
        if mode == "truncate":
            weights = tis.clamp(min=tis_clip_low, max=tis_clip)
        else:
            weights = torch.where((tis >= tis_clip_low) & (tis <= tis_clip), tis, torch.zeros_like(tis))
        clipfrac = (weights != tis).to(tis.dtype)
        return TISOutput(
            weights=masked(weights, mask),
            tis=masked(tis, mask),
            clipfrac=masked(clipfrac, mask),
            tis_abs=masked((tis - 1).abs(), mask),
            mask=mask,
        )


def apply_tis(pg_loss: torch.Tensor, weights: torch.Tensor | TISOutput) -> torch.Tensor:
    """``pg_loss * weights`` per token (apply before reducing)."""
    w = weights.weights if isinstance(weights, TISOutput) else weights
    return pg_loss * w.detach()


def logprob_abs_diff(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    reduction: ReductionMode = "sample_mean",
) -> torch.Tensor:
    """slime's ``train_rollout_logprob_abs_diff``: ``reduce(|train_lp - rollout_lp|)`` (detached)."""
    with torch.no_grad():
        t = train_log_probs.detach()
        return reduce_masked(masked(t - rollout_log_probs.detach().to(t.dtype), mask).abs(), mask, reduction)
