"""The interpreter command slimectl starts a Python child with: an environment variable split as a shell would."""

from __future__ import annotations

import os
import shlex

from slimectl.contract.errors import UsageError


def python_from_env(var: str, default: str) -> list[str]:
    """``$VAR`` split into argv (a prefix such as ``numactl ... /venv/bin/python``, another venv's python, the
    test suite's fork client), else ``[default]``. A value that cannot be split is a UsageError naming the
    variable and the fix."""
    value = os.environ.get(var, "").strip()
    if not value:
        return [default]
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise UsageError(f"${var}={value!r} cannot be split into a command ({exc}); quote it as a shell would, "
                         f"or unset it to use {default}") from None
