"""``slimectl sync``: push a weight version to every registered engine.

Two transports behind one small interface (:class:`slimectl.stages.sync.transport.WeightTransport`),
one module each:

- :mod:`slimectl.stages.sync.disk` — engines load ``weights/N`` (HF safetensors) through
  ``/update_weights_from_disk``;
- :mod:`slimectl.stages.sync.distributed` — the trainer joins a process group with every engine rank
  (``/init_weights_update_group``) and broadcasts HF-named tensors in buckets while each engine
  receives them through ``/update_weights_from_distributed`` (NCCL on GPU, gloo on CPU).

What each transport calls on the engines is the version's format's (:mod:`slimectl.weight_formats`: full weights
as above; a LoRA run's adapter with ``/load_lora_adapter``, or merged into the base for engines that serve none).

:func:`slimectl.stages.sync.stage.sync_engines` is the choreography both share: pause → flush →
transport → flush → continue (engines are never left paused), then every engine must report
the new weight version; ``verify`` compares sampled tensors read back from each engine with
the trainer's.
"""

from slimectl.weight_formats import WeightSource
from slimectl.stages.sync.stage import SyncResult, run_sync, sync_engines

__all__ = ["SyncResult", "WeightSource", "run_sync", "sync_engines"]
