"""The embedded engine: our own SGLang-protocol HTTP server over a transformers model (the CPU default)."""

from __future__ import annotations

EMBEDDED_PYTHON_ENV = "SLIMECTL_EMBEDDED_PYTHON"
"""The command that runs the embedded engine's interpreter, split as a shell would: a prefix such as
``numactl --cpunodebind=0 /venv/bin/python`` (pin each engine), another venv's python, or the test suite's
fork client (tests/forkserver.py). Unset: the interpreter of the slimectl that launches the engine."""


def server_argv(python: str) -> list[str]:
    """``[python, "-m", "slimectl.engines.embedded.server"]``, with ``$SLIMECTL_EMBEDDED_PYTHON`` in place of
    ``python`` when set (a value that cannot be split is a UsageError naming the variable and the fix)."""
    from slimectl.contract.child_python import python_from_env

    return [*python_from_env(EMBEDDED_PYTHON_ENV, python), "-m", "slimectl.engines.embedded.server"]
