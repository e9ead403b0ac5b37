"""The interface every weight transport implements, and how one is chosen."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from slimectl.weight_formats import WeightSource


@dataclass
class EngineTarget:
    """One engine to update: its registry id (None when given by URL) and its base URL."""

    url: str
    id: str | None = None


class WeightTransport(ABC):
    """Moves one weight version into engines that the caller has already paused.

    ``connect`` is called once before the first ``push`` (a distributed transport builds its
    process group there and keeps it across pushes); ``close`` tears down what ``connect`` built.
    ``push`` returns the number of bytes it moved. ``flush_cache`` is SGLang's flag of the update calls (the
    engine flushes its cache once the weights are in, and fails the call when requests still run): false
    under an ``in_place`` pause, whose requests run on.
    """

    name: str = ""
    progress: str = "auto"  # logging.progress, for transports that move weights in steps (buckets)

    async def connect(self, clients: dict) -> None:  # noqa: B027 - optional hook
        """Prepare the transport for ``clients`` ({url: EngineClient})."""

    @abstractmethod
    async def push(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        """Load ``source`` into every engine; raise naming the engine on failure."""

    async def close(self, clients: dict) -> None:  # noqa: B027 - optional hook
        """Undo ``connect``."""


def make_transport(kind: str, sync_cfg) -> WeightTransport:
    if kind == "disk":
        from slimectl.stages.sync.disk import DiskTransport

        return DiskTransport()
    if kind == "distributed":
        from slimectl.stages.sync.distributed import DistributedTransport

        return DistributedTransport(sync_cfg)
    raise ValueError(f"unknown sync transport {kind!r}; expected disk or distributed")
