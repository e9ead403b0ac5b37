"""Disk transport: every engine loads the published files of a version itself, as its format says
(:meth:`slimectl.weight_formats.WeightFormat.push_disk`: full weights with ``/update_weights_from_disk``).

The directory must be readable by the engines at the same path (one machine, or a shared
filesystem); ``/update_weights_from_disk`` carries the weight version.
"""

from __future__ import annotations

from slimectl.contract.errors import SlimectlError
from slimectl.weight_formats import WeightSource
from slimectl.stages.sync.transport import WeightTransport


class DiskTransport(WeightTransport):
    name = "disk"

    async def push(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        if source.hf_dir is None or not source.hf_dir.is_dir():
            raise SlimectlError(f"weight version {source.version} has no HF directory on disk for the disk transport "
                                f"({source.hf_dir}); publish weights/{source.version:06d} or use the distributed transport")
        return await source.form.push_disk(clients, source, flush_cache)

