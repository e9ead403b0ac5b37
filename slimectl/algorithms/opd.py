"""On-policy distillation advantage shaping (slime: ``loss.py::apply_opd_kl_to_advantages``;
``docs/en/advanced/on-policy-distillation.md``).

Per token of the sampled response::

    reverse_kl_t = log pi_student(a_t) - log pi_teacher(a_t)     # one-sample reverse-KL estimate
    A_t <- A_t - opd_kl_coef * reverse_kl_t                       # --opd-kl-coef, default 1.0

Sign: where the teacher likes the sampled token more than the student does
(``teacher_lp > student_lp``), ``reverse_kl_t < 0`` and the advantage goes *up*, pushing the
student toward the teacher; where the student is over-confident it goes down. It is applied
after the estimator and before ``--normalize-advantages`` whitening, and works with any
estimator (pure distillation = reward 0 + this term). The student log-probs are the old-policy /
rollout log-probs used for the advantages (no gradient flows through them).
"""

from __future__ import annotations

import torch

from slimectl.algorithms.reduce import masked
from slimectl.contract.algorithm_names import DEFAULT_OPD_KL_COEF


def opd_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``student_lp - teacher_lp`` per token, 0 where ``mask == 0`` (slime's ``opd_reverse_kl`` metric)."""
    return masked(student_log_probs.detach() - teacher_log_probs.detach(), mask)


def apply_opd_kl(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    mask: torch.Tensor,
    opd_kl_coef: float = DEFAULT_OPD_KL_COEF,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(advantages - opd_kl_coef * reverse_kl, reverse_kl)``; both 0 where ``mask == 0``."""
    rkl = opd_reverse_kl(student_log_probs, teacher_log_probs, mask).to(advantages.dtype)
    return masked(advantages - opd_kl_coef * rkl, mask), rkl
