"""This process's place in a torchrun job, read from the environment torchrun sets (stdlib only).

Valid before ``torch.distributed`` is initialised, and cheap: the launching process of a
relaunch, the CLI's error handling and the stages read it without importing torch.
"""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """Whether this process is one rank of a torchrun job."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def launch_rank() -> int:
    """This process's rank in a torchrun job (0 when not under torchrun); valid before dist init."""
    return int(os.environ.get("RANK", "0"))
