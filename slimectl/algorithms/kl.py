"""KL estimators (slime: ``slime/utils/ppo_utils.py::compute_approx_kl``; Schulman, "Approximating KL").

With ``lr = log_probs - log_probs_base`` (both log-probs of the *sampled* token, samples drawn from
the first distribution):

==============  ============================================  ==============================
kind            per-token value                               notes
==============  ============================================  ==============================
``k1``          ``lr``                                        unbiased, can be negative
``k2``          ``lr**2 / 2``                                 biased, >= 0
``k3``          ``exp(-lr) - 1 + lr``                         unbiased, >= 0
``low_var_kl``  same as ``k3``, then ``clamp(kl, -10, 10)``   clamp after the IS ratio
==============  ============================================  ==============================

``importance_ratio`` (slime ``--use-unbiased-kl``, DeepSeek-V3.2) multiplies the value by
``pi_theta / pi_old`` before the ``low_var_kl`` clamp. Computation is done in at least float32,
as slime does (``.float()``); float64 inputs stay float64.
"""

from __future__ import annotations

from typing import Literal

import torch

from slimectl.algorithms.reduce import ReductionMode, masked, reduce_masked
from slimectl.contract.algorithm_names import KL_TYPES, check_choice

KLType = Literal[KL_TYPES]  # type: ignore[valid-type]  (the registry's names)
LOW_VAR_KL_CLAMP = 10.0


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    kl_type: KLType = "k1",
    importance_ratio: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elementwise approximate ``KL(pi || pi_base)`` for the sampled tokens.

    ``mask`` (optional): the log-ratio is zeroed at masked positions *before* any ``exp``, so the
    result there is exactly 0 for every kind and no nan/inf (value or gradient) can come out of
    padding.
    """
    log_ratio = _upcast(log_probs) - _upcast(log_probs_base)
    if mask is not None:
        log_ratio = masked(log_ratio, mask)
    if kl_type == "k1":
        kl = log_ratio
    elif kl_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_type in ("k3", "low_var_kl"):
        neg = -log_ratio  # = log_probs_base - log_probs
        kl = neg.exp() - 1 - neg
    else:
        check_choice("kl_type", kl_type, KL_TYPES)
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = torch.clamp(kl, min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    if mask is not None:
        kl = masked(kl, mask)  # an importance_ratio could still be non-zero there
    return kl


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_type: KLType = "k1",
    old_log_probs: torch.Tensor | None = None,
    reduction: ReductionMode = "sample_mean",
) -> torch.Tensor:
    """slime's ``--use-kl-loss`` term (before ``kl_loss_coef``): ``reduce(approx_kl(lp, ref_lp))``.

    Passing ``old_log_probs`` turns on ``--use-unbiased-kl``: the per-token value is multiplied by
    ``exp(log_probs - old_log_probs)`` (gradient flows through the ratio, as in slime).
    """
    ratio = None
    if old_log_probs is not None:
        ratio = torch.exp(masked(_upcast(log_probs) - _upcast(old_log_probs), mask))
    kl = compute_approx_kl(log_probs, ref_log_probs, kl_type, importance_ratio=ratio, mask=mask)
    return reduce_masked(kl, mask, reduction)
