"""The embedded engine: our own SGLang-protocol HTTP server over a transformers model (the CPU default)."""

from __future__ import annotations

import os
import shlex

EMBEDDED_PYTHON_ENV = "SLIMECTL_EMBEDDED_PYTHON"
"""The command that runs the embedded engine's interpreter, split as a shell would: a prefix such as
``numactl --cpunodebind=0 /venv/bin/python`` (pin each engine), another venv's python, or the test suite's
fork client (tests/forkserver.py). Unset: the interpreter of the slimectl that launches the engine."""


def server_argv(python: str) -> list[str]:
    """``[python, "-m", "slimectl.engines.embedded.server"]``, with ``$SLIMECTL_EMBEDDED_PYTHON`` in place of
    ``python`` when set. Raises ValueError (naming the variable and the fix) for a value that cannot be split."""
    value = os.environ.get(EMBEDDED_PYTHON_ENV, "").strip()
    if not value:
        return [python, "-m", "slimectl.engines.embedded.server"]
    try:
        prefix = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"${EMBEDDED_PYTHON_ENV}={value!r} cannot be split into a command ({exc}); quote it as a "
                         f"shell would, or unset it to run engines with {python}") from None
    return [*prefix, "-m", "slimectl.engines.embedded.server"]
