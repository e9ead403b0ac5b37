"""Masked loss reductions (slime: ``slime/backends/megatron_utils/cp_utils.py::get_sum_of_sample_mean``).

Representation used by every module of :mod:`slimectl.algorithms`: per-token quantities are
padded tensors ``[B, T]`` (one row per sample, response tokens only, right-padded) with a mask of
the same shape (bool or 0/1; 1 = the token is trained on, i.e. slime's ``loss_mask``). A 1-D
tensor is treated as a single sample ``[T]``.

Masked positions are removed with ``torch.where`` rather than multiplied by 0, so a ``nan`` or
``inf`` sitting in padding can never leak into a value or a gradient.

Two modes:

``"sample_mean"`` (slime default)
    ``mean_i( sum_t x[i,t]*m[i,t] / max(sum_t m[i,t], 1) )``. Each sample's token mean is taken
    first, then samples are averaged. slime's closure *sums* the per-sample means and Megatron's
    loss rescale (``num_microbatches / global_batch_size``) turns that sum into the mean over the
    step's samples; a sample whose mask is all zero contributes 0 but still counts in that
    denominator, and it does here too.
``"token_mean"`` (slime ``--calculate-per-token-loss``)
    ``sum_{i,t} x*m / max(sum_{i,t} m, 1)``: every valid token weighs the same, so long samples
    weigh more.

(Newer slime can pass per-rollout denominators when one rollout fans out into several samples;
that variant is not modelled here.)
"""

from __future__ import annotations

from typing import Literal

import torch

from slimectl.algorithms.registry import REDUCTION_MODES, check_choice

ReductionMode = Literal[REDUCTION_MODES]  # type: ignore[valid-type]  (the registry's names)


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("expected a per-token tensor, got a scalar")
    if x.dim() == 1:
        return x.unsqueeze(0)
    return x.reshape(-1, x.shape[-1])


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` is set, exact 0 elsewhere (no nan/inf propagation, zero gradient)."""
    if x.shape != mask.shape:
        raise ValueError(f"shape mismatch: values {tuple(x.shape)} vs mask {tuple(mask.shape)}")
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(x * mask)`` over every element."""
    return masked(x, mask).sum()


def per_sample_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each sample's mean over its valid tokens (0 for a fully masked sample)."""
    xm = _as_2d(masked(x, mask))
    counts = _as_2d(mask).to(xm.dtype).sum(-1)
    return xm.sum(-1) / counts.clamp_min(1)


def sample_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over samples of each sample's masked token mean (slime's default reducer)."""
    return per_sample_mean(x, mask).mean()


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all valid tokens / number of valid tokens (``--calculate-per-token-loss``)."""
    total = mask.to(x.dtype).sum() if x.is_floating_point() else mask.float().sum()
    return masked_sum(x, mask) / total.clamp_min(1)


def reduce_masked(x: torch.Tensor, mask: torch.Tensor, mode: ReductionMode = "sample_mean") -> torch.Tensor:
    """Dispatch to :func:`sample_mean` or :func:`token_mean`."""
    if mode == "sample_mean":
        return sample_mean(x, mask)
    check_choice("reduction mode", mode, REDUCTION_MODES)
    return token_mean(x, mask)


def reduction_mode(calculate_per_token_loss: bool) -> ReductionMode:
    """Map slime's ``--calculate-per-token-loss`` flag to a mode name."""
    return "token_mean" if calculate_per_token_loss else "sample_mean"
