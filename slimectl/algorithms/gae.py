"""PPO's generalized advantage estimation (GAE) over token-level rewards.

slime: ``slime/backends/megatron_utils/loss.py::compute_advantages_and_returns`` (branch ``ppo``) and
``slime/utils/ppo_utils.py::get_advantages_and_returns_batch`` / ``vanilla_gae`` / ``chunked_gae``;
verl: ``verl/trainer/ppo/core_algos.py::compute_gae_advantage_return``.

Representation: padded ``[B, T]`` response tokens (right-padded) with ``mask`` ``[B, T]`` (the loss
mask: 1 = trained on), ``values`` ``[B, T]`` the critic's value of each position (slime's ``values``,
computed by the critic before it trains), ``rewards`` ``[B]`` one scalar per sample.

**Steps.** GAE runs over the positions that are steps of the decision process. By default the steps
are the loss tokens (``mask == 1``); a position that is not a step has no reward, no value and no TD
error, and the recursion carries across it: the step before a masked span bootstraps from the value
of the first step after it, and its advantage accumulates from there. This is what verl does for
multi-turn observation tokens (``nextvalues``/``lastgaelam`` kept across ``response_mask == 0``) and
what tool-output tokens, which the policy did not choose, need. slime does *not* skip them: its GAE
steps over every response token (tool output included, with the critic's value there and the KL
reward of those tokens), puts the reward on the last *response* token and ignores the loss mask until
the loss. Pass ``response_mask`` (every position of the response) to get slime's behaviour exactly;
for a single-turn sample (no loss-masked token inside the response) both are the same.

Formulas (``m`` = step mask, ``kl_t`` = ``approx_kl(log_probs, ref_log_probs, kl_type)``, 0 when
``kl_coef == 0``; ``last_i`` = the last step of row ``i``)::

    r_t      = -kl_coef * kl_t  on steps, 0 elsewhere;   r_{last_i} += reward_i
    for t = T-1 .. 0 (V' and A' start at 0):
        if m_t:  delta_t = r_t + gamma * V' - V_t
                 A_t     = delta_t + gamma * lambd * A'
                 V' = V_t ;  A' = A_t
        else:    A_t = 0            (V' and A' carried over unchanged)
    G_t = A_t + V_t  on steps (0 elsewhere)          # the critic's regression target (returns)

then optionally ``--normalize-advantages`` whitening over the loss tokens
(:func:`slimectl.algorithms.advantages.whiten_advantages`); returns are never whitened. slime leaves
whitening off for ``ppo`` unless ``--normalize-advantages`` is given (verl always whitens GAE).
Advantages and returns are 0 outside the loss mask. A row with no step gets zeros everywhere (its
reward has no token to sit on; slime would put it on the last response token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimectl.algorithms.advantages import WHITEN_EPS, _float_dtype, _sample_rewards, _token_kl, whiten_advantages
from slimectl.algorithms.kl import KLType
from slimectl.algorithms.reduce import from_list, masked, to_list


def _check_unit(name: str, value: float) -> float:
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def last_step_index(steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B] index of the last step of each row, [B] bool: the row has a step)``; a row without a
    step reports index 0 (and ``False``)."""
    m = steps.bool()
    T = m.shape[-1]
    pos = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m, pos, torch.full_like(pos, -1)).max(-1).values
    has = last >= 0
    return last.clamp_min(0), has


def ppo_token_rewards(
    rewards: torch.Tensor,
    steps: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """``r_t = -kl_coef * kl_t`` on every step, plus ``reward_i`` on the last step of row ``i``; 0 off the steps.

    slime (branch ``ppo``): ``k *= -kl_coef; k[-1] += reward`` on the per-sample response tensor.
    """
    r = _sample_rewards(rewards, steps)
    dtype = _float_dtype(r, kl)
    out = torch.zeros(steps.shape, dtype=dtype, device=steps.device)
    if kl is not None and kl_coef != 0:
        if kl.shape != steps.shape:
            raise ValueError(f"shape mismatch: kl {tuple(kl.shape)} vs mask {tuple(steps.shape)}")
        out = masked(-kl_coef * kl.to(dtype), steps)
    last, has = last_step_index(steps)
    rows = torch.arange(steps.shape[0], device=steps.device)
    out[rows, last] += torch.where(has, r.to(dtype), torch.zeros((), dtype=dtype, device=steps.device))
    return out


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    steps: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GAE recursion of the module docstring over ``[B, T]`` tensors: ``(advantages, returns)``,
    both 0 off ``steps``. Non-steps are skipped (their reward and value are never read), so padding
    and loss-masked spans need no special values. No gradient flows (as slime/verl: ``no_grad``)."""
    gamma, lambd = _check_unit("gamma", gamma), _check_unit("lambd", lambd)
    if token_rewards.shape != steps.shape or values.shape != steps.shape:
        raise ValueError(f"shape mismatch: rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, "
                         f"mask {tuple(steps.shape)}")
    if steps.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(steps.shape)}")
    dtype = _float_dtype(token_rewards, values)
    with torch.no_grad():
        m = steps.bool()
        r = masked(token_rewards.detach().to(dtype), m)
        v = masked(values.detach().to(dtype), m)
        adv = torch.zeros(m.shape, dtype=dtype, device=m.device)
        next_value = torch.zeros(m.shape[0], dtype=dtype, device=m.device)
        next_adv = torch.zeros_like(next_value)
        for t in range(m.shape[-1] - 1, -1, -1):
            delta = r[:, t] + gamma * next_value - v[:, t]
            a_t = delta + gamma * lambd * next_adv
            step = m[:, t]
            adv[:, t] = torch.where(step, a_t, torch.zeros_like(a_t))
            next_value = torch.where(step, v[:, t], next_value)
            next_adv = torch.where(step, a_t, next_adv)
        returns = masked(adv + v, m)
    return adv, returns


@dataclass
class GAEResult:
    """What :func:`compute_gae` produces (slime's ``rollout_data`` keys)."""

    advantages: torch.Tensor  # [B, T], 0 where mask == 0, whitened when asked
    returns: torch.Tensor  # [B, T] A + V before whitening, 0 off the steps: the value loss's target
    token_rewards: torch.Tensor  # [B, T] r_t fed to GAE
    kl: torch.Tensor  # [B, T] per-token approx KL used for the reward shaping (0 when kl_coef == 0)


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lambd: float = 1.0,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: KLType = "k1",
    response_mask: torch.Tensor | None = None,
    normalize_advantages: bool = False,
    eps: float = WHITEN_EPS,
) -> GAEResult:
    """PPO advantages and returns: token rewards (:func:`ppo_token_rewards`), :func:`gae`, then optional whitening.

    ``response_mask=None``: the steps are the loss tokens (masked tokens skipped, see the module
    docstring). ``response_mask`` given: every response position is a step (slime exactly), and
    advantages are still zeroed (and whitened) over ``mask`` only. ``log_probs`` are the old-policy
    log-probs (for the KL reward against ``ref_log_probs``).
    """
    steps = mask if response_mask is None else response_mask
    if values.shape != mask.shape or steps.shape != mask.shape:
        raise ValueError(f"shape mismatch: values {tuple(values.shape)}, mask {tuple(mask.shape)}, "
                         f"response_mask {tuple(steps.shape)}")
    r = _sample_rewards(rewards, mask)
    dtype = _float_dtype(r, values, log_probs)
    kl = _token_kl(log_probs, ref_log_probs, kl_coef, kl_type, steps, dtype)
    token_rewards = ppo_token_rewards(r.to(dtype), steps, kl, kl_coef)
    adv, returns = gae(token_rewards, values.to(dtype), steps, gamma, lambd)
    adv = masked(adv, mask)
    if normalize_advantages:
        adv = whiten_advantages(adv, mask, eps)
    return GAEResult(advantages=adv, returns=returns, token_rewards=token_rewards, kl=kl)


def gae_lists(
    token_rewards: list[torch.Tensor],
    values: list[torch.Tensor],
    gamma: float,
    lambd: float,
    steps: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample list form (slime's ``get_advantages_and_returns_batch`` layout): one 1-D tensor per
    sample in, ``(advantages, returns)`` lists of the same lengths out. ``steps=None``: every token is
    a step (slime); otherwise one 0/1 tensor per sample."""
    if len(token_rewards) != len(values) or (steps is not None and len(steps) != len(values)):
        raise ValueError(f"{len(token_rewards)} reward rows, {len(values)} value rows"
                         + ("" if steps is None else f", {len(steps)} mask rows"))
    lengths = [int(torch.as_tensor(v).numel()) for v in values]
    for i, (r, n) in enumerate(zip(token_rewards, lengths)):
        if int(torch.as_tensor(r).numel()) != n:
            raise ValueError(f"sample {i}: {torch.as_tensor(r).numel()} rewards for {n} values")
    if not lengths:
        return [], []
    T = max(max(lengths), 1)
    like = torch.zeros((), dtype=_float_dtype(*[torch.as_tensor(v) for v in values]))
    v = from_list(values, T, like)
    r = from_list(token_rewards, T, like)
    if steps is None:
        m = from_list([torch.ones(n, dtype=torch.bool) for n in lengths], T, torch.zeros((), dtype=torch.bool))
    else:
        m = from_list(steps, T, torch.zeros((), dtype=torch.bool))
    adv, ret = gae(r, v, m, gamma, lambd)
    return to_list(adv, lengths), to_list(ret, lengths)
