"""Exceptions the library raises for expected failures.

Every message is one line that names the thing at fault (file, key, artifact, engine URL)
and what to do about it. The CLI turns :class:`UsageError` into exit code 2 and every other
:class:`SlimectlError` into exit code 1, without a traceback unless ``SLIMECTL_DEBUG=1``.
"""

from __future__ import annotations


class SlimectlError(Exception):
    """An expected, user-facing failure (exit code 1)."""

    exit_code = 1


class UsageError(SlimectlError):
    """Bad input from the invocation itself: flags, config keys, config values (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file or ``--set`` override is malformed, unknown or out of range."""


class RunDirError(SlimectlError):
    """The run directory is missing, of an unknown version, or in an inconsistent state."""


class RunDirInputError(RunDirError, UsageError):
    """The run directory given is missing or not one, or refuses what the invocation asks of it
    (a different config, a hand-edited config.yaml): fixed by changing the command (exit code 2)."""


class ArtifactNotFound(RunDirError):
    """An artifact that should be READY is not there."""


class ArtifactExists(RunDirError):
    """Publishing would overwrite a READY artifact (pass ``overwrite``/``--force``)."""


class CorruptArtifact(RunDirError):
    """A READY artifact's manifest or files do not match what was published."""


class LockHeld(RunDirError):
    """Another live process holds the stage lock."""


class LockLost(RunDirError):
    """This process's stage lock was taken over (it was presumed dead)."""


class CursorError(RunDirError):
    """A consumption cursor update would consume an item twice or skip one."""


class WaitTimeout(RunDirError):
    """An artifact did not become READY within the timeout."""


class MegatronCheckpointError(SlimectlError):
    """A Megatron checkpoint directory is missing, damaged or does not match the model."""


class NotACheckpoint(MegatronCheckpointError, UsageError):
    """The directory given as a checkpoint is absent or not one slimectl wrote (exit code 2)."""

    exit_code = 2
