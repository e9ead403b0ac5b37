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
    ``sum_{i,t} x*m / sum_i max(sum_t m[i,t], 1)``: every valid token weighs the same, so long
    samples weigh more. A fully masked sample counts as **one** token in the denominator, exactly as
    slime's ``num_tokens = sum(clamp_min(loss_mask.sum(), 1))`` does (chosen on purpose to match
    slime: a step that happens to hold an empty sample gives the same loss in both; the empty
    sample adds 0 to the numerator). :func:`loss_token_count` is that denominator.

(Newer slime can pass per-rollout denominators when one rollout fans out into several samples;
that variant is not modelled here.)
"""

from __future__ import annotations

from typing import Literal

import torch

from slimectl.contract.algorithm_names import REDUCTION_MODES, check_choice

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


def loss_token_count(mask: torch.Tensor) -> torch.Tensor:
    """slime's per-token denominator: ``sum_i max(sum_t m[i,t], 1)`` (an empty sample counts 1)."""
    return _as_2d(mask).float().sum(-1).clamp_min(1).sum()


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all valid tokens / :func:`loss_token_count` (``--calculate-per-token-loss``)."""
    total = loss_token_count(mask)
    return masked_sum(x, mask) / (total.to(x.dtype) if x.is_floating_point() else total)


def response_lengths(mask: torch.Tensor) -> list[int]:
    """Each row's length up to its last ``mask == 1`` position (0 for a fully masked row): the
    ``response_lengths`` slime's hooks receive when the caller gives none."""
    m = _as_2d(mask).bool()
    T = m.shape[-1]
    last = (T - 1) - m.flip(-1).to(torch.int64).argmax(-1)
    return [int(v) + 1 if bool(a) else 0 for v, a in zip(last.tolist(), m.any(-1).tolist())]


def to_concat(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Padded ``[B, T]`` -> slime's concatenated layout ``cat(x[i, :lengths[i]])``."""
    rows = _as_2d(x)
    return torch.cat([rows[i, :n] for i, n in enumerate(lengths)]) if lengths else rows.new_zeros(0)


def to_list(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Padded ``[B, T]`` -> slime's per-sample list ``[x[i, :lengths[i]]]``."""
    rows = _as_2d(x)
    return [rows[i, :n] for i, n in enumerate(lengths)]


def from_list(parts: list[torch.Tensor], T: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample 1-D tensors -> padded ``[B, T]`` (zeros after each part)."""
    dtype = like.dtype if like is not None else (parts[0].dtype if parts else torch.float32)
    out = torch.zeros(len(parts), T, dtype=dtype, device=None if like is None else like.device)
    for i, p in enumerate(parts):
        p = torch.as_tensor(p).reshape(-1)
        if p.numel() > T:
            raise ValueError(f"sample {i}: {p.numel()} values for a row of {T}")
        out[i, : p.numel()] = p.to(dtype)
    return out


def from_concat(flat: torch.Tensor, lengths: list[int], T: int) -> torch.Tensor:
    """slime's concatenated layout -> padded ``[B, T]`` (the inverse of :func:`to_concat`)."""
    if flat.numel() != sum(lengths):
        raise ValueError(f"{flat.numel()} values for response lengths summing to {sum(lengths)}")
    return from_list(list(flat.split(lengths)), T, like=flat) if lengths else flat.reshape(0, T)


def sum_of_sample_mean_fn(mask: torch.Tensor, lengths: list[int], calculate_per_token_loss: bool):
    """slime's ``get_sum_of_sample_mean`` closure over the concatenated layout: the *sum* of each
    sample's masked mean, or (per-token) the masked *sum*; slime's trainer later divides by the
    number of samples (tokens). Used to call custom losses and reducers with slime's signature."""
    masks = to_list(mask.float(), lengths)

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        parts = x.split(lengths)
        if calculate_per_token_loss:
            return sum((p * m).sum() for p, m in zip(parts, masks))
        return sum((p * m).sum() / torch.clamp_min(m.sum(), 1) for p, m in zip(parts, masks))

    return sum_of_sample_mean


def reduce_masked(x: torch.Tensor, mask: torch.Tensor, mode: ReductionMode = "sample_mean") -> torch.Tensor:
    """Dispatch to :func:`sample_mean` or :func:`token_mean`."""
    if mode == "sample_mean":
        return sample_mean(x, mask)
    check_choice("reduction mode", mode, REDUCTION_MODES)
    return token_mean(x, mask)
