"""Advantage estimators (slime: ``slime/backends/megatron_utils/loss.py::compute_advantages_and_returns``
and the helpers in ``slime/utils/ppo_utils.py``).

Representation: padded ``[B, T]`` tensors of response tokens, right-padded, plus ``mask``
``[B, T]`` (slime's ``loss_mask``: 1 = trained on). ``rewards`` is one scalar per sample, ``[B]``
(a ``[G, n]`` group tensor is flattened row-major, matching slime's sample order), and is the
*post-processed* reward of :func:`slimectl.algorithms.rewards.normalize_group_rewards`
(slime's ``train_data["rewards"]``).

``response_mask`` (optional, defaults to ``mask``) marks every position that belongs to the
response. It only matters for multi-turn samples whose response holds loss-masked tokens (tool
output): slime applies the per-token KL reward to *all* response tokens, so pass the response
mask to reproduce that exactly; with the default, only trained tokens get the KL term.

Estimators (``A`` = advantages, ``G`` = returns, ``kl_t = approx_kl(old_lp, ref_lp, kl_type)``
where ``old_lp`` is the old-policy log-prob, or the rollout log-prob with
``--use-rollout-logprobs``; ``kl_t = 0`` when ``kl_coef == 0``):

* ``grpo`` / ``gspo`` / ``cispo``: ``A_t = G_t = reward_i`` broadcast over the response. The KL is
  *not* folded in (use a KL loss instead). GSPO and CISPO differ only in their loss (sequence-level
  ratio; clipped ratio under stop-gradient times the log-prob).
* ``reinforce_plus_plus``: ``r_t = -kl_coef * kl_t``; ``r_{last} += reward_i`` where ``last`` is
  the last position with ``mask == 1``; ``G_t = r_t + gamma * G_{t+1}`` (``get_reinforce_plus_plus_returns``);
  ``A = G``.
* ``reinforce_plus_plus_baseline``: ``A_t = (reward_i - group_mean) - kl_coef * kl_t``, ``G = A``
  (``get_reinforce_plus_plus_baseline_advantages``). In slime the group mean is subtracted during
  reward post-processing; pass ``group_size`` to subtract it here instead.
* Then, optionally, OPD shaping (:mod:`slimectl.algorithms.opd`), then ``--normalize-advantages``
  whitening over all valid tokens (``distributed_masked_whiten``), which slime *requires* for both
  REINFORCE++ variants. ``returns`` are never whitened.

All returned advantages are exactly 0 where ``mask == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from slimectl.algorithms.kl import KLType, compute_approx_kl
from slimectl.algorithms.opd import apply_opd_kl
from slimectl.algorithms.reduce import from_list, masked, response_lengths, to_list
from slimectl.contract.algorithm_names import (
    DEFAULT_OPD_KL_COEF,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    check_choice,
    default_normalize_advantages,
)

WHITEN_EPS = 1e-8


def _float_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sample_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r = torch.as_tensor(rewards, device=mask.device).reshape(-1)
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if r.numel() != mask.shape[0]:
        raise ValueError(f"{r.numel()} rewards for {mask.shape[0]} samples")
    return r


def broadcast_to_tokens(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-sample values -> ``[B, T]``, the value on every masked-in token, 0 elsewhere."""
    v = _sample_rewards(values, mask)
    v = v.to(_float_dtype(v))
    return masked(v.unsqueeze(-1).expand(mask.shape), mask)


def grpo_advantages(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO: ``A_t = reward_i`` (already group-normalized) on each valid token (``get_grpo_returns``)."""
    return broadcast_to_tokens(rewards, mask)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` index of the last ``mask == 1`` position of each row; raises on an all-zero row
    (slime asserts ``Sequence ... is fully masked``)."""
    m = mask.bool()
    if not bool(m.any(-1).all()):
        bad = (~m.any(-1)).nonzero().flatten().tolist()
        raise ValueError(f"samples {bad} are fully masked")
    T = m.shape[-1]
    return (T - 1) - m.flip(-1).to(torch.int64).argmax(-1)


def discounted_cumsum(token_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last dim (``G_T = 0``)."""
    out = torch.empty_like(token_rewards)
    running = torch.zeros_like(token_rewards[..., 0])
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        running = token_rewards[..., t] + gamma * running
        out[..., t] = running
    return out


def _token_kl(
    log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    kl_coef: float,
    kl_type: KLType,
    where: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    if kl_coef == 0 or log_probs is None:
        return torch.zeros(where.shape, dtype=dtype, device=where.device)
    if ref_log_probs is None:
        raise ValueError("kl_coef != 0 needs ref_log_probs")
    return compute_approx_kl(log_probs.detach(), ref_log_probs.detach(), kl_type, mask=where).to(dtype)


def whiten_advantages(
    advantages: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS, shift_mean: bool = True
) -> torch.Tensor:
    """``--normalize-advantages`` (``distributed_masked_whiten``, single process):

    ``mean = sum(a*m)/N``, ``var = sum(a^2*m)/N - mean^2`` times ``N/(N-1)`` when ``N >= 2``
    (Bessel), ``a' = (a - mean) / sqrt(var + eps)``; with ``shift_mean=False`` the mean is added
    back. ``N`` = number of valid tokens; raises when it is 0. Masked positions come out 0.
    """
    a = masked(advantages, mask)
    n = mask.to(a.dtype).sum()
    if n.item() == 0:
        raise ValueError("cannot whiten: the mask selects no token")
    mean = a.sum() / n
    var = (a * a).sum() / n - mean**2
    if n.item() >= 2:
        var = var * n / (n - 1)
    out = (a - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return masked(out, mask)


def reinforce_plus_plus_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    kl_type: KLType = "k1",
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ discounted returns (unwhitened), 0 outside ``response_mask``.

    ``r_t = -kl_coef * approx_kl(log_probs, ref_log_probs)_t`` on response tokens,
    ``r_{last valid} += reward_i``, ``G_t = r_t + gamma * G_{t+1}``.
    """
    r = _sample_rewards(rewards, mask)
    resp = mask if response_mask is None else response_mask
    dtype = _float_dtype(r, log_probs)
    kl = _token_kl(log_probs, ref_log_probs, kl_coef, kl_type, resp, dtype)
    token_rewards = -kl_coef * kl
    last = last_valid_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    token_rewards[rows, last] += r.to(dtype)
    return masked(discounted_cumsum(token_rewards, gamma), resp)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k1",
    group_size: int | None = None,
    response_mask: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = WHITEN_EPS,
) -> torch.Tensor:
    """REINFORCE++-baseline: ``A_t = (reward_i - group_mean) - kl_coef * kl_t``, then whitening.

    ``group_size=None``: ``rewards`` already had the group mean removed (slime's pipeline does it
    in reward post-processing); an int subtracts the mean of each consecutive group here.
    """
    r = _sample_rewards(rewards, mask)
    dtype = _float_dtype(r, log_probs)
    r = r.to(dtype)
    if group_size is not None:
        if r.numel() % group_size:
            raise ValueError(f"{r.numel()} rewards cannot be split into groups of {group_size}")
        g = r.reshape(-1, group_size)
        r = (g - g.mean(-1, keepdim=True)).reshape(-1)
    resp = mask if response_mask is None else response_mask
    kl = _token_kl(log_probs, ref_log_probs, kl_coef, kl_type, resp, dtype)
    a = masked(r.unsqueeze(-1).expand(mask.shape), resp) - kl_coef * kl
    return whiten_advantages(a, mask, eps) if normalize else masked(a, mask)


@dataclass
class AdvantageResult:
    """What :func:`compute_advantages` produces (slime's ``rollout_data`` keys)."""

    advantages: torch.Tensor  # [B, T], 0 where mask == 0
    returns: torch.Tensor  # [B, T], never whitened
    kl: torch.Tensor  # [B, T] per-token approx KL used for reward shaping (0 if kl_coef == 0)
    opd_reverse_kl: torch.Tensor | None = None  # [B, T] student - teacher, when OPD is on


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k1",
    gamma: float = 1.0,
    response_mask: torch.Tensor | None = None,
    normalize_advantages: bool | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    opd_kl_coef: float = DEFAULT_OPD_KL_COEF,
    eps: float = WHITEN_EPS,
    custom_advantage_function: Callable[[Any, dict], None] | None = None,
    args: Any = None,
    lengths: list[int] | None = None,
) -> AdvantageResult:
    """slime's ``compute_advantages_and_returns`` order: estimator -> OPD -> whitening.

    ``log_probs`` are the old-policy (or rollout) log-probs of the sampled tokens: they feed the
    KL reward (vs ``ref_log_probs``) and are the student side of OPD (vs ``teacher_log_probs``;
    OPD is on when ``teacher_log_probs`` is given). ``normalize_advantages=None`` picks slime's
    requirement: on for both REINFORCE++ variants, off for grpo/gspo/cispo.

    ``custom_advantage_function`` (slime ``--custom-advantage-function-path``) replaces the
    estimator with slime's signature ``fn(args, rollout_data) -> None``: ``rollout_data`` holds
    per-sample lists (``rewards`` floats; ``log_probs``, ``ref_log_probs``, ``kl``, ``loss_masks``
    tensors; ``response_lengths``, ``total_lengths``) and the function sets ``advantages`` and
    ``returns`` (per-sample tensors). OPD and whitening follow, as in slime. ``lengths``: each
    row's response length (default: up to its last loss token).
    """
    check_choice("advantage estimator", estimator, ESTIMATORS)
    resp = mask if response_mask is None else response_mask
    r = _sample_rewards(rewards, mask)
    dtype = _float_dtype(r, log_probs)
    kl = _token_kl(log_probs, ref_log_probs, kl_coef, kl_type, resp, dtype)
    whiten_default = default_normalize_advantages(estimator)
    if custom_advantage_function is not None:
        adv, returns = _custom_advantages(custom_advantage_function, args, r, mask, kl, log_probs, ref_log_probs,
                                          lengths, dtype)
    elif estimator in GROUP_ESTIMATORS:
        adv = grpo_advantages(r.to(dtype), mask)
        returns = adv.clone()
    elif estimator == "reinforce_plus_plus":
        returns = reinforce_plus_plus_returns(r, mask, log_probs, ref_log_probs, kl_coef, gamma, kl_type, response_mask)
        adv = masked(returns, mask)
    else:
        adv = reinforce_plus_plus_baseline_advantages(
            r, mask, log_probs, ref_log_probs, kl_coef, kl_type, None, response_mask, normalize=False
        )
        returns = adv.clone()
    reverse_kl = None
    if teacher_log_probs is not None:
        if log_probs is None:
            raise ValueError("OPD needs the student log_probs")
        adv, reverse_kl = apply_opd_kl(adv, log_probs, teacher_log_probs, mask, opd_kl_coef)
    if whiten_default if normalize_advantages is None else normalize_advantages:
        adv = whiten_advantages(adv, mask, eps)
    return AdvantageResult(advantages=adv, returns=returns, kl=kl, opd_reverse_kl=reverse_kl)


def _custom_advantages(fn, args, rewards, mask, kl, log_probs, ref_log_probs, lengths, dtype):
    """Call slime's advantage hook on per-sample lists; returns padded ``(advantages, returns)``."""
    n = lengths if lengths is not None else response_lengths(mask)
    data: dict[str, Any] = {
        "rewards": [float(v) for v in rewards.tolist()],
        "loss_masks": to_list(mask.to(torch.int32), n),
        "response_lengths": list(n),
        "total_lengths": list(n),
        "kl": to_list(kl, n),
    }
    if log_probs is not None:
        data["log_probs"] = to_list(log_probs.detach(), n)
    if ref_log_probs is not None:
        data["ref_log_probs"] = to_list(ref_log_probs.detach(), n)
    fn(args, data)
    for key in ("advantages", "returns"):
        if key not in data or len(data[key]) != mask.shape[0]:
            raise ValueError(f"the custom advantage function must set rollout_data[{key!r}] to one tensor per sample")
    like = torch.zeros((), dtype=dtype, device=mask.device)
    T = mask.shape[-1]
    return masked(from_list(data["advantages"], T, like), mask), from_list(data["returns"], T, like)
