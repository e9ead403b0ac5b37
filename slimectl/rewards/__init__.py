"""Rewards: rule-based graders, the reward hub, custom reward functions and a remote reward model.

Rollout-side only (never imports :mod:`slimectl.train`). Typical use::

    from slimectl.rewards import RewardInput, compute_reward, reward_value
    r = await compute_reward(RewardInput(response=text, label="42"), "math")   # 1.0 / 0.0
    d = await compute_reward(sample, "dapo")                                   # {"score": ±1.0, ...}
    reward_value(d, "score")

Graders are pure functions ``(response, label) -> float | dict`` in :mod:`.math_grader`,
:mod:`.dapo` and :mod:`.text`; :mod:`.math_verify` runs Hugging Face's Math-Verify in worker
processes; the dispatch lives in :mod:`.hub`, the HTTP client in :mod:`.remote`.
"""

from .boxed import last_boxed
from .dapo import grade_dapo, normalize_dapo
from .errors import RemoteRewardError, RewardConfigError, RewardError
from .hub import (GRADERS, LABEL_FREE, RewardInput, compute_reward, compute_rewards, grade, is_custom_reward,
                  load_reward_function, needs_label, reward_value, rm_types)
from .math_grader import answers_match, grade_deepscaler, grade_math, normalize_answer
from .math_verify import MathVerifySettings, grade_math_verify, grade_math_verify_async, require_math_verify
from .remote import RemoteRewardModel, close_shared_remotes, shared_remote
from .text import extract_choice, f1_components, grade_f1, grade_gpqa, grade_random, normalize_squad

__all__ = [
    "GRADERS", "LABEL_FREE", "MathVerifySettings", "RemoteRewardError", "RemoteRewardModel", "RewardConfigError",
    "RewardError", "RewardInput", "answers_match", "close_shared_remotes", "compute_reward", "compute_rewards",
    "extract_choice", "f1_components", "is_custom_reward", "grade", "grade_dapo", "grade_deepscaler", "grade_f1",
    "grade_gpqa", "grade_math", "grade_math_verify", "grade_math_verify_async", "grade_random", "last_boxed",
    "load_reward_function", "needs_label", "normalize_answer", "normalize_dapo", "normalize_squad",
    "require_math_verify", "reward_value", "rm_types", "shared_remote",
]
