"""Exceptions of the reward hub; every message is one line naming the thing at fault."""

from __future__ import annotations

from slimectl.contract.errors import SlimectlError, UsageError
from slimectl.web.errors import HttpError


def one_line(text: object, limit: int = 300) -> str:
    """Collapse whitespace (newlines included) and cut to ``limit`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class RewardConfigError(UsageError):
    """Bad reward configuration: unknown rm_type, wrong custom import path or signature, missing URL."""


class RewardError(SlimectlError):
    """A reward function ran but produced something unusable (wrong type, wrong list length, missing key)."""


class RemoteRewardError(RewardError, HttpError):
    """The remote reward model could not be reached or answered with an error (the shared HTTP error type)."""

    def __init__(self, message: str, url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status
