"""The errors of Megatron checkpoints (their own module: the checkpoint code and its safe loader both raise them)."""

from __future__ import annotations

from slimectl.contract.errors import SlimectlError, UsageError


class MegatronCheckpointError(SlimectlError):
    """A Megatron checkpoint directory is missing, damaged or does not match the model."""


class NotACheckpoint(MegatronCheckpointError, UsageError):
    """The directory given as a checkpoint is absent or not one slimectl wrote (exit code 2)."""

    exit_code = 2
