"""The run-directory contract v1 (docs/run-directory.md): the spine every stage shares."""

from slimectl.contract.rundir.artifacts import CONTRACT, CONTRACT_VERSION, KINDS, READY, Artifact, ArtifactStore
from slimectl.contract.rundir.cursor import ConsumptionCursor, CursorState
from slimectl.contract.rundir.locks import StageLock
from slimectl.contract.rundir.registry import EngineRecord, EngineRegistry
from slimectl.contract.rundir.run import RunDir

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
