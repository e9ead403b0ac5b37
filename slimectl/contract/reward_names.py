"""The reward names ``rollout.reward`` accepts, with no import of the graders.

The config schema (:mod:`slimectl.contract.config_schema`) refuses any other name when the config is
loaded (``init`` included), and the reward hub (:mod:`slimectl.rewards.hub`) dispatches on the same
tuples, so a grader added to the hub is named here once.
"""

from __future__ import annotations

#: Rule-based graders of :mod:`slimectl.rewards` (``GRADERS`` in ``hub.py`` has exactly these keys).
GRADER_NAMES: tuple[str, ...] = ("math", "math_verify", "deepscaler", "dapo", "f1", "gpqa", "last_number", "gsm8k",
                                 "random")
#: The remote reward model (``rollout.remote_reward_url``).
REMOTE_NAMES: tuple[str, ...] = ("remote", "remote_rm")
#: The generative reward model on an engine group (``rollout.judge``); computed by the rollout producer, which
#: reaches the judge's engines, not by the hub.
JUDGE_NAMES: tuple[str, ...] = ("judge",)
#: ``boxed_<name>``: grade the content of the response's last ``\\boxed{}`` with ``<name>``.
BOXED_PREFIX = "boxed_"


def reward_names() -> list[str]:
    """Every built-in name, sorted (``boxed_<name>`` works for each as well)."""
    return sorted([*GRADER_NAMES, *REMOTE_NAMES, *JUDGE_NAMES])


def is_custom_reward(reward: str) -> bool:
    """Whether a ``rollout.reward`` value is an import path (``module:function`` / ``module.function``)."""
    return ":" in reward or "." in reward


def base_reward_name(reward: str) -> str | None:
    """The built-in name a reward value stands for (``boxed_f1`` -> ``f1``), or None if it names none."""
    name = reward.strip()
    if name in JUDGE_NAMES:
        return name  # the judge alone: no boxed_ form
    base = name[len(BOXED_PREFIX):] if name.startswith(BOXED_PREFIX) else name
    return base if base in GRADER_NAMES or base in REMOTE_NAMES else None


def unknown_reward_message(reward: str) -> str:
    """The one line that refuses an unknown reward name."""
    return (f"unknown reward type {reward!r}; known: {', '.join(reward_names())} (each also as boxed_<name>), "
            f"or a custom reward as module:function")
