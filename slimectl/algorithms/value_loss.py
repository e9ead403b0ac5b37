"""The critic's clipped value loss, explained variance and the ``critic/*`` metrics.

slime: ``slime/backends/megatron_utils/loss.py::value_loss_function`` (``--value-clip``, default 0.2);
verl: ``verl/trainer/ppo/core_algos.py::compute_value_loss`` and ``metric_utils.compute_data_metrics``.

Per token (``V`` the critic's current value, ``V_old`` its value when the rollout's advantages were
computed, ``G`` the returns of :mod:`slimectl.algorithms.gae`, ``c`` = ``value_clip``)::

    V_clip   = V_old + clamp(V - V_old, -c, c)
    loss_t   = max((V_clip - G)^2, (V - G)^2)
    clip_t   = [ |V - V_old| > c ]

both reduced like the policy loss (:func:`slimectl.algorithms.reduce.reduce_masked`: per-sample mean by
default, per token with ``calculate_per_token_loss``) over the loss mask. This is **slime's** loss: no
``1/2`` factor, and slime's clip fraction (the share of tokens whose value moved more than ``c``).
verl (after TRL) multiplies the loss by ``0.5`` and counts a token as clipped when the clipped error is
the larger one (``(V_clip - G)^2 > (V - G)^2``); its loss is exactly half of this one, which only
rescales the critic's gradient (an Adam step is scale-invariant up to ``eps``). ``value_clip=None``
gives the plain squared error (clip fraction 0).

``explained_variance = 1 - Var(G - V) / Var(G)`` over the loss tokens (the ratio is the same with or
without Bessel's correction); 1 for perfect values, 0 for any constant value (``Var(G - c) = Var(G)``),
negative when worse than a constant. ``Var(G) == 0`` (every
return equal, or a single token) reports 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimectl.algorithms.reduce import ReductionMode, masked, reduce_masked

#: The metric names :func:`critic_metrics` produces, in order (logged by the trainer as they are).
CRITIC_METRICS: tuple[str, ...] = (
    "critic/value_loss",
    "critic/value_clipfrac",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/returns_std",
    "critic/returns_max",
    "critic/returns_min",
    "critic/advantages_mean",
    "critic/advantages_std",
    "critic/advantages_max",
    "critic/advantages_min",
)


@dataclass
class ValueLossResult:
    loss: torch.Tensor  # scalar, differentiable in values
    clipfrac: torch.Tensor  # scalar, detached
    per_token: torch.Tensor  # [B, T] max of the two squared errors, 0 where mask == 0


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = 0.2,
    mode: ReductionMode = "sample_mean",
) -> ValueLossResult:
    """slime's ``value_loss_function`` on padded ``[B, T]`` tensors (see the module docstring)."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"shape mismatch: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
                         f"returns {tuple(returns.shape)}, mask {tuple(mask.shape)}")
    old = old_values.detach().to(values.dtype)
    target = returns.detach().to(values.dtype)
    unclipped = (values - target) ** 2
    if value_clip is None:
        per_token = unclipped
        clipped_tokens = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0, got {value_clip}")
        v_clip = old + (values - old).clamp(-value_clip, value_clip)
        per_token = torch.maximum((v_clip - target) ** 2, unclipped)
        clipped_tokens = ((values.detach() - old).abs() > value_clip).to(values.dtype)
    per_token = masked(per_token, mask)
    return ValueLossResult(
        loss=reduce_masked(per_token, mask, mode),
        clipfrac=reduce_masked(clipped_tokens, mask, mode).detach(),
        per_token=per_token,
    )


def _valid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape != mask.shape:
        raise ValueError(f"shape mismatch: values {tuple(x.shape)} vs mask {tuple(mask.shape)}")
    return x.detach()[mask.bool()]


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(G - V) / Var(G)`` over the loss tokens (population variances); 0 when ``Var(G) == 0``."""
    v, g = _valid(values, mask).double(), _valid(returns, mask).double()
    if g.numel() == 0:
        raise ValueError("explained variance: the mask selects no token")
    var_g = ((g - g.mean()) ** 2).mean()
    resid = g - v
    var_r = ((resid - resid.mean()) ** 2).mean()
    if var_g.item() == 0:
        return torch.zeros((), dtype=torch.float64)
    return 1 - var_r / var_g


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    mean = x.mean()
    return {
        f"{prefix}_mean": float(mean),
        f"{prefix}_std": float(((x - mean) ** 2).mean().sqrt()),
        f"{prefix}_max": float(x.max()),
        f"{prefix}_min": float(x.min()),
    }


def critic_metrics(
    values: torch.Tensor,
    returns: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    value_loss: torch.Tensor | float | None = None,
    value_clipfrac: torch.Tensor | float | None = None,
) -> dict[str, float]:
    """The ``critic/*`` metrics of one rollout (names in :data:`CRITIC_METRICS`), over the loss tokens.

    ``values`` are the critic's values the advantages were computed from, ``returns`` and
    ``advantages`` what :func:`slimectl.algorithms.gae.compute_gae` gave; ``_std`` is the population
    standard deviation. ``value_loss`` / ``value_clipfrac`` (from :func:`clipped_value_loss`) are
    included when given.
    """
    v, g, a = _valid(values, mask), _valid(returns, mask), _valid(advantages, mask)
    if v.numel() == 0:
        raise ValueError("critic metrics: the mask selects no token")
    out: dict[str, float] = {}
    if value_loss is not None:
        out["critic/value_loss"] = float(value_loss)
    if value_clipfrac is not None:
        out["critic/value_clipfrac"] = float(value_clipfrac)
    out["critic/explained_variance"] = float(explained_variance(values, returns, mask))
    out["critic/values_mean"] = float(v.double().mean())
    out.update(_stats("critic/returns", g))
    out.update(_stats("critic/advantages", a))
    return out
