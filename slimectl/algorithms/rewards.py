"""Group reward post-processing (slime: ``slime/ray/rollout.py::RolloutManager._post_process_rewards``).

slime, per rollout, for ``--advantage-estimator`` in {grpo, gspo, cispo,
reinforce_plus_plus_baseline} with rewards normalization on (``--disable-rewards-normalization``
turns it off)::

    R = tensor(raw).reshape(-1, n_samples_per_prompt)      # one row per prompt group
    R = R - R.mean(-1, keepdim=True)
    if estimator in {grpo, gspo, cispo} and grpo_std_normalization:
        R = R / (R.std(-1, keepdim=True) + 1e-6)            # torch.std: unbiased (N-1)
    rewards = R.flatten()

``--disable-grpo-std-normalization`` drops the std division, and slime forces it off when
``n_samples_per_prompt == 1`` (the unbiased std of one element is nan). When the sample count is
not ``n * rollout_batch_size`` slime falls back to one group of everything; here pass
``n_samples_per_prompt=None`` for that.
"""

from __future__ import annotations

from typing import Hashable, Literal, Sequence

import torch

from slimectl.contract.algorithm_names import REWARD_NORM_MODES, check_choice

RewardNormMode = Literal[REWARD_NORM_MODES]  # type: ignore[valid-type]  (the registry's names)
GRPO_STD_EPS = 1e-6


def normalize_group_rewards(
    rewards: torch.Tensor | Sequence[float],
    n_samples_per_prompt: int | None = None,
    mode: RewardNormMode = "group_mean_std",
    eps: float = GRPO_STD_EPS,
) -> torch.Tensor:
    """Normalize rewards within each prompt group.

    ``rewards``: ``[num_groups * n]`` (give ``n_samples_per_prompt``; ``None`` means one single
    group) or ``[num_groups, n]`` (the last dim is the group). The result has the input's shape.

    * ``"group_mean_std"``: ``(r - mean_g) / (std_g + eps)`` with the unbiased std; for groups of
      one sample the std division is skipped (slime forces it off), leaving ``r - r = 0``.
    * ``"group_mean"``: ``r - mean_g`` (also the REINFORCE++-baseline baseline).
    * ``"none"``: rewards returned unchanged (as float).
    """
    r = torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.float()
    check_choice("reward normalization mode", mode, REWARD_NORM_MODES)
    if mode == "none":
        return r.clone()
    shape = r.shape
    if r.dim() == 1:
        n = r.numel() if n_samples_per_prompt is None else int(n_samples_per_prompt)
        if n <= 0 or r.numel() % n != 0:
            raise ValueError(f"{r.numel()} rewards cannot be split into groups of {n_samples_per_prompt}")
        groups = r.reshape(-1, n)
    elif r.dim() == 2:
        if n_samples_per_prompt is not None and r.shape[-1] != n_samples_per_prompt:
            raise ValueError(f"rewards {tuple(r.shape)} do not have groups of {n_samples_per_prompt}")
        groups = r
    else:
        raise ValueError(f"rewards must be 1-D or 2-D, got shape {tuple(shape)}")
    out = groups - groups.mean(-1, keepdim=True)
    if mode == "group_mean_std" and groups.shape[-1] > 1:
        out = out / (out.std(-1, keepdim=True) + eps)
    return out.reshape(shape)


def normalize_rewards_by_group(
    rewards: torch.Tensor | Sequence[float],
    group_ids: Sequence[Hashable],
    mode: RewardNormMode = "group_mean_std",
    eps: float = GRPO_STD_EPS,
) -> torch.Tensor:
    """``[N]`` rewards normalized within each group of equal ``group_ids[i]`` (groups may differ in
    size and interleave; ``None`` is an id like any other), as :func:`normalize_group_rewards`."""
    r = torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.float()
    if r.dim() != 1 or r.numel() != len(group_ids):
        raise ValueError(f"rewards of shape {tuple(r.shape)} for {len(group_ids)} group ids: expected one reward per id")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    out = torch.empty_like(r)
    for idx in members.values():
        rows = torch.tensor(idx)
        out[rows] = normalize_group_rewards(r[rows], None, mode, eps)
    return out
