"""The run-directory contract v1 (docs/run-directory.md): the spine every stage shares."""

from slimectl.rundir.artifacts import CONTRACT, CONTRACT_VERSION, KINDS, READY, Artifact, ArtifactStore
from slimectl.rundir.cursor import ConsumptionCursor, CursorState
from slimectl.rundir.locks import StageLock
from slimectl.rundir.registry import EngineRecord, EngineRegistry
from slimectl.rundir.run import RunDir

__all__ = [
    "CONTRACT",
    "CONTRACT_VERSION",
    "KINDS",
    "READY",
    "Artifact",
    "ArtifactStore",
    "ConsumptionCursor",
    "CursorState",
    "EngineRecord",
    "EngineRegistry",
    "RunDir",
    "StageLock",
]
