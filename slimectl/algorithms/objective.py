"""The per-micro-batch training objective: policy loss, TIS, entropy, KL and metrics, composed from typed settings.

slime's ``policy_loss_function`` / ``sft_loss_function`` in one pure function::

    pg      = PPO clip (clip-higher, dual clip) | GSPO (sequence ratio) | CISPO     # by estimator
    pg     *= clamp(exp(trainer_old_lp - rollout_lp), tis_clip_low, tis_clip)      # use_tis
    loss    = reduce(pg)                      (loss_type sft_loss: -reduce(log_probs))
    loss   -= entropy_coef * reduce(entropy)                                         # entropy_coef != 0
    loss   += kl_loss_coef * reduce(approx_kl(log_probs, ref_lp, kl_loss_type))      # use_kl_loss

``reduce`` is the configured reduction (``sample_mean`` or ``token_mean``, :mod:`.reduce`).
Metrics (detached 0-dim tensors, slime's names under ``train/``): ``loss``, ``pg_loss``,
``entropy``, and as the inputs allow ``pg_clipfrac``, ``ppo_kl``, ``kl_loss``, ``tis``,
``tis_clipfrac``, ``tis_abs``, ``opd_reverse_kl`` (student - teacher; the shaping itself is in
the advantages) and ``train_rollout_logprob_abs_diff``.

The caller pads one row per sample (:class:`ObjectiveBatch`) and weights the result by the
micro-batch's share of the global batch; nothing here knows about Megatron or micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slimectl.algorithms.kl import kl_loss
from slimectl.algorithms.opd import opd_reverse_kl
from slimectl.algorithms.policy_loss import cispo_policy_loss, entropy_bonus, gspo_policy_loss, ppo_policy_loss, sft_loss
from slimectl.algorithms.reduce import reduce_masked, reduction_mode
from slimectl.algorithms.registry import (
    DEFAULT_EPS_CLIP,
    DEFAULT_ESTIMATOR,
    DEFAULT_KL_LOSS_TYPE,
    DEFAULT_LOSS_TYPE,
    DEFAULT_TIS_CLIP,
    DEFAULT_TIS_CLIP_LOW,
    ESTIMATORS,
    KL_TYPES,
    LOSS_TYPES,
    REDUCTION_MODES,
    check_choice,
)
from slimectl.algorithms.tis import apply_tis, compute_tis_weights, logprob_abs_diff


@dataclass(frozen=True)
class ObjectiveConfig:
    """The settings of the objective (the loss-side subset of the config's ``algorithm`` section)."""

    loss_type: str = DEFAULT_LOSS_TYPE
    advantage_estimator: str = DEFAULT_ESTIMATOR
    eps_clip: float = DEFAULT_EPS_CLIP
    eps_clip_high: float | None = None
    """Upper clip (clip-higher); ``None`` means ``eps_clip``."""
    eps_clip_c: float | None = None
    """Dual-clip constant (> 1); ``None`` turns it off."""
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = DEFAULT_KL_LOSS_TYPE
    use_tis: bool = False
    tis_clip: float = DEFAULT_TIS_CLIP
    tis_clip_low: float = DEFAULT_TIS_CLIP_LOW
    use_opd: bool = False
    reduction: str = "sample_mean"

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("advantage estimator", self.advantage_estimator, ESTIMATORS)
        check_choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        check_choice("reduction mode", self.reduction, REDUCTION_MODES)

    @classmethod
    def from_section(cls, algo: Any) -> "ObjectiveConfig":
        """From the config's ``algorithm`` section (read by attribute, so no config import here)."""
        return cls(
            loss_type=algo.loss_type, advantage_estimator=algo.advantage_estimator,
            eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, eps_clip_c=algo.eps_clip_c,
            entropy_coef=algo.entropy_coef, use_kl_loss=algo.use_kl_loss, kl_loss_coef=algo.kl_loss_coef,
            kl_loss_type=algo.kl_loss_type, use_tis=algo.use_tis, tis_clip=algo.tis_clip,
            tis_clip_low=algo.tis_clip_low, use_opd=algo.use_opd,
            reduction=reduction_mode(algo.calculate_per_token_loss),
        )

    @property
    def sft(self) -> bool:
        return self.loss_type == "sft_loss"


@dataclass
class ObjectiveBatch:
    """One micro-batch as padded ``[B, T]`` rows of response tokens plus their loss ``mask``.

    Only ``log_probs`` and ``entropy`` carry gradient; every other tensor is used detached.
    """

    log_probs: torch.Tensor
    """Current policy's log-probs of the sampled tokens."""
    mask: torch.Tensor
    """1 where the token is trained on (slime's ``loss_mask``), 0 on padding and masked tokens."""
    entropy: torch.Tensor | None = None
    """Current policy's per-token entropy (the ``train/entropy`` metric and the entropy bonus)."""
    old_log_probs: torch.Tensor | None = None
    """The ratio's old policy: the trainer's recomputed log-probs, or the rollout's (``use_rollout_logprobs``)."""
    advantages: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    """The frozen reference's log-probs (``use_kl_loss``)."""
    trainer_old_log_probs: torch.Tensor | None = None
    """The trainer's own old-policy log-probs: TIS numerator and the mismatch metric."""
    rollout_log_probs: torch.Tensor | None = None
    """The engine's log-probs of the sampled tokens: TIS denominator and the mismatch metric."""
    teacher_log_probs: torch.Tensor | None = None
    """On-policy distillation: the teacher's log-probs (the ``opd_reverse_kl`` metric)."""


def _need(batch: ObjectiveBatch, field: str, why: str) -> torch.Tensor:
    value = getattr(batch, field)
    if value is None:
        raise ValueError(f"the objective needs ObjectiveBatch.{field} for {why}")
    return value


def _policy_loss(cfg: ObjectiveConfig, batch: ObjectiveBatch):
    old = _need(batch, "old_log_probs", "the policy loss")
    adv = _need(batch, "advantages", "the policy loss")
    clip = {"eps_clip": cfg.eps_clip, "eps_clip_high": cfg.eps_clip_high}
    if cfg.advantage_estimator == "gspo":
        return gspo_policy_loss(batch.log_probs, old, adv, batch.mask, eps_clip_c=cfg.eps_clip_c, **clip)
    if cfg.advantage_estimator == "cispo":
        return cispo_policy_loss(batch.log_probs, old, adv, batch.mask, **clip)
    return ppo_policy_loss(batch.log_probs, old, adv, batch.mask, eps_clip_c=cfg.eps_clip_c, **clip)


def compute_objective(cfg: ObjectiveConfig, batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` for one micro-batch: the scalar to backpropagate and detached 0-dim metrics."""
    mode, mask = cfg.reduction, batch.mask
    metrics: dict[str, torch.Tensor] = {}
    if cfg.sft:
        loss = sft_loss(batch.log_probs, mask, mode)
        metrics["train/pg_loss"] = torch.zeros((), dtype=loss.dtype)
    else:
        out = _policy_loss(cfg, batch)
        pg_tok = out.pg_loss
        if cfg.use_tis:
            tis = compute_tis_weights(_need(batch, "trainer_old_log_probs", "use_tis"),
                                      _need(batch, "rollout_log_probs", "use_tis"), mask,
                                      tis_clip=cfg.tis_clip, tis_clip_low=cfg.tis_clip_low)
            pg_tok = apply_tis(pg_tok, tis)
            metrics.update({f"train/{k}": v for k, v in tis.metrics(mode).items()})
        loss = reduce_masked(pg_tok, mask, mode)
        metrics["train/pg_loss"] = loss.detach()
        metrics["train/pg_clipfrac"] = reduce_masked(out.clipfrac.detach(), mask, mode)
        metrics["train/ppo_kl"] = reduce_masked(out.ppo_kl.detach(), mask, mode)
    if cfg.entropy_coef:
        loss = loss + entropy_bonus(_need(batch, "entropy", "entropy_coef"), mask, cfg.entropy_coef, mode)
    if cfg.use_kl_loss:
        kl = kl_loss(batch.log_probs, _need(batch, "ref_log_probs", "use_kl_loss").detach(), mask, cfg.kl_loss_type,
                     reduction=mode)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["train/kl_loss"] = kl.detach()
    if cfg.use_opd and not cfg.sft:
        student = _need(batch, "old_log_probs", "use_opd")
        rkl = opd_reverse_kl(student, _need(batch, "teacher_log_probs", "use_opd"), mask)
        metrics["train/opd_reverse_kl"] = reduce_masked(rkl, mask, mode)
    if batch.trainer_old_log_probs is not None and batch.rollout_log_probs is not None:
        metrics["train/train_rollout_logprob_abs_diff"] = logprob_abs_diff(
            batch.trainer_old_log_probs, batch.rollout_log_probs, mask, mode)
    if batch.entropy is not None:
        metrics["train/entropy"] = reduce_masked(batch.entropy.detach(), mask, mode)
    metrics["train/loss"] = loss.detach()
    return loss, metrics
