"""slimectl: RL post-training of LLMs in stages that share one run directory.

The library (this package, minus ``slimectl.commands``) never imports click or the CLI;
every stage is a plain function that also works from Python.
"""

__version__ = "0.1.0"

import os as _os

# MKL's strict conditional numerical reproducibility: its matrix products give the same bits at any thread
# count (a run resumed in another process, with another thread count, trains bit for bit the same), on the
# CPU's own fastest code path (AUTO; measured as fast as the default for fp32 on AVX-512). MKL reads it at its
# first call, so it is set here, before torch computes anything in a slimectl process; a value already set wins.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
