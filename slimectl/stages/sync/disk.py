"""Disk transport: every engine loads the published HF safetensors of a version itself (a LoRA run's: its
adapter, with ``/load_lora_adapter``).

The directory must be readable by the engines at the same path (one machine, or a shared
filesystem); ``/update_weights_from_disk`` carries the weight version.
"""

from __future__ import annotations

import asyncio

from slimectl.contract.errors import SlimectlError
from slimectl.engines.pool import POLICY_ADAPTER
from slimectl.stages.sync.source import WeightSource
from slimectl.stages.sync.transport import WeightTransport


class DiskTransport(WeightTransport):
    name = "disk"

    async def push(self, clients: dict, source: WeightSource, flush_cache: bool = True) -> int:
        if source.hf_dir is None or not source.hf_dir.is_dir():
            raise SlimectlError(f"weight version {source.version} has no HF directory on disk for the disk transport "
                                f"({source.hf_dir}); publish weights/{source.version:06d} or use the distributed transport")
        path = str(source.hf_dir.resolve())
        version = str(source.version)
        if source.adapter is not None:  # a LoRA run: the adapter, over the base the engines serve
            await asyncio.gather(*(c.swap_lora_adapter(POLICY_ADAPTER, path, version)
                                   for c in clients.values()))
            return sum(f.stat().st_size for f in source.hf_dir.glob("*.safetensors")) * len(clients)
        await asyncio.gather(*(c.update_weights_from_disk(path, weight_version=version, flush_cache=flush_cache)
                               for c in clients.values()))
        return sum(f.stat().st_size for f in source.hf_dir.glob("*.safetensors")) * len(clients) if clients else 0

