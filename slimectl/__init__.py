"""slimectl: RL post-training of LLMs in stages that share one run directory.

The library (this package, minus ``slimectl.commands``) never imports click or the CLI;
every stage is a plain function that also works from Python.
"""

__version__ = "0.1.0"

import os as _os

#: The environment slimectl's numerics rely on, set at import unless already set (a value already set wins).
#: MKL_CBWR: MKL's strict conditional numerical reproducibility: its matrix products give the same bits at any thread
#: count and any operand alignment (a run resumed in another process, with another thread count, trains bit for bit
#: the same), on the CPU's own fastest code path (AUTO; measured as fast as the default for fp32 on AVX-512). AUTO is
#: another code path on another CPU (AVX-512 on recent Intel, AVX2 on AMD Zen 2), so bits agree on one kind of CPU,
#: not across kinds (docs/testing.md, "What is bit-exact"). MKL reads it at its first call, so it is set here,
#: before torch computes anything in a slimectl process.
NUMERIC_ENV = {"MKL_CBWR": "AUTO,STRICT"}


def apply_numeric_env(environ=None) -> None:
    """Set :data:`NUMERIC_ENV` in ``environ`` (``os.environ``) where unset: what importing slimectl does once. A
    process that replaces its environment after the import (a fork server's child) calls it again."""
    env = _os.environ if environ is None else environ
    for key, value in NUMERIC_ENV.items():
        env.setdefault(key, value)


apply_numeric_env()
