"""The per-micro-batch training objective: policy loss, TIS, entropy, KL and metrics, composed from typed settings.

slime's ``policy_loss_function`` / ``sft_loss_function`` in one pure function::

    pg      = PPO clip (clip-higher, dual clip) | GSPO (sequence ratio) | CISPO     # by estimator
    pg     *= opsm_keep                                                              # use_opsm
    pg     *= clamp(exp(trainer_old_lp - rollout_lp), tis_clip_low, tis_clip)      # use_tis (tis_mode
              (or the IcePop mask, or custom_tis_function(args, pg_loss=..., ...))   #  / custom hook)
              (use_decoupled_loss: AReaL's behaviour weight = the IcePop mask on [0, behav_imp_weight_cap])
    loss    = reduce(pg)   (custom_pg_loss_reducer: its reducer)  (sft_loss: -reduce(log_probs))
    loss   -= entropy_coef * reduce(entropy)                                         # entropy_coef != 0
    loss   += kl_loss_coef * reduce(approx_kl(log_probs, ref_lp, kl_loss_type      # use_kl_loss
                                               [, ratio = exp(lp - old_lp)]))         # use_unbiased_kl
    (loss_type custom_loss: custom_loss_function(args, batch, logits, sum_of_sample_mean))

Custom hooks take slime's signatures and its concatenated per-sample layout (``x.split(response_lengths)``);
slime's reducers return a *sum* over the micro-batch's samples (or tokens) that its trainer divides by
the step's sample (token) count, so the hooks' results are divided here by the micro-batch's sample
count (``loss_token_count`` per token) to stay in this module's mean-per-micro-batch convention.

``reduce`` is the configured reduction (``sample_mean`` or ``token_mean``, :mod:`.reduce`).
Metrics (detached 0-dim tensors, slime's names under ``train/``): ``loss``, ``pg_loss``,
``entropy``, and as the inputs allow ``pg_clipfrac``, ``ppo_kl``, ``kl_loss``, ``tis``,
``tis_clipfrac``, ``tis_abs``, ``behav_imp_weight`` (``use_decoupled_loss``), ``opd_reverse_kl`` (student - teacher; the shaping itself is in
the advantages) and ``train_rollout_logprob_abs_diff``.

The caller pads one row per sample (:class:`ObjectiveBatch`) and weights the result by the
micro-batch's share of the global batch; nothing here knows about Megatron or micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from slimectl.algorithms.kl import kl_loss
from slimectl.algorithms.opd import opd_reverse_kl
from slimectl.algorithms.policy_loss import (
    cispo_policy_loss,
    entropy_bonus,
    gspo_policy_loss,
    opsm_mask,
    ppo_policy_loss,
    sft_loss,
)
from slimectl.algorithms.reduce import (
    from_concat,
    loss_token_count,
    masked,
    reduce_masked,
    response_lengths,
    sum_of_sample_mean_fn,
    to_concat,
    to_list,
)
from slimectl.algorithms.tis import apply_tis, compute_tis_weights, logprob_abs_diff

if TYPE_CHECKING:
    from slimectl.contract.config_schema import AlgorithmSection


def slime_args(cfg: "AlgorithmSection") -> SimpleNamespace:
    """The ``args`` namespace slime's hooks read: the section's keys under slime's names (they are the same),
    with the resolved upper clip and TIS settings (``use_decoupled_loss`` resolved into them)."""
    return SimpleNamespace(**{**cfg.model_dump(), "eps_clip_high": cfg.effective_eps_clip_high,
                              "use_tis": cfg.effective_use_tis, "tis_mode": cfg.effective_tis_mode,
                              "tis_clip": cfg.effective_tis_clip, "tis_clip_low": cfg.effective_tis_clip_low})


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
    response_lengths: list[int] | None = None
    """Each row's response length (slime's ``response_lengths`` for the hooks); default: up to the last
    loss token of the row."""
    total_lengths: list[int] | None = None
    """Prompt + response lengths for the hooks; default: ``response_lengths``."""
    logits: torch.Tensor | None = None
    """The micro-batch's logits, when the caller has them, for a custom loss (``None`` otherwise)."""

    def lengths(self) -> tuple[list[int], list[int]]:
        resp = self.response_lengths if self.response_lengths is not None else response_lengths(self.mask)
        return resp, (self.total_lengths if self.total_lengths is not None else list(resp))


def _need(batch: ObjectiveBatch, field: str, why: str) -> torch.Tensor:
    value = getattr(batch, field)
    if value is None:
        raise ValueError(f"the objective needs ObjectiveBatch.{field} for {why}")
    return value


def _policy_loss(cfg: "AlgorithmSection", batch: ObjectiveBatch):
    old = _need(batch, "old_log_probs", "the policy loss")
    adv = _need(batch, "advantages", "the policy loss")
    clip = {"eps_clip": cfg.eps_clip, "eps_clip_high": cfg.effective_eps_clip_high}
    if cfg.advantage_estimator == "gspo":
        return gspo_policy_loss(batch.log_probs, old, adv, batch.mask, eps_clip_c=cfg.eps_clip_c, **clip)
    if cfg.advantage_estimator == "cispo":
        return cispo_policy_loss(batch.log_probs, old, adv, batch.mask, **clip)
    return ppo_policy_loss(batch.log_probs, old, adv, batch.mask, eps_clip_c=cfg.eps_clip_c, **clip)


def _hook_denominator(cfg: "AlgorithmSection", mask: torch.Tensor) -> torch.Tensor:
    """What turns slime's per-micro-batch *sum* (of sample means, or of tokens) into this module's mean."""
    if cfg.reduction == "token_mean":
        return loss_token_count(mask)
    return torch.tensor(float(max(mask.shape[0], 1)))


def _custom_tis(cfg: "AlgorithmSection", batch: ObjectiveBatch, pg_tok: torch.Tensor, metrics: dict, mode: str):
    """Call slime's TIS hook on the concatenated layout; returns the padded pg_loss with the hook's
    modified masks applied (rejected tokens 0; the denominators stay the original loss masks', as slime)."""
    mask = batch.mask
    resp, total = batch.lengths()
    T = mask.shape[-1]
    pg, masks, tis_metrics = cfg.hooks["custom_tis_function"](
        args=slime_args(cfg), pg_loss=to_concat(pg_tok, resp),
        train_log_probs=to_list(_need(batch, "trainer_old_log_probs", "use_tis").detach(), resp),
        rollout_log_probs=to_list(_need(batch, "rollout_log_probs", "use_tis").detach(), resp),
        loss_masks=to_list(mask, resp), total_lengths=total, response_lengths=resp)
    new_mask = torch.zeros_like(mask)
    for i, m in enumerate(masks):
        new_mask[i, : len(m)] = torch.as_tensor(m).to(mask.dtype)
    for k, v in tis_metrics.items():
        v = torch.as_tensor(v)
        val = reduce_masked(from_concat(v.detach().reshape(-1), resp, T), mask, mode) if v.numel() == sum(resp) else v
        metrics[f"train/{k}"] = val.detach().to(pg_tok.dtype).reshape(())
    return masked(from_concat(pg, resp, T), new_mask * mask)


def _tis(cfg: "AlgorithmSection", batch: ObjectiveBatch, pg_tok: torch.Tensor, metrics: dict) -> torch.Tensor:
    """``pg_tok`` times the TIS weights (``use_tis``, or the decoupled objective's behaviour weight, which is
    TIS's mask mode capped above only); their metrics into ``metrics``."""
    why = "use_decoupled_loss" if cfg.use_decoupled_loss else "use_tis"
    tis = compute_tis_weights(_need(batch, "trainer_old_log_probs", why), _need(batch, "rollout_log_probs", why),
                              batch.mask, tis_clip=cfg.effective_tis_clip, tis_clip_low=cfg.effective_tis_clip_low,
                              mode=cfg.effective_tis_mode)
    metrics.update({f"train/{k}": v for k, v in tis.metrics(cfg.reduction).items()})
    if cfg.use_decoupled_loss:  # AReaL's behave_imp_weight: the weight's mean over the tokens the cap kept
        metrics["train/behav_imp_weight"] = reduce_masked(tis.weights, batch.mask - tis.clipfrac, cfg.reduction)
    return apply_tis(pg_tok, tis)


def _custom_loss(cfg: "AlgorithmSection", batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """slime's ``custom_loss``: ``fn(args, batch, logits, sum_of_sample_mean)`` with slime's batch keys
    (per-sample lists) plus ``cur_log_probs`` / ``entropy`` (the current policy's, with gradient)."""
    mask = batch.mask
    resp, total = batch.lengths()
    per = {
        "log_probs": batch.old_log_probs, "advantages": batch.advantages, "ref_log_probs": batch.ref_log_probs,
        "rollout_log_probs": batch.rollout_log_probs, "teacher_log_probs": batch.teacher_log_probs,
        "cur_log_probs": batch.log_probs, "entropy": batch.entropy,
    }
    sbatch: dict[str, Any] = {k: to_list(v, resp) for k, v in per.items() if v is not None}
    sbatch.update(loss_masks=to_list(mask, resp), response_lengths=resp, total_lengths=total)
    som = sum_of_sample_mean_fn(mask, resp, cfg.reduction == "token_mean")
    loss, log = cfg.hooks["custom_loss_function"](slime_args(cfg), sbatch, batch.logits, som)
    denom = _hook_denominator(cfg, mask).to(loss.dtype)
    metrics = {f"train/{k}": torch.as_tensor(v).detach().float().reshape(()) / denom for k, v in log.items()}
    loss = loss / denom
    metrics["train/loss"] = loss.detach()
    return loss, metrics


def compute_objective(cfg: "AlgorithmSection", batch: ObjectiveBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` for one micro-batch: the scalar to backpropagate and detached 0-dim metrics."""
    mode, mask = cfg.reduction, batch.mask
    if cfg.loss_type == "custom_loss":
        return _custom_loss(cfg, batch)
    metrics: dict[str, torch.Tensor] = {}
    sft = cfg.loss_type == "sft_loss"
    if sft:
        loss = sft_loss(batch.log_probs, mask, mode)
        metrics["train/pg_loss"] = torch.zeros((), dtype=loss.dtype)
    else:
        out = _policy_loss(cfg, batch)
        pg_tok = out.pg_loss
        if cfg.use_opsm:
            opsm = opsm_mask(batch.log_probs, _need(batch, "old_log_probs", "use_opsm"),
                             _need(batch, "advantages", "use_opsm"), mask, cfg.opsm_delta)
            pg_tok = pg_tok * opsm.keep
            metrics["train/opsm_clipfrac"] = reduce_masked(opsm.dropped, mask, mode)
        if cfg.use_tis and cfg.custom_tis_function:
            pg_tok = _custom_tis(cfg, batch, pg_tok, metrics, mode)
        elif cfg.effective_use_tis:
            pg_tok = _tis(cfg, batch, pg_tok, metrics)
        if cfg.custom_pg_loss_reducer:
            resp, total = batch.lengths()
            reducer = cfg.hooks["custom_pg_loss_reducer"](total, resp, to_list(mask, resp), mode == "token_mean")
            loss = reducer(to_concat(pg_tok, resp)) / _hook_denominator(cfg, mask).to(pg_tok.dtype)
        else:
            loss = reduce_masked(pg_tok, mask, mode)
        metrics["train/pg_loss"] = loss.detach()
        metrics["train/pg_clipfrac"] = reduce_masked(out.clipfrac.detach(), mask, mode)
        metrics["train/ppo_kl"] = reduce_masked(out.ppo_kl.detach(), mask, mode)
    if cfg.entropy_coef:
        loss = loss + entropy_bonus(_need(batch, "entropy", "entropy_coef"), mask, cfg.entropy_coef, mode)
    if cfg.use_kl_loss:
        unbiased_old = _need(batch, "old_log_probs", "use_unbiased_kl").detach() if cfg.use_unbiased_kl else None
        kl = kl_loss(batch.log_probs, _need(batch, "ref_log_probs", "use_kl_loss").detach(), mask, cfg.kl_loss_type,
                     old_log_probs=unbiased_old, reduction=mode)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["train/kl_loss"] = kl.detach()
    if cfg.use_opd and not sft:
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
