"""Policy losses (slime: ``slime/utils/ppo_utils.py::compute_policy_loss`` / ``compute_gspo_kl``,
``slime/backends/megatron_utils/loss.py::policy_loss_function`` / ``sft_loss_function``).

Per token, with ``ppo_kl = old_lp - lp`` and ``ratio = exp(-ppo_kl) = pi_theta / pi_old``::

    pg1 = -ratio * A
    pg2 = -clamp(ratio, 1 - eps_clip, 1 + eps_clip_high) * A     # clip-higher: eps_clip_high
    pg  = max(pg1, pg2);  clipfrac = (pg2 > pg1)
    dual clip (eps_clip_c > 1):  pg = where(A < 0, min(-eps_clip_c * A, pg), pg)

The dual clip bounds the loss of a negative-advantage token at ``-eps_clip_c * A`` however large
the ratio gets; slime's ``clipfrac`` does not count it. ``eps_clip_high=None`` means
``eps_clip`` (slime's default).

GSPO: ``ppo_kl`` is replaced by the sequence value ``sum_t (old_lp - lp) * m / max(sum_t m, 1)``
broadcast to each token, so the ratio is the geometric mean of the token ratios over the valid
response tokens; the gradient flows through that mean.

CISPO: ``pg = -sg(clamp(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * log_probs`` (the clipped
ratio is a constant; the gradient flows through the log-probs).

Tensors are padded ``[B, T]`` with a ``mask``; per-token outputs are exactly 0 where
``mask == 0``, and padding never reaches an ``exp``, so it cannot create nan/inf or gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimectl.algorithms.reduce import ReductionMode, masked, reduce_masked
from slimectl.contract.algorithm_names import DEFAULT_EPS_CLIP


@dataclass
class PolicyLossOutput:
    """Per-token results of a clipped policy loss (all ``[B, T]``, 0 where ``mask == 0``)."""

    pg_loss: torch.Tensor
    clipfrac: torch.Tensor  # 1.0 where the clip was active
    ppo_kl: torch.Tensor  # old_lp - lp (GSPO: the sequence value on each token)
    ratio: torch.Tensor  # exp(-ppo_kl); 0 at masked positions
    mask: torch.Tensor

    def loss(self, reduction: ReductionMode = "sample_mean") -> torch.Tensor:
        """The reduced ``pg_loss`` scalar."""
        return reduce_masked(self.pg_loss, self.mask, reduction)

    def metrics(self, reduction: ReductionMode = "sample_mean") -> dict[str, torch.Tensor]:
        """slime's ``pg_loss``, ``pg_clipfrac`` and ``ppo_kl`` metrics (detached scalars)."""
        with torch.no_grad():
            return {
                "pg_loss": reduce_masked(self.pg_loss.detach(), self.mask, reduction),
                "pg_clipfrac": reduce_masked(self.clipfrac, self.mask, reduction),
                "ppo_kl": reduce_masked(self.ppo_kl.detach(), self.mask, reduction),
            }


def clipped_surrogate(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = DEFAULT_EPS_CLIP,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slime's ``compute_policy_loss``: unmasked per-token ``(pg_losses, clipfrac)`` from ``ppo_kl``."""
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).to(ratio.dtype)
    if eps_clip_c is None:
        return clip_pg_losses1, clipfrac
    if not eps_clip_c > 1.0:
        raise ValueError(f"dual-clip eps_clip_c must be > 1.0, got {eps_clip_c}")
    pg_losses3 = -eps_clip_c * advantages
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), clipfrac


def _finish(ppo_kl, advantages, mask, *, eps_clip, eps_clip_high, eps_clip_c) -> PolicyLossOutput:
    adv = masked(advantages.detach().to(ppo_kl.dtype), mask)
    pg, clipfrac = clipped_surrogate(ppo_kl, adv, eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)
    return PolicyLossOutput(
        pg_loss=masked(pg, mask),
        clipfrac=masked(clipfrac, mask),
        ppo_kl=ppo_kl,
        ratio=masked((-ppo_kl).exp(), mask),
        mask=mask,
    )


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = DEFAULT_EPS_CLIP,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossOutput:
    """Token-level PPO/GRPO/REINFORCE++ clipped loss with clip-higher and optional dual clip.

    ``log_probs`` carries the gradient; ``old_log_probs`` and ``advantages`` are treated as
    constants (detached).
    """
    ppo_kl = masked(old_log_probs.detach().to(log_probs.dtype) - log_probs, mask)
    return _finish(ppo_kl, advantages, mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)


def gspo_sequence_kl(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: each row's ``sum_t (old_lp - lp) * m / max(sum_t m, 1)`` on its valid tokens
    (slime ``compute_gspo_kl``); ``exp(-value)`` is the geometric mean of the token ratios."""
    diff = masked(old_log_probs.detach().to(log_probs.dtype) - log_probs, mask)
    counts = mask.to(diff.dtype).sum(-1, keepdim=True).clamp_min(1)
    seq = diff.sum(-1, keepdim=True) / counts
    return masked(seq.expand_as(diff), mask)


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = DEFAULT_EPS_CLIP,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossOutput:
    """GSPO: the clipped loss of :func:`ppo_policy_loss` on the sequence-level ratio.

    (GSPO papers use much smaller clip ranges, e.g. ``3e-4`` / ``4e-4``; pass them explicitly.)
    """
    ppo_kl = gspo_sequence_kl(log_probs, old_log_probs, mask)
    return _finish(ppo_kl, advantages, mask, eps_clip=eps_clip, eps_clip_high=eps_clip_high, eps_clip_c=eps_clip_c)


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float = DEFAULT_EPS_CLIP,
    eps_clip_high: float | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1; slime ``compute_cispo_loss``): ``-sg(clamp(ratio, 1 - eps_clip,
    1 + eps_clip_high)) * A * log_probs`` per token, ``clipfrac = (clamped ratio != ratio)``.

    The clipped ratio is a constant, so the gradient flows through ``log_probs`` only and clipped
    tokens still contribute (canonical CISPO: ``eps_clip >= 1`` disables the lower bound).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ppo_kl = masked(old_log_probs.detach().to(log_probs.dtype) - log_probs, mask)
    adv = masked(advantages.detach().to(log_probs.dtype), mask)
    ratio = (-ppo_kl).exp()
    truncated = ratio.clamp(min=1.0 - eps_clip, max=1.0 + eps_clip_high)
    pg = -truncated.detach() * adv * masked(log_probs, mask)
    return PolicyLossOutput(
        pg_loss=masked(pg, mask),
        clipfrac=masked((truncated != ratio).to(ratio.dtype), mask),
        ppo_kl=ppo_kl,
        ratio=masked(ratio, mask),
        mask=mask,
    )


@dataclass
class OPSMOutput:
    """Off-policy sequence masking (slime ``compute_opsm_mask``)."""

    keep: torch.Tensor  # [B, T] 1.0 = kept, 0.0 = masked out (multiply pg_loss by it)
    dropped: torch.Tensor  # [B, T] 1.0 on the valid tokens OPSM masked
    seq_kl: torch.Tensor  # [B] each sample's mean old_lp - lp over its valid tokens


def opsm_mask(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    opsm_delta: float,
) -> OPSMOutput:
    """OPSM (slime ``--use-opsm``, ``--opsm-delta``): per sample ``seq_kl = sum_t (old_lp - lp) m / max(sum_t m, 1)``;
    a token is masked when ``A_t < 0`` and ``seq_kl > opsm_delta``; ``keep = 1 - that``.

    A sequence that has drifted from the policy that sampled it and was bad is not pushed down any
    further. No gradient flows through the mask. slime's ``opsm_clipfrac`` metric is each sample's
    masked fraction of its tokens, averaged over samples: ``reduce(dropped)``.
    """
    with torch.no_grad():
        lp = log_probs.detach()
        diff = masked(old_log_probs.detach().to(lp.dtype) - lp, mask)
        seq_kl = diff.sum(-1) / mask.to(lp.dtype).sum(-1).clamp_min(1)
        drop = (advantages.detach() < 0) & (seq_kl.unsqueeze(-1) > opsm_delta)
        drop = masked(drop.to(lp.dtype), mask)
        return OPSMOutput(keep=1.0 - drop, dropped=drop, seq_kl=seq_kl)


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    entropy_coef: float,
    reduction: ReductionMode = "sample_mean",
) -> torch.Tensor:
    """The term slime adds to the loss: ``-entropy_coef * reduce(entropy)`` (``--entropy-coef``).

    Adding it to the loss *rewards* entropy (minimizing ``-H`` raises ``H``).
    """
    return -entropy_coef * reduce_masked(entropy, mask, reduction)


def sft_loss(log_probs: torch.Tensor, mask: torch.Tensor, reduction: ReductionMode = "sample_mean") -> torch.Tensor:
    """Negative log-likelihood over the masked tokens: ``-reduce(log_probs)`` (``sft_loss_function``)."""
    return -reduce_masked(log_probs, mask, reduction)
